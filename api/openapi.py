"""GET /openapi.json: the HTTP interface as an OpenAPI 3.1 document.

The request body's schema comes from the pydantic model the gateway validates with, so the
two cannot drift; the answers are written out here. Limits that depend on settings (most
tokens, longest deadline, the configured models) are filled in from the settings served.
Offline: `python -m api.openapi > openapi.json` (default settings).
"""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, Response, current_app, jsonify

from api.schemas import CompletionRequest
from control.core.settings import Settings
from control.core.vocab import TIERS

bp = Blueprint("openapi", __name__)

ID_PATTERN = "^[A-Za-z0-9._:-]{1,128}$"  # the gateway's check on request and session ids
JSON = "application/json"
Schema = dict[str, Any]


@bp.get("/openapi.json")
def openapi_json() -> Response:
    """This document, for the settings this gateway runs with. Open, as the interface is
    public; the configured models only to a caller who may see them (docs/decisions/0018)."""
    from api.health import shows_deployment

    settings = current_app.extensions["keybatch"].settings
    return jsonify(document(settings, models=shows_deployment(settings)))


def document(settings: Settings, models: bool = True) -> Schema:
    """The OpenAPI 3.1 document of the gateway's HTTP interface (`models`: name the
    configured models as examples)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "keybatch",
            "version": "0.1.0",
            "description": "Batched serving for inline code completion; OpenAI-compatible completions.",
        },
        "servers": [{"url": "/"}],
        "paths": {
            "/v1/completions": {"post": _create_completion(settings, models)},
            "/v1/completions/{id}": {"delete": _cancel_completion(settings)},
            "/v1/models": {"get": _list_models(settings)},
            "/healthz": {"get": _healthz()},
            "/readyz": {"get": _readyz()},
            "/metrics": {"get": _metrics()},
            "/openapi.json": {"get": _openapi()},
        },
        "components": {"schemas": _schemas(), "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


# -- operations ------------------------------------------------------------------


def _create_completion(settings: Settings, models: bool) -> Schema:
    body = _request_body(settings, models)
    return {
        "operationId": "createCompletion",
        "summary": "Complete one prompt (JSON, or server-sent events with stream: true)",
        "description": (
            "Waits for the prompt's batch and answers once. With `stream: true` the answer is "
            "server-sent events in OpenAI's chunk format ending `data: [DONE]`; an error found "
            'after the stream started is sent as a `data: {"error": ...}` event.'
        ),
        "security": _security(settings),
        "parameters": [
            _header("X-Request-Id", "The client's idempotent id, scoped to its key; echoed as the answer's id.", _id()),
            _header("X-Session-Id", "A newer request in the same session (same key) supersedes an older one.", _id()),
            _header(
                "X-Deadline-Ms",
                f"The client's remaining budget in ms (default {settings.deadline_ms:.0f}).",
                {"type": "number", "exclusiveMinimum": 0, "maximum": settings.max_deadline_ms},
            ),
        ],
        "requestBody": {"required": True, "content": {JSON: {"schema": body}}},
        "responses": {
            "200": {
                "description": "The completion.",
                "headers": {
                    "X-Request-Id": {"description": "The request's id.", "schema": {"type": "string"}},
                    "X-Cancel-Id": {
                        "description": "Anonymous callers: the id to cancel this request by.",
                        "schema": {"type": "string"},
                    },
                },
                "content": {
                    JSON: {"schema": _ref("Completion")},
                    "text/event-stream": {"schema": _ref("Event")},
                },
            },
            "400": _error("Invalid body, option or header."),
            "401": _error("Missing or invalid API key."),
            "404": _error("Unknown model."),
            "409": _error(
                "Cancelled, superseded by a newer request of the session, or its X-Request-Id belongs to a "
                "request with a different body (request_id_reused)."
            ),
            "413": _error("Prompt and suffix longer than the limit, or a body too large."),
            "422": _error("The engine could not run this prompt (the rest of its batch was answered)."),
            "429": _error("Overloaded: the queue is too deep to meet the deadline.", retry_after=True),
            "503": _error("No replica serves the model, the broker is down, or the gateway is stopping.", True),
            "504": _error("The deadline passed, or is shorter than one batch."),
        },
    }


def _cancel_completion(settings: Settings) -> Schema:
    return {
        "operationId": "cancelCompletion",
        "summary": "Cancel a request in flight; its waiting call answers 409 cancelled",
        "security": _security(settings),
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {
            "200": {"description": "Cancelled.", "content": {JSON: {"schema": _ref("Cancelled")}}},
            "400": _error("The id is not 1-128 characters of A-Z a-z 0-9 . _ : -"),
            "401": _error("Missing or invalid API key."),
            "404": _error("No request of this key with this id is in flight."),
            "503": _error("The broker is unreachable.", retry_after=True),
        },
    }


def _list_models(settings: Settings) -> Schema:
    return {
        "operationId": "listModels",
        "summary": "The configured models and how many ready replicas serve each",
        "security": _security(settings),
        "responses": {
            "200": {"description": "The models.", "content": {JSON: {"schema": _ref("ModelList")}}},
            "401": _error("Missing or invalid API key."),
        },
    }


def _healthz() -> Schema:
    return {
        "operationId": "healthz",
        "summary": "The process is up",
        "responses": {"200": {"description": "Up.", "content": {JSON: {"schema": _ref("Health")}}}},
    }


def _readyz() -> Schema:
    return {
        "operationId": "readyz",
        "summary": "The broker answers and every configured model has a ready replica",
        "responses": {
            "200": {"description": "Ready.", "content": {JSON: {"schema": _ref("Ready")}}},
            "503": _error("Not ready: the broker is unreachable, a model has no replica, or stopping.", True),
        },
    }


def _metrics() -> Schema:
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "operationId": "metrics",
        "summary": "Prometheus metrics (text exposition format)",
        "description": "Needs the scrape token (bearer) when one is set, or when anonymous access is off.",
        "responses": {
            "200": {"description": "The metrics.", "content": text},
            "401": _error("Missing or invalid scrape token."),
        },
    }


def _openapi() -> Schema:
    return {
        "operationId": "openapi",
        "summary": "This document",
        "responses": {"200": {"description": "OpenAPI 3.1.", "content": {JSON: {"schema": {"type": "object"}}}}},
    }


# -- pieces ----------------------------------------------------------------------


def _request_body(settings: Settings, models: bool) -> Schema:
    """CompletionRequest's own schema, with the limits and names the settings decide."""
    body = CompletionRequest.model_json_schema()
    props = body["properties"]
    if models:
        props["model"]["examples"] = sorted(settings.models)
    max_tokens = next(alt for alt in props["max_tokens"]["anyOf"] if alt.get("type") == "integer")
    max_tokens["maximum"] = settings.max_tokens_limit
    for name in ("prompt", "suffix"):
        props[name]["description"] = f"prompt and suffix together: at most {settings.max_prompt_chars} characters"
    return body


