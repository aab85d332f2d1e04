"""The torch engine on a tiny random Llama: its outputs against `generate`, its policies,
stops, limits, FIM prompts, prefix reuse, and `run_batch` over it.

The engine's greedy output equal to `model.generate`'s, alone and while requests of other
lengths join, decode and leave beside it, is also the contract test of the slot cache
against transformers' Llama forward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from control.cli.main import main
from control.core.protocol import Job
from tasks.engine.contract import RequestError, RequestStatus, StepOutput, run_batch
from tasks.lm import fim
from tasks.lm.hf_engine import HFEngine
from tasks.lm.slot_cache import SlotCache
from tasks.lm.textstream import TextStream
from tests.support.tiny_lm import build_tiny_llama

CONTEXT = 256
PROMPTS = [
    "def add(a, b):\n    return",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os",
    "for i in range(10):\n    print(i, fib(i))\n" * 3,
    "x",
]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> HFEngine:
    """An engine whose model and tokenizer give the expected outputs through `generate`."""
    return HFEngine(model_dir, max_batch=1)


def make_engine(model_dir: Path, **kwargs: object) -> HFEngine:
    options: dict[str, object] = {"max_batch": 4, "prefill_chunk": 16, "token_budget": 24, "threads": 1, **kwargs}
    return HFEngine(model_dir, **options)  # type: ignore[arg-type]


def make_job(id: str, prompt: str, max_tokens: int = 12, **fields: object) -> Job:
    return Job(
        id=id,
        key=id,
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        gateway="test",
        received_ms=0.0,
        deadline_ms=1e15,
        **fields,  # type: ignore[arg-type]
    )


def generate_text(reference: HFEngine, job: Job) -> tuple[str, int]:
    """`model.generate` with greedy decoding on the engine's own prompt ids: (text, tokens)."""
    ids = torch.tensor([reference.encode_prompt(job)])
    max_new = min(job.max_tokens, reference.max_context - ids.shape[1])
    with torch.inference_mode():
        out = reference.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=sorted(reference.eos_ids),
            pad_token_id=reference.pad_id,
        )
    new = [t for t in out[0, ids.shape[1] :].tolist() if t not in reference.eos_ids]
    return reference.decode_text(new), len(new)


def drain(engine: HFEngine, outputs: dict[str, StepOutput], deltas: dict[str, str]) -> Iterator[list[StepOutput]]:
    """Step until the engine is empty, collecting final outputs and streamed text."""
    while engine.has_unfinished():
        step = engine.step()
        for out in step:
            deltas[out.id] = deltas.get(out.id, "") + out.delta
            if out.is_finished:
                outputs[out.id] = out
        yield step


def run_all(engine: HFEngine) -> tuple[dict[str, StepOutput], dict[str, str]]:
    outputs: dict[str, StepOutput] = {}
    deltas: dict[str, str] = {}
    for _ in drain(engine, outputs, deltas):
        pass
    return outputs, deltas


def test_the_slot_cache_is_a_transformers_cache(reference: HFEngine) -> None:
    assert isinstance(reference.cache, SlotCache)
    assert len(reference.cache.layers) == reference.model.config.num_hidden_layers
    assert reference.cache.layers[0].keys.shape[2] == CONTEXT


def test_greedy_alone_equals_generate(model_dir: Path, reference: HFEngine) -> None:
    engine = make_engine(model_dir)
    job = make_job("alone", PROMPTS[1], max_tokens=20)
    engine.add_request(job)
    outputs, deltas = run_all(engine)
    text, num_tokens = generate_text(reference, job)
    assert outputs["alone"].text == text
    assert outputs["alone"].completion_tokens == num_tokens
    assert deltas["alone"] == text


def test_greedy_batched_with_others_equals_generate(model_dir: Path, reference: HFEngine) -> None:
    """Requests of other lengths join, prefill in chunks and leave while each one decodes."""
    engine = make_engine(model_dir, max_batch=3)
    jobs = [make_job(f"r{i}", prompt, max_tokens=6 + 5 * i) for i, prompt in enumerate(PROMPTS)]
    outputs: dict[str, StepOutput] = {}
    deltas: dict[str, str] = {}
    engine.add_request(jobs[0])
    pending = jobs[1:]
    for _ in drain(engine, outputs, deltas):
        if pending and engine.free_slots():
            engine.add_request(pending.pop(0))  # joins between steps, into whichever slot is free
    assert engine.stats()["decode_tokens"] > 0
    for job in jobs:
        text, num_tokens = generate_text(reference, job)
        assert (outputs[job.id].text, outputs[job.id].completion_tokens) == (text, num_tokens), job.id
        assert deltas[job.id] == text


