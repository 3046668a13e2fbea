"""Structured outputs through the server, checked by independent validators (jsonschema, re)."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_utils import MODEL, Server

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 20}},
        "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 8},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"],
            "additionalProperties": False}},
        "express": {"type": "boolean"}}, "required": ["items", "express"], "additionalProperties": False},
    "reading": {"type": "object", "properties": {
        "unit": {"enum": ["C", "F", "K"]},
        "value": {"type": "number", "minimum": -50, "maximum": 50},
        "where": {"type": "object", "properties": {"room": {"type": "string", "maxLength": 10}},
                  "required": ["room"], "additionalProperties": False}},
        "required": ["unit", "value", "where"], "additionalProperties": False},
}
ASK = "Reply with the JSON object only."


def _gather(server: Server, route: str, bodies: list[dict]) -> list[dict]:
    """POST all bodies at once (so they share engine steps); the JSON responses, in order."""
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as c:
            rs = await asyncio.gather(*(c.post(route, json={"model": MODEL, **b}) for b in bodies))
        for r in rs:
            assert r.status_code == 200, r.text
        return [r.json() for r in rs]
    return asyncio.run(run())


def test_sdk_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        founded: int = pydantic.Field(ge=0, le=2100)  # bounded: a 135M model loops on unbounded digits

    done = client.chat.completions.parse(model=MODEL, response_format=City, temperature=0, max_tokens=120,
                                         messages=[{"role": "user", "content": f"Describe Paris. {ASK}"}])
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_outputs_validate_for_50_seeded_requests(server: Server) -> None:
    bodies = []
    for i in range(50):
        name, schema = list(SCHEMAS.items())[i % len(SCHEMAS)]
        bodies.append({"messages": [{"role": "user", "content": f"Invent a {name}. {ASK}"}], "temperature": 1.0,
                       "seed": i, "max_tokens": 200, "response_format": {
                           "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}})
    for body, out in zip(bodies, _gather(server, "/chat/completions", bodies)):
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]),
                            body["response_format"]["json_schema"]["schema"])


def test_choice_regex_and_grammar_always_match(server: Server) -> None:
    pets = ["cat", "dog", "hamster", "a \"quoted\" fish"]
    plate = r"[A-Z]{2}-[0-9]{3}"
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    bodies = []
    for i in range(12):
        bodies += [
            {"prompt": "My favourite pet is", "guided_choice": pets, "seed": i, "temperature": 1.0, "max_tokens": 20},
            {"prompt": "The licence plate was", "structured_outputs": {"regex": plate}, "seed": i,
             "temperature": 1.0, "max_tokens": 20},
            {"prompt": "A sum:", "structured_outputs": {"grammar": grammar}, "seed": i, "temperature": 1.0,
             "max_tokens": 40, "stop": ["\n\n"]},
        ]
    outs = _gather(server, "/completions", bodies)
    texts = [o["choices"][0]["text"] for o in outs]
    assert all(t in pets for t in texts[0::3]), texts[0::3]
    assert all(re.fullmatch(plate, t) for t in texts[1::3]), texts[1::3]
    assert all(re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", t) for t in texts[2::3]), texts[2::3]
    assert len(set(texts[0::3])) > 1  # sampled, not stuck on one answer


def test_n_streaming_logprobs_and_stop(server: Server, client: openai.OpenAI) -> None:
    schema = SCHEMAS["person"]
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Invent a person. {ASK}"}], n=3, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        temperature=1.0, max_tokens=150, stream=True, logprobs=True, top_logprobs=2)
    texts, logprobs, finish = ["", "", ""], [[], [], []], {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            logprobs[c.index] += c.logprobs.content if c.logprobs and c.logprobs.content else []
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for i in range(3):
        assert finish[i] == "stop"
        jsonschema.validate(json.loads(texts[i]), schema)
        # by bytes: a token holding part of a UTF-8 character (an emoji) reads as U+FFFD on its own
        assert bytes(b for lp in logprobs[i] for b in lp.bytes).decode().startswith(texts[i])
        # a constrained row's logprobs are over what the grammar allows: the first token opens the
        # object, and so do its alternatives (the mask renormalises: their probabilities sum to 1)
        first = logprobs[i][0]
        assert first.token.startswith("{") and all(t.token.startswith("{") for t in first.top_logprobs)
        assert sum(math.exp(t.logprob) for t in first.top_logprobs) == pytest.approx(1.0, abs=1e-5)
    # a stop string cuts constrained text like any other
    cut = client.completions.create(model=MODEL, prompt="Plate:", extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"},
                                    stop=["-"], temperature=0, max_tokens=10)
    assert re.fullmatch("[A-Z]{3}", cut.choices[0].text) and cut.choices[0].finish_reason == "stop"


def test_constrained_rows_leave_their_batch_neighbours_unchanged(server: Server) -> None:
    plain = [{"messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 24}
             for p in ("Name three rivers.", "What is a prime number?", "Write a haiku about rain.")]
    constrained = [{**plain[i % 3], "response_format": {"type": "json_object"}, "max_tokens": 40} for i in range(6)]
    solo = [_gather(server, "/chat/completions", [b])[0]["choices"][0]["message"]["content"] for b in plain]
    mixed = _gather(server, "/chat/completions", constrained[:3] + plain + constrained[3:])
    assert [m["choices"][0]["message"]["content"] for m in mixed[3:6]] == solo
    server.wait_idle()


def test_one_token_regex_gives_the_score_paths_probabilities(server: Server) -> None:
    """SGLang's equivalence: a regex of one-character labels at temperature 0 with logprobs reads the
    same label distribution as the score path (over the labels: the grammar masks the rest)."""
    prompt = "Question: Which letter comes first in the alphabet?\nA) C\nB) A\nC) B\nAnswer:"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    labels = [httpx.post(f"{server.url}/tokenize", json={"prompt": x, "add_special_tokens": False}).json()["tokens"]
              for x in "ABC"]
    assert all(len(x) == 1 for x in labels)
    scored = httpx.post(f"{server.base_url}/score", json={"query": ids, "label_token_ids": [x[0] for x in labels],
                                                           "apply_softmax": True}).json()["scores"][0]
    out = _gather(server, "/completions", [{"prompt": ids, "structured_outputs": {"regex": "(A|B|C)"},
                                            "temperature": 0, "max_tokens": 1, "logprobs": 5}])[0]
    top = out["choices"][0]["logprobs"]["top_logprobs"][0]
    assert {t for t, lp in top.items() if lp > -9999.0} == {"A", "B", "C"}  # -9999: JSON's -inf (masked)
    regex_probs = [math.exp(top[x]) for x in "ABC"]
    assert regex_probs == pytest.approx(scored, abs=2e-5)
    assert out["choices"][0]["text"] == "ABC"[max(range(3), key=lambda i: scored[i])]


def test_bad_constraints_are_400s_naming_the_field(server: Server) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format.json_schema"),
        ({**chat, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({**chat, "response_format": {"type": "yaml"}}, "response_format.type"),
        ({**chat, "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({**chat, "structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
        ({**chat, "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({**chat, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({**chat, "structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
        ({**chat, "response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({**chat, "guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ]
    for body, param in cases:
        for route, b in (("/chat/completions", body), ("/completions", {**body, "prompt": "hi"})):
            if route == "/completions":
                b = {k: v for k, v in b.items() if k != "messages"}
            r = httpx.post(f"{server.base_url}{route}", json={"model": MODEL, **b})
            assert r.status_code == 400, (route, body, r.text)
            assert r.json()["error"]["param"] == param, (route, r.json())
    server.wait_idle()