def _security(settings: Settings) -> list[Schema]:
    """The key decides the tier; without one a request is free when anonymous access is on."""
    return [{}, {"bearer": []}] if settings.allow_anonymous else [{"bearer": []}]


def _header(name: str, description: str, schema: Schema) -> Schema:
    return {"name": name, "in": "header", "required": False, "description": description, "schema": schema}


def _id() -> Schema:
    return {"type": "string", "pattern": ID_PATTERN}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _error(description: str, retry_after: bool = False) -> Schema:
    response: Schema = {"description": description, "content": {JSON: {"schema": _ref("Error")}}}
    if retry_after:
        seconds = {"type": "string", "pattern": "^[0-9]+$"}
        response["headers"] = {"Retry-After": {"description": "Seconds.", "required": True, "schema": seconds}}
    return response


def _object(properties: dict[str, Schema], **extra: Any) -> Schema:
    return {"type": "object", "properties": properties, "required": list(properties), **extra}


def _schemas() -> dict[str, Schema]:
    string, integer, number = {"type": "string"}, {"type": "integer"}, {"type": "number"}
    return {
        "Error": _object(
            {"error": _object({"message": string, "type": string, "code": string})},
            description="OpenAI's error shape.",
        ),
        "Completion": _object(
            {
                "id": string,
                "object": {"const": "text_completion"},
                "created": integer,
                "model": string,
                "choices": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": _object(
                        {"text": string, "index": integer, "logprobs": {"type": "null"}, "finish_reason": string}
                    ),
                },
                "usage": _object({"prompt_tokens": integer, "completion_tokens": integer, "total_tokens": integer}),
                "keybatch": _object(
                    {
                        "queue_ms": number,
                        "batch_ms": number,
                        "total_ms": number,
                        "batch_size": integer,
                        "replica": string,
                        "backend": string,
                        "tier": {"enum": list(TIERS)},
                        "cell": integer,
                        "hedged": {"type": "boolean"},
                        "reused": {"type": "boolean"},
                    },
                    description=(
                        "keybatch's own timings (ms), batch size and replica, the cell that carried the "
                        "request, whether a second copy run in another batch's empty slot answered it "
                        "(hedged), and whether it is the rest of the session's last completion, typed "
                        "through without the model (reused)."
                    ),
                ),
            }
        ),
        "Event": _object(
            {"data": string},
            description=(
                "One server-sent event: `data` is a completion chunk as JSON (a Completion whose last "
                "chunk carries finish_reason), an `error` object, or `[DONE]`."
            ),
        ),
        "Cancelled": _object(
            {"id": string, "object": {"const": "text_completion.cancelled"}, "cancelled": {"const": True}}
        ),
        "ModelList": _object(
            {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": _object(
                        {
                            "id": string,
                            "object": {"const": "model"},
                            "created": integer,
                            "owned_by": string,
                            "replicas": integer,
                        }
                    ),
                },
            }
        ),
        "Health": _object({"status": {"const": "ok"}}),
        "Ready": {
            "type": "object",
            "properties": {
                "status": {"const": "ready"},
                "replicas": {"type": "object", "additionalProperties": integer},
            },
            "required": ["status"],
            "description": "`replicas` (ready replicas per model) only to a caller who may see the models.",
        },
    }


if __name__ == "__main__":
    print(json.dumps(document(Settings()), indent=2))