def test_static_batch_stays_until_all_finish(model_dir: Path, reference: HFEngine) -> None:
    engine = make_engine(model_dir, policy="static")
    jobs = [make_job(f"s{i}", PROMPTS[i], max_tokens=n) for i, n in enumerate((2, 5, 9))]
    for job in jobs:
        engine.add_request(job)
    finished_at = []
    step = 0
    while engine.has_unfinished():
        outs = engine.step()
        step += 1
        if engine.has_unfinished():
            assert engine.free_slots() == 0  # nobody joins a running batch
        finished_at += [(step, out) for out in outs if out.is_finished]
    assert len({at for at, _ in finished_at}) == 1  # all reported together, when the last one ends
    assert engine.free_slots() == engine.max_batch
    assert engine.stats()["padding_tokens"] > 0  # the finished ones kept running as padded rows
    for _, out in finished_at:
        job = next(j for j in jobs if j.id == out.id)
        assert out.text == generate_text(reference, job)[0]
    assert not engine.continuous


def test_abort_frees_the_slot_at_once(model_dir: Path, reference: HFEngine) -> None:
    engine = make_engine(model_dir, max_batch=2)
    keep = make_job("keep", PROMPTS[0], max_tokens=16)
    engine.add_request(make_job("gone", PROMPTS[3], max_tokens=16))
    engine.add_request(keep)
    outputs: dict[str, StepOutput] = {}
    deltas: dict[str, str] = {}
    steps = drain(engine, outputs, deltas)
    for _ in range(6):
        next(steps)
    assert engine.free_slots() == 0
    engine.abort_request("gone")
    assert engine.free_slots() == 1
    engine.add_request(make_job("next", PROMPTS[1], max_tokens=8))
    deltas.pop("gone", None)
    for step_outputs in steps:
        assert all(out.id != "gone" for out in step_outputs)
    assert "gone" not in outputs
    assert engine.stats()["aborted"] == 1
    for job in (keep, make_job("next", PROMPTS[1], max_tokens=8)):
        assert outputs[job.id].text == generate_text(reference, job)[0]


def test_stop_sequence_cuts_and_deltas_add_up(model_dir: Path, reference: HFEngine) -> None:
    full, _ = generate_text(reference, make_job("probe", PROMPTS[0], max_tokens=30))
    stop = full[8:11]
    cut = full.find(stop)
    engine = make_engine(model_dir)
    engine.add_request(make_job("stopped", PROMPTS[0], max_tokens=30, stop=["never there", stop]))
    outputs: dict[str, StepOutput] = {}
    deltas: dict[str, str] = {}
    for _ in drain(engine, outputs, deltas):
        # Whatever was streamed is final: the stop never cuts text already sent.
        assert full[:cut].startswith(deltas.get("stopped", ""))
    out = outputs["stopped"]
    assert out.status == RequestStatus.FINISHED_STOPPED
    assert out.finish_reason == "stop"
    assert out.text == full[:cut]
    assert deltas["stopped"] == out.text


def test_max_tokens_finishes_with_length(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.add_request(make_job("short", PROMPTS[2], max_tokens=3))
    out = run_all(engine)[0]["short"]
    assert out.finish_reason in ("length", "stop")
    if out.finish_reason == "length":
        assert out.completion_tokens == 3


def test_text_stream_holds_half_characters(reference: HFEngine) -> None:
    tok = reference.tokenizer
    text = "a🙂b ж"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text)  # the emoji is split over several byte tokens
    stream = TextStream(reference.decode_text, [])
    pieces = []
    for token in ids:
        stream.push(token)
        piece = stream.take()
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(stream.finish())
    assert "".join(pieces) == text


def test_text_stream_holds_back_a_possible_stop(reference: HFEngine) -> None:
    tok = reference.tokenizer
    stream = TextStream(reference.decode_text, ["\n\n"])
    sent = ""
    for token in tok("x = 1\n\ny = 2", add_special_tokens=False).input_ids:
        stream.push(token)
        sent += stream.take()
        assert "\n" not in sent  # a lone newline might start the stop, so it waits
    sent += stream.finish()
    assert sent == "x = 1"
    assert stream.is_stopped


