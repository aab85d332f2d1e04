"""The body is taken strictly (no coercion, no option silently ignored, no repeated name);
anonymous callers never reach each other; which endpoints need a key or the scrape token."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
import requests

from tests.support.busy import busy_replicas, queued_behind_busy_replicas
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY, Deployment
from tests.support.gateways import gateway_process

SCRAPE = "scrape-secret"


def _refused(resp: requests.Response, field: str, code: str = "invalid_request") -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and field in error["message"], error


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", True), ("max_tokens", 8.0), ("stream", "yes"), ("stream", 1), ("temperature", "0.5")],
)
def test_a_value_of_the_wrong_type_is_refused_not_coerced(kb: Deployment, field: str, value: object) -> None:
    _refused(kb.post({"model": MODEL, "prompt": "x", field: value}), field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("echo", True),
        ("logprobs", 1),
        ("logprobs", 0),
        ("best_of", 2),
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1),
        ("logit_bias", {"50256": -100}),
        ("seed", 7),
        ("stream_options", {"include_usage": True}),
        ("top_k", 1),  # not OpenAI's either
    ],
)
def test_an_option_keybatch_does_not_implement_is_refused_by_name(kb: Deployment, field: str, value: object) -> None:
    _refused(kb.post({"model": MODEL, "prompt": "x", field: value}), field)


def test_openais_defaults_of_those_options_are_accepted(kb: Deployment) -> None:
    defaults = {"echo": False, "n": 1, "logprobs": None, "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0}
    defaults |= {"logit_bias": {}, "seed": None, "stream_options": None, "user": "u-1"}
    resp = kb.post({"model": MODEL, "prompt": "x", "max_tokens": 4, **defaults})
    assert resp.status_code == 200, resp.text


def test_an_empty_stop_string_is_refused_as_an_empty_stop_list_is(kb: Deployment) -> None:
    alone, listed = (
        kb.post({"model": MODEL, "prompt": "x", "stop": ""}),
        kb.post({"model": MODEL, "prompt": "x", "stop": [""]}),
    )
    _refused(alone, "stop")
    _refused(listed, "stop")
    assert alone.json() == listed.json()


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "kb-small", "prompt": "a", "prompt": "b"}',
        b'{"model": "kb-small", "prompt": "a", "max_tokens": 4, "max_tokens": 200}',
        b'{"model": "kb-small", "prompt": "a", "logit_bias": {"1": 0, "1": 5}}',
    ],
)
def test_a_body_that_repeats_a_name_is_refused(kb: Deployment, raw: bytes) -> None:
    resp = requests.post(f"{kb.url}/v1/completions", data=raw, headers={"Authorization": f"Bearer {FREE_KEY}"})
    _refused(resp, "repeats", "invalid_json")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "kb-small", "prompt": "a", "temperature": NaN}',
        b'{"model": "kb-small", "prompt": "a", "temperature": Infinity}',
        b'{"model": "kb-small", "prompt": "a", "temperature": -Infinity}',
        b'{"model": "kb-small", "prompt": "\\ud800"}',  # a lone surrogate
        b'{"model": "kb-small", "prompt": "\xff"}',  # not UTF-8
        b'\xef\xbb\xbf{"model": "kb-small", "prompt": "a"}',  # a byte order mark, which JSON has not
        b"[" * 100_000,
    ],
)
def test_a_body_that_is_not_strict_json_is_refused(kb: Deployment, raw: bytes) -> None:
    resp = requests.post(f"{kb.url}/v1/completions", data=raw, headers={"Authorization": f"Bearer {FREE_KEY}"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json", resp.text


def test_the_openai_client_with_its_usual_options_still_works(kb: Deployment) -> None:
    client = openai.OpenAI(base_url=f"{kb.url}/v1", api_key=PAID_KEY, max_retries=0)
    options = {"max_tokens": 5, "temperature": 0, "top_p": 1, "stop": ["\n\n"], "n": 1, "echo": False, "user": "me"}
    done = client.completions.create(model=MODEL, prompt="import os\n", **options)  # type: ignore[call-overload]
    assert done.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="import os\n", stream=True, **options))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt="x", echo=True)


# -- anonymous callers -------------------------------------------------------------


def test_anonymous_callers_sharing_an_address_and_a_session_id_do_not_supersede_each_other(kb: Deployment) -> None:
    older, busy = queued_behind_busy_replicas(kb, key=None, **{"X-Session-Id": "shared-session"})
    newer = kb.post(key=None, **{"X-Session-Id": "shared-session"})
    assert (older.result(5).status_code, newer.status_code) == (200, 200), older.result().text
    [f.result() for f in busy]


def test_an_anonymous_caller_cancels_its_request_by_the_id_it_is_given(kb: Deployment) -> None:
    busy = busy_replicas(kb)
    body = {"model": MODEL, "prompt": "def f():\n    ", "stream": True}
    with requests.post(
        f"{kb.url}/v1/completions", json=body, headers={"X-Request-Id": "anon-own"}, stream=True, timeout=10
    ) as stream:
        assert stream.headers["X-Request-Id"] == "anon-own"
        cancel_id = stream.headers["X-Cancel-Id"]
        assert cancel_id != "anon-own"
        assert requests.delete(f"{kb.url}/v1/completions/anon-own").status_code == 404  # the chosen id is no key
        assert requests.delete(f"{kb.url}/v1/completions/{cancel_id}").status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith(b"data: {")]
    assert json.loads(events[-1][6:])["error"]["code"] == "cancelled"
    [f.result() for f in busy]


# -- which endpoints need a key ----------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_only(kb: Deployment) -> Iterator[str]:
    with gateway_process(kb, allow_anonymous="false") as url:
        yield url


@pytest.fixture(scope="module")
def with_scrape_token(kb: Deployment) -> Iterator[str]:
    with gateway_process(kb, allow_anonymous="false", metrics_token=SCRAPE) as url:
        yield url


def _get(url: str, path: str, token: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.get(f"{url}{path}", headers=headers, timeout=5)


def test_with_anonymous_access_off_open_endpoints_tell_nothing_of_the_deployment(keyed_only: str) -> None:
    assert _get(keyed_only, "/healthz").json() == {"status": "ok"}
    assert _get(keyed_only, "/readyz").json() == {"status": "ready"}  # no models, no counts
    assert _get(keyed_only, "/readyz", FREE_KEY).json() == {"status": "ready", "replicas": {MODEL: 2}}
    assert MODEL not in _get(keyed_only, "/openapi.json").text
    assert MODEL in _get(keyed_only, "/openapi.json", PAID_KEY).text
    metrics = _get(keyed_only, "/metrics")
    assert metrics.status_code == 401 and metrics.json()["error"]["code"] == "missing_scrape_token"
    assert _get(keyed_only, "/metrics", PAID_KEY).status_code == 401  # an API key is not a scrape token
    assert _get(keyed_only, "/v1/models").status_code == 401


def test_metrics_need_the_scrape_token_when_one_is_set(with_scrape_token: str) -> None:
    assert _get(with_scrape_token, "/metrics").status_code == 401
    assert _get(with_scrape_token, "/metrics", "wrong").json()["error"]["code"] == "invalid_scrape_token"
    scraped = _get(with_scrape_token, "/metrics", SCRAPE)
    assert scraped.status_code == 200 and "keybatch_requests" in scraped.text
    assert _get(with_scrape_token, "/readyz", SCRAPE).json()["replicas"] == {MODEL: 2}
