"""The HTTP request body, checked at the edge."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OpenAI's options keybatch does not implement, and the values of each that ask for nothing
# (OpenAI's defaults, as clients send them): those are accepted, any other is refused by name,
# since ignoring it would answer something other than what was asked.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "seed": (),
    "stream_options": ({}, {"include_usage": False}),
}
_UNSUPPORTED_SCHEMA: dict[str, dict[str, Any]] = {
    "best_of": {"const": 1},
    "echo": {"const": False},
    "logprobs": {"type": "null"},
    "frequency_penalty": {"const": 0},
    "presence_penalty": {"const": 0},
    "logit_bias": {"type": "object", "maxProperties": 0},
    "seed": {"type": "null"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"const": False}},
        "additionalProperties": False,
    },
}


def _document_leniency(schema: dict[str, Any]) -> None:
    """What the validators below accept, written into the JSON schema (the OpenAPI document
    is generated from it): null for any option, a prompt as a one-string array, n only 1,
    up to 4 non-empty stop strings, and OpenAI's unsupported options only at their defaults."""
    props = schema["properties"]
    props["n"]["const"] = 1
    props["stop"]["anyOf"][0]["minLength"] = 1
    props["stop"]["anyOf"][1].update(items={"type": "string", "minLength": 1}, maxItems=4)
    props["prompt"] = {
        "title": props["prompt"].get("title", "Prompt"),
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}],
    }
    for name, accepted in _UNSUPPORTED_SCHEMA.items():
        title = props[name].get("title", name)
        props[name] = {"title": title, "description": "not supported: only OpenAI's default", **accepted}
    for name, prop in props.items():
        if name in schema["required"] or any(alt.get("type") == "null" for alt in prop.get("anyOf", [])):
            continue
        if prop.get("type") == "null":
            continue
        kept = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        props[name] = {**kept, "anyOf": [prop, {"type": "null"}]}


class CompletionRequest(BaseModel):
    """OpenAI's completions body, taken strictly: every value of its own JSON type (no
    coercion: `true` is not a number, `"yes"` not a boolean) and no unknown field."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_document_leniency)

    model: str = Field(min_length=1, max_length=128)
    prompt: str
    suffix: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    user: str | None = None
    n: int = 1
    best_of: int = 1
    echo: bool = False
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stream_options: dict[str, bool] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """OpenAI clients send null for options they leave unset."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None or k in ("model", "prompt")}
            prompt = data.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                data["prompt"] = prompt[0]  # one prompt, as OpenAI's array form
        return data

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _only_defaults(cls, value: object, info: ValidationInfo) -> object:
        name = info.field_name or ""
        if not any(type(value) is type(ok) and value == ok for ok in UNSUPPORTED[name]):
            raise PydanticCustomError("unsupported", f"{name} is not supported (send it only at OpenAI's default)")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
