"""POST /v1/completions and DELETE /v1/completions/<id>."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

import orjson
from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context
from pydantic import ValidationError

from api import peers
from api.disconnect import hangup_event
from api.environ import BODY
from api.errors import ApiError, describe
from api.gateway import Gateway, Waiter
from api.schemas import CompletionRequest
from control.core import protocol as p
from control.core.settings import Settings
from control.core.vocab import FREE, Tier

bp = Blueprint("completions", __name__)

_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def gateway() -> Gateway:
    return current_app.extensions["keybatch"]


def _field(environ: dict[str, Any], name: str) -> str | None:
    """A request header, as `request.headers.get(name)` reads it (werkzeug's headers are the
    environ's HTTP_ keys), without a proxy lookup and werkzeug's header layer each time."""
    return environ.get("HTTP_" + name.upper().replace("-", "_"))


def _header_id(environ: dict[str, Any], name: str) -> str | None:
    value = _field(environ, name)
    if value is None:
        return None
    if not _ID.match(value):
        raise ApiError(400, f"{name} must be 1-128 characters of A-Z a-z 0-9 . _ : -", "invalid_header")
    return value


ANONYMOUS = "anonymous"


def caller(settings: Settings, environ: dict[str, Any] | None = None) -> tuple[Tier, str]:
    """The key decides the tier (no header can raise it) and the tenant its request ids,
    sessions and cancels are scoped to."""
    auth = _field(request.environ if environ is None else environ, "Authorization")
    if auth is None:
        if settings.allow_anonymous:
            return FREE, ANONYMOUS
        raise ApiError(401, "an API key is required (Authorization: Bearer KEY)", "missing_api_key")
    scheme, _, key = auth.partition(" ")
    key = key.strip()
    tier = settings.api_keys.get(key) if scheme.lower() == "bearer" else None
    if tier is None:
        raise ApiError(401, "invalid API key", "invalid_api_key")
    return tier, hashlib.sha256(key.encode()).hexdigest()[:16]


def _budget_ms(settings: Settings, environ: dict[str, Any]) -> float:
    raw = _field(environ, "X-Deadline-Ms")
    if raw is None:
        return settings.deadline_ms
    try:
        budget = float(raw)
    except ValueError:
        raise ApiError(400, "X-Deadline-Ms must be a number of milliseconds", "invalid_header") from None
    if not 0 < budget <= settings.max_deadline_ms:
        raise ApiError(400, f"X-Deadline-Ms must be in (0, {settings.max_deadline_ms:.0f}]", "invalid_header")
    return budget


def _pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object, refused if a name repeats (parsers differ on which one wins)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise ApiError(400, f"the body repeats the field {name!r}", "invalid_json")
            seen.add(name)
    return obj


def _no_constant(name: str) -> object:
    raise ApiError(400, f"{name} is not a JSON number", "invalid_json")


# One decoder for every request (json.loads with a hook builds one, and its scanner, per call).
_STRICT_JSON = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_no_constant)


def _json_body(environ: dict[str, Any]) -> object:
    """The body as strict JSON (UTF-8, no repeated names, no NaN or Infinity, no lone
    surrogate), whatever the Content-Type says. The bytes stay for a forward to a peer
    region (the server's copy leaves `wsgi.input` unread; werkzeug's read is cached)."""
    try:
        raw = environ.get(BODY)  # read whole by the server; else through werkzeug (cached)
        text = (raw if raw is not None else request.get_data(cache=True)).decode("utf-8")
        body = _STRICT_JSON.decode(text)
        if "\\u" in text:  # an escape may be a lone surrogate, which orjson refuses to write
            orjson.dumps(body)
        return body
    except (UnicodeDecodeError, ValueError, RecursionError, orjson.JSONEncodeError):
        raise ApiError(
            400,
            "the body is not strict JSON (UTF-8, no repeated name, no NaN or Infinity, no lone surrogate, "
            "integers within 64 bits)",
            "invalid_json",
        ) from None


def _parse_body(settings: Settings, environ: dict[str, Any]) -> CompletionRequest:
    body = _json_body(environ)
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_json")
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"{first['loc'][0]}: not a field of this endpoint", "invalid_request") from None
        raise ApiError(400, describe(err), "invalid_request") from None
    if req.model not in settings.models:
        raise ApiError(404, f"model {req.model!r} does not exist", "model_not_found")
    if len(req.prompt) + len(req.suffix or "") > settings.max_prompt_chars:
        raise ApiError(413, f"prompt and suffix exceed {settings.max_prompt_chars} characters", "prompt_too_long")
    if req.max_tokens > settings.max_tokens_limit:
        raise ApiError(400, f"max_tokens is at most {settings.max_tokens_limit}", "invalid_request")
    return req


def _scoped(tenant: str, request_id: str | None, session_id: str | None) -> tuple[str, str, str | None, bool]:
    """(the id echoed to the caller, the request's key, the session's key, keep the answer).

    Keys carry the tenant, so no caller reaches another's requests or sessions. All
    anonymous callers share one tenant and nothing tells them apart (one address may be
    many clients), so nothing an anonymous caller chose is used as a key: an id it chose is
    echoed, its request gets an unguessable key it learns from `X-Cancel-Id`, and its
    session id supersedes nothing (docs/decisions/0018).
    """
    if tenant != ANONYMOUS:
        issued = request_id or f"cmpl-{secrets.token_hex(16)}"
        session = f"{tenant}:{session_id}" if session_id else None
        return issued, f"{tenant}:{issued}", session, request_id is not None
    issued = f"cmpl-{secrets.token_hex(16)}"
    return request_id or issued, f"{ANONYMOUS}:{issued}", None, False


def _cancel_header(resp: Response, waiter: Waiter) -> None:
    """What an anonymous caller cancels by: the id the server issued (a keyed caller's is
    the request's own id)."""
    tenant, _, issued = waiter.job.key.partition(":")
    if tenant == ANONYMOUS:
        resp.headers["X-Cancel-Id"] = issued


@bp.post("/v1/completions")
def create_completion() -> Response:
    """Complete one prompt; wait for its batch; answer once (JSON or server-sent events).

    A retry with the X-Request-Id of a request in flight joins it; one answered in the
    last `idempotency_window_s` gets the same answer again."""
    gw = gateway()
    settings = gw.settings
    received = gw.clock.now_ms()
    environ = request.environ  # once: each `request` is a proxy lookup
    tier, tenant = caller(settings, environ)
    request_id, key, session_key, keep = _scoped(
        tenant, _header_id(environ, "X-Request-Id"), _header_id(environ, "X-Session-Id")
    )
    budget = _budget_ms(settings, environ)
    req = _parse_body(settings, environ)
    job = p.Job.model_construct(  # every field checked already, by CompletionRequest or here
        id=secrets.token_urlsafe(16),  # 128 bits in 22 characters: it is named in most broker calls
        key=key,
        keep_ms=int(settings.idempotency_window_s * 1000) if keep else 0,
        model=req.model,
        prompt=req.prompt,
        suffix=req.suffix,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=req.stop_list(),
        tier=tier,
        gateway=gw.id,
        received_ms=received,
        deadline_ms=received + budget,
        stream=req.stream,
        forwarded=peers.is_forwarded(environ),
        stranded=peers.is_stranded(environ),
    )
    if session_key is not None and (reused := gw.reuse(job, session_key)) is not None:
        return _reused_answer(gw, job, request_id, *reused)
    try:
        waiter = gw.submit(job, request_id, session_key)
    except ApiError as err:
        forwarded = peers.forward(gw, job, err)  # another region, when this one cannot serve it
        if forwarded is not None:
            return forwarded
        gw.metrics.of(gw.metrics.requests, job.model, tier, str(err.status)).inc()
        raise
    if req.stream:
        return _stream(gw, waiter)
    _wait(gw, waiter, environ)
    try:
        body = _answer(gw, waiter)
    except ApiError as err:  # the region lost its broker or replicas while the request waited
        forwarded = peers.forward(gw, job, err, stranded=True)
        if forwarded is not None:
            return forwarded
        raise
    resp = jsonify(body)
    resp.headers["X-Request-Id"] = request_id
    _cancel_header(resp, waiter)
    return resp


def _reused_answer(gw: Gateway, job: p.Job, request_id: str, result: p.Result, cell: int) -> Response:
    """The rest of the session's last completion, typed through: no queue, no model."""
    now = gw.clock.now_ms()
    metrics = gw.metrics
    metrics.of(metrics.requests, job.model, job.tier, "200").inc()
    metrics.of(metrics.latency, job.model, job.tier).observe((now - job.received_ms) / 1000)
    metrics.of(metrics.reused, job.model, job.tier).inc()
    resp = jsonify(_completion(request_id, job, result, now, cell))
    resp.headers["X-Request-Id"] = request_id
    return resp


def _wait(gw: Gateway, waiter: Waiter, environ: dict[str, Any]) -> None:
    """Wait for the answer; a client that hangs up meanwhile cancels its request."""
    watch = hangup_event(environ)
    try:
        gw.wait(waiter, watch.event if watch is not None else None)
    finally:
        if watch is not None:
            watch.close()  # before the server reads the socket again


def _answer(gw: Gateway, waiter: Waiter) -> dict:
    """The completion object for a finished request, or raise its error."""
    job, item = waiter.job, waiter.item
    now = gw.clock.now_ms()
    status = 200
    try:
        if isinstance(item, p.Result):
            if waiter.session is not None:
                gw.remember(job, waiter.session, item)
            return _completion(waiter.request_id, job, item, now, waiter.cell)
        status, err = _error_for(item)
        raise err
    finally:
        metrics = gw.metrics
        metrics.of(metrics.requests, job.model, job.tier, str(status)).inc()
        if isinstance(item, p.Result):
            metrics.of(metrics.latency, job.model, job.tier).observe((now - job.received_ms) / 1000)
            metrics.of(metrics.queue_time, job.model, job.tier).observe(
                max(0.0, item.batch_start_ms - job.received_ms) / 1000
            )
            batch = item.batch_end_ms - item.batch_start_ms
            metrics.overhead.observe(max(0.0, now - job.received_ms - batch) / 1000)
            metrics.batch_size.observe(item.batch_size)
            if item.hedged:
                metrics.of(metrics.hedged_answers, job.model, job.tier).inc()


def _error_for(item: object) -> tuple[int, ApiError]:
    if isinstance(item, p.Cancelled | p.Dropped) and item.reason == "unavailable":
        return 503, ApiError(503, "the broker stopped answering; retry shortly", "broker_unavailable", retry_after_s=1)
    if isinstance(item, p.Cancelled | p.Dropped) and item.reason == "no_replica":
        return 503, ApiError(503, "no replica serves this model right now", "no_replica", retry_after_s=1)
    if isinstance(item, p.Cancelled) and item.reason == "bumped":  # ADMIT_BUMP: a paid request took its place
        message = "overloaded: a paid request took its place in the queue"
        return 429, ApiError(429, message, "overloaded", retry_after_s=1)
    if isinstance(item, p.Cancelled | p.Dropped) and item.reason == "retried":
        return 409, ApiError(409, "a retry with the same request id took this request over", "retried")
    if isinstance(item, p.Cancelled | p.Dropped) and item.reason != "expired":
        return 409, ApiError(409, f"the request was {item.reason}", item.reason)
    if isinstance(item, p.Failed) and item.status is not None and 400 <= item.status < 500:
        return item.status, ApiError(item.status, item.message, item.code or "engine_error")
    if isinstance(item, p.Failed) and item.per_request:
        return 422, ApiError(422, item.message, "engine_error")
    if isinstance(item, p.Failed):
        return 503, ApiError(503, f"the replica failed the batch: {item.message}", "replica_failed", retry_after_s=1)
    return 504, ApiError(504, "the deadline passed before the completion was ready", "deadline_exceeded")


def _completion(request_id: str, job: p.Job, res: p.Result, now: float, cell: int) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": job.model,
        "choices": [{"text": res.text, "index": 0, "logprobs": None, "finish_reason": res.finish_reason}],
        "usage": {
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
        },
        "keybatch": {
            "queue_ms": round(max(0.0, res.batch_start_ms - job.received_ms), 2),  # 0: a stored answer
            "batch_ms": round(res.batch_end_ms - res.batch_start_ms, 2),
            "total_ms": round(now - job.received_ms, 2),
            "batch_size": res.batch_size,
            "replica": res.replica,
            "backend": res.backend,
            "tier": job.tier,
            "cell": cell,
            "hedged": res.hedged,
            "reused": res.reused,
        },
    }


def _stream(gw: Gateway, waiter: Waiter) -> Response:
    """Server-sent events in OpenAI's chunk format: text as the model writes it (over
    the gateway's one reply channel), then a last chunk with the finish reason."""

    def events() -> Iterator[str]:
        # A comment first: the headers (with X-Cancel-Id, which is how an anonymous caller
        # learns what it may cancel) go out now, not with the completion.
        try:
            yield ": keybatch\n\n"
        except GeneratorExit:  # the client went before the first write: never waited for
            gw.abandon(waiter)
            raise
        head = {"id": waiter.request_id, "object": "text_completion", "model": waiter.job.model}
        sent, first_seen = 0, False
        watch = hangup_event(request.environ)
        try:
            for chunks in gw.stream(waiter, watch.event if watch is not None else None):
                text, sent = _new_text(chunks, sent)
                if text and not first_seen:
                    first_seen = _first_token(gw, waiter)
                if text:
                    yield _event(head, text, None)
        finally:
            if watch is not None:
                watch.close()
        try:
            body = _answer(gw, waiter)
        except ApiError as err:
            yield f"data: {json.dumps({'error': {'message': err.message, 'type': 'error', 'code': err.code}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        choice = body["choices"][0]
        if choice["text"][sent:] and not first_seen:  # an engine that sends its text whole
            first_seen = _first_token(gw, waiter)
        if choice["text"][sent:]:
            yield _event(body, choice["text"][sent:], None)
        done = {**body, "choices": [{**choice, "text": ""}]}
        yield f"data: {json.dumps(done)}\n\n"
        yield "data: [DONE]\n\n"

    resp = Response(stream_with_context(events()), mimetype="text/event-stream")
    resp.headers["X-Request-Id"] = waiter.request_id
    _cancel_header(resp, waiter)
    resp.headers["Cache-Control"] = "no-cache"
    return resp


def _first_token(gw: Gateway, waiter: Waiter) -> bool:
    ttft_s = (gw.clock.now_ms() - waiter.job.received_ms) / 1000
    gw.metrics.of(gw.metrics.ttft, waiter.job.model, waiter.job.tier).observe(ttft_s)
    return True


def _new_text(chunks: list[p.Chunk], sent: int) -> tuple[str, int]:
    """The part of the chunks past the `sent` characters already written (a request
    re-run after a failover streams its start again)."""
    parts = []
    for chunk in chunks:
        end = chunk.offset + len(chunk.text)
        if chunk.offset <= sent < end:
            parts.append(chunk.text[sent - chunk.offset :])
            sent = end
    return "".join(parts), sent


def _event(head: dict, text: str, finish_reason: str | None) -> str:
    chunk = {
        "id": head["id"],
        "object": "text_completion",
        "created": head.get("created", int(time.time())),
        "model": head["model"],
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }
    return f"data: {json.dumps(chunk)}\n\n"


@bp.delete("/v1/completions/<request_id>")
def cancel_completion(request_id: str) -> Response:
    """Cancel a request in flight; its waiting call answers 409 `cancelled`."""
    gw = gateway()
    _tier, tenant = caller(gw.settings)
    if not _ID.match(request_id):
        raise ApiError(400, "invalid request id", "invalid_request")
    if not gw.cancel(f"{tenant}:{request_id}", "cancelled", tenant):
        raise ApiError(404, f"no request {request_id} in flight", "request_not_found")
    return jsonify({"id": request_id, "object": "text_completion.cancelled", "cancelled": True})
