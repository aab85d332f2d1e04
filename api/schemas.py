"""The HTTP request body, checked at the edge."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _document_leniency(schema: dict[str, Any]) -> None:
    """What the validators below accept, written into the JSON schema (the OpenAPI document
    is generated from it): null for any option, a prompt as a one-string array, n only 1, and
    up to 4 non-empty stop strings."""
    props = schema["properties"]
    props["n"]["const"] = 1
    props["stop"]["anyOf"][1].update(items={"type": "string", "minLength": 1}, maxItems=4)
    props["prompt"] = {
        "title": props["prompt"].get("title", "Prompt"),
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}],
    }
    for name, prop in props.items():
        if name in schema["required"] or any(alt.get("type") == "null" for alt in prop.get("anyOf", [])):
            continue
        kept = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        props[name] = {**kept, "anyOf": [prop, {"type": "null"}]}


class CompletionRequest(BaseModel):
    """OpenAI's completions body; fields OpenAI has and keybatch ignores are accepted."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_document_leniency)

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

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and (len(stop) > 4 or any(not s for s in stop)):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
