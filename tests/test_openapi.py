"""The OpenAPI document describes the API: every route's request and answer schemas, and a live
server fuzzed from its own /openapi.json by schemathesis answers no example with a 5xx, an
undocumented status or content type, or a body its schema does not allow."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_schema_conformance, status_code_conformance,
)

from ladle.config import EngineConfig
from ladle.server.app import ROUTERS
from server_utils import MODEL, own_server

EXAMPLES_PER_ROUTE = 12
# An answer's shape does not depend on its length: generated lengths and counts are cut down to these
# (values that are not positive integers are left as generated, for the refusals).
FUZZ_LIMITS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2}
CHECKS = [schemathesis.checks.not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server():
    # a short context keeps every generated request quick (a reply runs out of room within 128 tokens)
    with own_server(EngineConfig(max_model_len=128, num_kv_blocks=256, enable_lora=True)) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


OPERATIONS = sorted((method, route.path_format) for router in ROUTERS for route in router.routes
                    for method in route.methods if route.include_in_schema)


def test_every_route_declares_its_shapes(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    operations = {(m.upper(), p): op for p, ops in doc["paths"].items() for m, op in ops.items()}
    assert len(operations) >= 17
    for (method, path), op in operations.items():
        responses = op["responses"]
        assert "422" not in responses, path  # ladle answers bad input with a 400 naming the field
        assert {"200", "400", "404"} <= set(responses), path
        error = responses["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        if method == "POST" and path not in ("/v1/requests/{request_id}/cancel", "/reset_prefix_cache"):  # no body
            body = op["requestBody"]["content"]["application/json"]["schema"]
            assert "$ref" in body or "anyOf" in body, path
            plain = path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # vLLM answers them in text
            assert ("text/plain" if plain else "application/json") in responses["200"]["content"], path
    chat = operations[("POST", "/v1/chat/completions")]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    request = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in request["required"] and request["properties"]["n"]["maximum"] == 128
    decisions = operations[("POST", "/v1/decisions")]["requestBody"]["content"]["application/json"]["schema"]
    assert {s["$ref"].rsplit("/", 1)[1] for s in decisions["anyOf"]} == {"DecisionsRequest",
                                                                         "OpenAIDecisionRequest"}
    assert "text/plain" in operations[("GET", "/metrics")]["responses"]["200"]["content"]
    assert "409" in operations[("POST", "/reset_prefix_cache")]["responses"]  # running requests hold blocks
    assert httpx.get(f"{server.url}/docs").status_code == 200


def test_documented_answers_match_real_ones(server):
    """A few hand-picked answers checked against the document, independently of schemathesis."""
    import jsonschema

    doc = httpx.get(f"{server.url}/openapi.json").json()
    registry_doc = {"components": doc["components"]}

    def check(body: dict, name: str) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", **registry_doc}
        jsonschema.validate(body, schema)

    reply = httpx.post(f"{server.base_url}/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}).json()
    check(reply, "ChatCompletionResponse")
    error = httpx.post(f"{server.base_url}/chat/completions", json={"messages": []})
    assert error.status_code == 400
    check(error.json(), "ErrorResponse")
    check(httpx.get(f"{server.url}/version").json(), "VersionInfo")
    check(httpx.get(f"{server.base_url}/engine/stats").json(), "EngineSnapshot")
    with pytest.raises(jsonschema.ValidationError):
        check({"object": "list"}, "ModelList")


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzzed_requests_get_documented_answers(api_schema, method, path):
    operation = api_schema[path][method]
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if _takes_input(operation) else [])
    cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))

    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def answers_as_documented(case):
        if isinstance(case.body, dict):
            clamp(case.body)
        case.call_and_validate(checks=CHECKS, timeout=60)

    answers_as_documented()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                                  "/v1/decisions", "/v1/score", "/v1/systemone", "/tokenize", "/detokenize"])
def test_documented_examples_are_answered(api_schema, path):
    """Each request example in the document is served (200), streamed ones too, as documented."""
    operation = api_schema[path]["POST"]
    strategies = operation.get_strategies_from_examples()
    assert strategies, f"{path} documents no example"
    for strategy in strategies:
        @settings(max_examples=1, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def answered(case):
            response = case.call_and_validate(checks=CHECKS, timeout=60)
            assert response.status_code == 200, response.text
            if isinstance(case.body, dict) and case.body.get("stream"):
                assert response.headers["content-type"][0].startswith("text/event-stream")
                assert response.text.count("data: ") >= 2

        answered()


def clamp(body: dict) -> None:
    """The model a generated body names is the one served (else nearly every example stops at "model not
    found"), and its lengths and counts are at most FUZZ_LIMITS."""
    if "model" in body:
        body["model"] = MODEL
    for name, limit in FUZZ_LIMITS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            body[name] = limit


def _takes_input(operation) -> bool:
    return operation.body or any(True for _ in operation.iter_parameters())
