"""A property-based fuzzer over the whole HTTP interface, against a live deployment.

Schemathesis reads the gateway's own /openapi.json and sends generated requests, valid and
invalid, to every operation of a real gateway with real replicas and Valkey. Bounded and
seeded: the same cases each run, in seconds.
"""

from __future__ import annotations

from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import Case, CheckContext, GenerationMode, Response
from schemathesis.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.schemas import OpenApiSchema

from api.schemas import CompletionRequest
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY, Deployment

SEED = 20261129
MAX_EXAMPLES = 60  # per operation (those without inputs stop after a few distinct cases)
KEYS = [None, PAID_KEY, FREE_KEY, "not-a-key"]


@pytest.fixture(scope="module")
def api(kb: Deployment) -> OpenApiSchema:
    return schemathesis.openapi.from_url(f"{kb.url}/openapi.json")


def test_the_served_document_is_valid_openapi(kb: Deployment) -> None:
    doc = requests.get(f"{kb.url}/openapi.json", timeout=5).json()
    loaded = schemathesis.openapi.from_dict(doc)
    loaded.validate()  # against the OpenAPI 3.1 meta-schema
    assert doc["openapi"].startswith("3.1")
    operations = {(op.method.upper(), op.path) for op in (r.ok() for r in loaded.get_all_operations())}
    assert operations == {
        ("POST", "/v1/completions"),
        ("DELETE", "/v1/completions/{id}"),
        ("GET", "/v1/models"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
    }
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == set(CompletionRequest.model_fields)  # generated from the model


def no_undocumented_server_error(ctx: CheckContext, response: Response, case: Case) -> None:
    """A 5xx only where the operation documents it (503 and 504, with a reason)."""
    if response.status_code >= 500 and str(response.status_code) not in case.operation.definition.raw["responses"]:
        raise AssertionError(f"{case.operation.label} answered {response.status_code}: {response.text[:300]}")


CHECKS = [
    no_undocumented_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


OPERATIONS = ["createCompletion", "cancelCompletion", "listModels", "healthz", "readyz", "metrics", "openapi"]


@pytest.mark.parametrize("operation_id", OPERATIONS)
def test_fuzz(api: OpenApiSchema, operation_id: str, capsys: pytest.CaptureFixture[str]) -> None:
    operation = api.find_operation_by_id(operation_id)
    cases = st.one_of(operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE))
    seen: Counter[int] = Counter()  # answers by status

    @seed(SEED)
    @settings(max_examples=MAX_EXAMPLES, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases, key=st.sampled_from(KEYS), real_model=st.integers(0, 3).map(bool))  # 3 in 4
    def fuzz(case: Case, key: str | None, real_model: bool) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if real_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # else nearly every generated body names an unknown model
        response = case.call_and_validate(headers=headers, checks=CHECKS, timeout=30)
        seen[response.status_code] += 1
        if operation_id == "cancelCompletion":  # nothing is in flight: no random id can be found
            assert response.status_code in (400, 401, 404), response.text

    fuzz()
    if operation_id == "createCompletion":  # the draws vary from run to run; one body known valid too
        body = {"model": MODEL, "prompt": "def f(", "max_tokens": 4}
        plain = operation.Case(body=body, media_type="application/json")
        seen[plain.call_and_validate(checks=CHECKS, timeout=30).status_code] += 1
    with capsys.disabled():
        print(f"\nfuzz {operation_id}: {seen.total()} cases, by status {dict(sorted(seen.items()))}")
    assert seen.total() > 0
    if operation_id == "createCompletion":  # the generated bodies reach a replica, and are refused too
        assert seen[200] > 0 and seen[400] > 0 and seen[404] > 0, seen
