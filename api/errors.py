"""OpenAI-shaped errors: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

from flask import Flask, Response, jsonify
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"), "code": self.code}}
        resp = jsonify(body)
        resp.status_code = self.status
        if self.retry_after_s is not None:
            resp.headers["Retry-After"] = str(self.retry_after_s)
        return resp


def describe(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


def init_app(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(err: ApiError) -> Response:
        return err.response()

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException) -> Response:
        status = err.code or 400
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return ApiError(status, err.description or err.name, codes.get(status, "invalid_request")).response()
