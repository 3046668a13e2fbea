"""POST /v1/embeddings: OpenAI's shape (the `openai` SDK's default base64 too), states that match
transformers' hidden states, ladle's layer and pooling parameters, and refusals naming the field."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from server_utils import MODEL, Server

TEXT = "The invoice for March was charged twice; please refund the duplicate payment."


def embed(server: Server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)


def test_openai_sdk_gets_unit_vectors(server: Server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    result = client.embeddings.create(model=MODEL, input=[TEXT, "hello"])  # the SDK asks for base64
    floats = embed(server, input=[TEXT, "hello"]).json()
    assert [d.index for d in result.data] == [0, 1]
    for got, want in zip(result.data, floats["data"]):
        assert np.linalg.norm(got.embedding) == pytest.approx(1.0, abs=1e-5)
        assert got.embedding == pytest.approx(want["embedding"], abs=1e-6)  # float32 on the wire
    assert result.usage.prompt_tokens == floats["usage"]["prompt_tokens"] > 0


def test_states_match_transformers_for_each_pooling_and_layer(server: Server, hf_smollm2) -> None:
    model, _ = hf_smollm2
    ids = server.engine.tokenizer.encode(TEXT)
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer, pooling, start in [(-1, "last", 0), (12, "last", 0), (12, "mean", 0), (0, "mean", 0), (20, "mean", 5)]:
        extra = {"pooling_start": start} if start else {}
        got = np.array(embed(server, input=[ids], layer=layer, pooling=pooling, normalize=False, **extra).json()
                       ["data"][0]["embedding"])
        state = ref[layer][0]
        want = (state[-1] if pooling == "last" else state[start:].mean(0)).numpy()
        assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max(), (layer, pooling)


def test_layers_count_from_the_end_when_negative(server: Server) -> None:
    layers = server.engine.num_hidden_layers
    a = embed(server, input=TEXT, layer=-1).json()["data"][0]["embedding"]
    b = embed(server, input=TEXT, layer=layers).json()["data"][0]["embedding"]
    assert a == b


@pytest.mark.parametrize("body, param", [
    ({"input": TEXT, "layer": 999}, "layer"),
    ({"input": TEXT, "pooling": "max"}, "pooling"),
    ({"input": TEXT, "dimensions": 64}, "dimensions"),
    ({"input": TEXT, "pooling_start": 3}, "pooling_start"),
    ({"input": TEXT, "pooling": "mean", "pooling_start": 500}, "pooling_start"),
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": TEXT, "colour": "blue"}, "colour"),
    ({"input": TEXT, "model": "someone-else"}, "model"),
])
def test_bad_requests_name_the_field(server: Server, body: dict, param: str) -> None:
    r = embed(server, **body)
    assert r.status_code == (404 if param == "model" else 400)  # an unknown model is not found, as in vLLM
    assert r.json()["error"]["param"] == param