def test_too_long_prompt_is_refused_with_413(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    words = "a = 1\n" * 400
    with pytest.raises(RequestError) as err:
        engine.add_request(make_job("long", words))
    assert err.value.status == 413
    assert err.value.code == "prompt_too_long"
    assert str(CONTEXT) in err.value.message
    assert not engine.has_unfinished()


def test_max_tokens_is_clipped_to_the_context(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    tok = engine.tokenizer
    ids = tok("a = 1\n" * 200, add_special_tokens=False).input_ids[: CONTEXT - 2]
    prompt = tok.decode(ids)
    assert len(engine.encode_prompt(make_job("p", prompt))) == CONTEXT - 2
    engine.add_request(make_job("edge", prompt, max_tokens=50))
    out = run_all(engine)[0]["edge"]
    assert out.completion_tokens <= 2
    assert out.finish_reason in ("length", "stop")


def test_fim_prompt_encodes_the_special_tokens(model_dir: Path, reference: HFEngine) -> None:
    tok = reference.tokenizer
    job = make_job("fim", "def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))\n", max_tokens=10)
    ids = reference.encode_prompt(job)
    specials = tok.convert_tokens_to_ids([fim.FIM_PREFIX, fim.FIM_SUFFIX, fim.FIM_MIDDLE])
    assert [i for i in ids if i in specials] == specials  # each marker once, as one token, in PSM order
    assert ids[0] == specials[0] and ids[-1] == specials[2]
    engine = make_engine(model_dir)
    engine.add_request(job)
    assert run_all(engine)[0]["fim"].text == generate_text(reference, job)[0]


def test_an_empty_prompt_starts_a_document(model_dir: Path, reference: HFEngine) -> None:
    job = make_job("empty", "", max_tokens=8)
    assert reference.encode_prompt(job) == [reference.tokenizer.convert_tokens_to_ids(fim.END_OF_TEXT)]
    engine = make_engine(model_dir)
    engine.add_request(job)
    assert run_all(engine)[0]["empty"].text == generate_text(reference, job)[0]


def test_special_token_text_in_a_prompt_stays_text(reference: HFEngine) -> None:
    job = make_job("inject", f"s = '{fim.END_OF_TEXT}'", suffix=f"# {fim.FIM_MIDDLE}")
    ids = reference.encode_prompt(job)
    assert reference.tokenizer.eos_token_id not in ids
    fim_ids = reference.tokenizer.convert_tokens_to_ids([fim.FIM_PREFIX, fim.FIM_SUFFIX, fim.FIM_MIDDLE])
    assert [i for i in ids if i in fim_ids] == fim_ids


def test_prefix_cache_prefills_less_and_gives_the_same_output(model_dir: Path, reference: HFEngine) -> None:
    shared = PROMPTS[1] * 3  # a long prefix, as completions in one file share
    first, second = make_job("first", shared + "x = 1\n"), make_job("second", shared + "y = fib(3)\n", max_tokens=15)
    engine = make_engine(model_dir, prefix_cache_tokens=4096)
    engine.add_request(first)
    run_all(engine)
    engine.add_request(make_job("filler", PROMPTS[3] * 2))  # overwrites the slot `first` used
    run_all(engine)
    before = engine.stats()["prefill_tokens"]
    engine.add_request(second)
    out = run_all(engine)[0]["second"]
    prompt_len = len(engine.encode_prompt(second))
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] >= 64
    assert stats["prefill_tokens"] - before == prompt_len - stats["prefix_hit_tokens"]
    assert 0 < stats["prefix_hit_rate"] < 1
    uncached = make_engine(model_dir, prefix_cache_tokens=0)
    uncached.add_request(second)
    assert out.text == run_all(uncached)[0]["second"].text == generate_text(reference, second)[0]
    assert uncached.stats()["prefix_hit_tokens"] == 0


class Recorder:
    """A replica's side of `run_batch`: collects streamed text, cancels on request."""

    def __init__(self, cancel: set[str] | None = None) -> None:
        self.streamed: dict[str, str] = {}
        self.to_cancel = cancel or set()
        self.renewals = 0

    def cancelled(self) -> set[str]:
        return self.to_cancel

    def emit(self, request_id: str, text: str) -> None:
        self.streamed[request_id] = self.streamed.get(request_id, "") + text

    def end_step(self) -> None:
        self.renewals += 1


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_run_batch_over_the_engine(model_dir: Path, reference: HFEngine, policy: str) -> None:
    engine = make_engine(model_dir, policy=policy)
    jobs = [make_job(f"b{i}", prompt, max_tokens=4 + 3 * i) for i, prompt in enumerate(PROMPTS[:3])]
    jobs.append(make_job("huge", "a = 1\n" * 400))
    control = Recorder()
    outputs = run_batch(engine, jobs, control)
    assert [o.id for o in outputs] == [j.id for j in jobs]
    for job, out in zip(jobs[:3], outputs, strict=False):
        text, num_tokens = generate_text(reference, job)
        assert (out.text, out.completion_tokens) == (text, num_tokens)
        # What streamed while the request ran starts its text; the rest comes with the answer.
        assert text.startswith(control.streamed.get(job.id, ""))
    if policy == "continuous":
        assert any(control.streamed.values())  # text did stream before the answers
    assert (outputs[3].finish_reason, outputs[3].http_status) == ("error", 413)
    assert control.renewals > 0
    assert not engine.has_unfinished()


def test_a_prompt_the_tokenizer_cannot_read_fails_alone(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.add_request(make_job("bad", "x = '\ud800'"))  # a lone surrogate is no UTF-8
    engine.add_request(make_job("good", PROMPTS[0], max_tokens=4))
    outputs, _ = run_all(engine)
    assert outputs["bad"].status == RequestStatus.FINISHED_ERROR
    assert outputs["bad"].code == "tokenizer_error"
    assert outputs["good"].status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    assert outputs["good"].completion_tokens > 0


def test_sampling_is_reproducible_per_request(model_dir: Path, reference: HFEngine) -> None:
    def sample(id: str, **fields: object) -> str:
        engine = make_engine(model_dir, seed=7)
        engine.add_request(make_job(id, PROMPTS[0], max_tokens=12, **fields))
        return run_all(engine)[0][id].text

    warm = {"temperature": 1.5, "top_p": 0.95}
    assert sample("same", **warm) == sample("same", **warm)
    # A nucleus this small holds only the most likely token: greedy.
    narrow = sample("narrow", temperature=1.0, top_p=1e-9)
    assert narrow == generate_text(reference, make_job("narrow", PROMPTS[0], max_tokens=12))[0]


def test_costs_come_from_measurement(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    assert engine.expected_step_ms() > 0  # measured at start-up
    idle = engine.expected_batch_ms()
    assert idle > 0
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(make_job(f"c{i}", prompt, max_tokens=6))
    run_all(engine)
    stats = engine.stats()
    assert stats["steps"] > 0 and stats["step_ms"] > 0
    assert stats["running"] == stats["waiting"] == 0
    assert stats["decode_tokens"] + stats["prefill_tokens"] > 0
    assert engine.name == f"hf:{model_dir.name}"


def test_the_cli_loads_torch_only_for_the_engine_bench() -> None:
    code = (
        "import sys, control.cli.main as cli; "
        "args = cli._parser().parse_args(['bench', 'engine', '--model', 'x', '--json', 'f.json']); "
        "assert (args.bench, args.model, args.json) == ('engine', 'x', 'f.json'); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_engine_bench_measures_the_curve(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "curve.json"
    argv = ["bench", "engine", "--model", str(model_dir), "--threads", "1", "--batches", "1,2"]
    argv += ["--contexts", "64,128,512", "--chunks", "16", "--repeats", "1", "--json", str(out)]
    assert main([*argv, "--serve", "3", "--serve-rps", "100", "--serve-batch", "2"]) == 0
    report = json.loads(out.read_text())
    for name in ("static", "continuous", "continuous_no_prefix_cache"):
        assert report["serve"]["by_rps"]["100"][name]["requests"] == 3
    assert set(report["decode_ms"]) == {"64", "128"}  # 512 is beyond the tiny model's context
    assert set(report["decode_ms"]["64"]) == {"1", "2"}
    assert report["prefill_ms"]["16"] > 0
    assert report["model"]["context"] == CONTEXT
