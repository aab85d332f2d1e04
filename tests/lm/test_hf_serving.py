"""The real model through the real path: gateway, Celery queue, a continuous replica
running the torch engine on a quick-built model, answers back over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests

from tasks.lm.fim import format_prompt
from tests.support.deploy import FREE_KEY, MODEL, Deployment, deployment
from tests.support.lm_fixtures import quick_model  # noqa: F401  (a fixture)
from tests.support.waiting import until

pytestmark = pytest.mark.slow

PROMPT = "import os\n\n\ndef list_files(root):\n    "


@pytest.fixture(scope="module")
def hf(quick_model: Path) -> Iterator[Deployment]:  # noqa: F811
    with deployment(
        workers=1, backend="hf", policy="continuous", models_dir=str(quick_model.parent), max_batch="8"
    ) as d:
        yield d


BUDGET = {"X-Deadline-Ms": "20000"}  # a shared CI machine: these tests are about answers, not speed


def _complete(d: Deployment, **body: object) -> requests.Response:
    return d.post({"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **body}, **BUDGET)


def _fleet(d: Deployment) -> list[dict]:
    import redis

    from control.broker import keys

    state = redis.Redis.from_url(d.system.redis_url)
    return [state.hgetall(keys.replica_key(n.decode())) for n in state.smembers(keys.REPLICAS_KEY)]


def test_each_request_gets_one_answer(hf: Deployment) -> None:
    prompts = [f"{PROMPT}# {i}\n    " for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda p: _complete(hf, prompt=p, max_tokens=4 + 3 * len(p) % 24), prompts))
    assert [a.status_code for a in answers] == [200] * 12, (
        [a.text for a in answers if a.status_code != 200],
        _fleet(hf),
    )
    bodies = [a.json() for a in answers]
    assert len({b["id"] for b in bodies}) == 12
    assert all(b["keybatch"]["backend"] == f"hf:{MODEL}" for b in bodies)
    assert all(0 < b["usage"]["completion_tokens"] <= 4 + 3 * len(p) % 24 for b, p in zip(bodies, prompts, strict=True))


def test_streamed_chunks_add_up_to_the_text_at_temperature_zero(hf: Deployment) -> None:
    client = openai.OpenAI(base_url=f"{hf.url}/v1", api_key=FREE_KEY, max_retries=0)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_headers=BUDGET)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True, extra_headers=BUDGET
    )
    chunks = [c.choices[0].text for c in stream]
    assert len([c for c in chunks if c]) > 1  # text came as it was written, not in one piece
    assert "".join(chunks) == whole.choices[0].text


def test_the_suffix_reaches_the_model_as_fill_in_the_middle(hf: Deployment) -> None:
    from transformers import AutoTokenizer

    suffix = "\n    return files\n"
    plain = _complete(hf).json()
    fim = _complete(hf, suffix=suffix).json()
    tokenizer = AutoTokenizer.from_pretrained(hf.system.settings.model_path(MODEL))
    assert plain["usage"]["prompt_tokens"] == len(tokenizer(PROMPT)["input_ids"])
    assert fim["usage"]["prompt_tokens"] == len(tokenizer(format_prompt(PROMPT, suffix))["input_ids"])


def test_a_prompt_longer_than_the_context_is_413_not_a_crash(hf: Deployment) -> None:
    answer = _complete(hf, prompt="x = 1\n" * 3000)
    assert answer.status_code == 413
    assert "context" in answer.json()["error"]["message"]
    assert _complete(hf).status_code == 200  # the replica serves on


def test_stop_sequences_and_max_tokens_are_honoured(hf: Deployment) -> None:
    free = _complete(hf, max_tokens=32).json()["choices"][0]["text"]
    assert len(free) > 2
    stop = free[1:3]
    cut = _complete(hf, max_tokens=32, stop=[stop]).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert stop not in cut["choices"][0]["text"] and free.startswith(cut["choices"][0]["text"])
    one = _complete(hf, max_tokens=1).json()
    assert one["usage"]["completion_tokens"] == 1 and one["choices"][0]["finish_reason"] == "length"


def test_a_cancel_mid_generation_ends_the_request_and_the_engine_drops_it(hf: Deployment) -> None:
    auth = {"Authorization": f"Bearer {FREE_KEY}"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 256, "stream": True}
    aborted_before = _engine_counter(hf, "aborted")
    headers = {**auth, **BUDGET, "X-Request-Id": "long-1"}
    with requests.post(f"{hf.url}/v1/completions", json=body, headers=headers, stream=True, timeout=30) as resp:
        events = (line for line in resp.iter_lines() if line.startswith(b"data: "))
        next(events)  # text came: it is generating
        cancel = requests.delete(f"{hf.url}/v1/completions/long-1", headers=auth, timeout=5)
        rest = list(events)
    assert cancel.status_code == 200
    assert b'"code": "cancelled"' in rest[-2] and rest[-1] == b"data: [DONE]"
    # The engine dropped it (an abort, not a run to 256 tokens): the replica's counters say so.
    assert until(lambda: _engine_counter(hf, "aborted") > aborted_before, 5)
    assert _complete(hf, max_tokens=4).status_code == 200


def _engine_counter(d: Deployment, name: str) -> float:
    return sum(float(h.get(f"engine_{name}".encode(), 0)) for h in _fleet(d))
