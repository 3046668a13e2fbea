"""LoRA adapters through the server: the `openai` SDK naming an adapter in `model`, /v1/models, load and
unload at run time while other requests stream, a burst over more adapters than --max-loras, 404s
and 400s, vllm:lora_requests_info, and decisions answered on an adapter (checked against peft) and
replayed through /v1/score on the same adapter."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from lora_adapters import peft_model
from server_utils import MODEL, Server, own_server

from ladle.config import EngineConfig

PROMPT = "The capital of France is"
TICKET = "Order 7731 arrived damaged and the customer wants a refund before the weekend."
QUESTIONS = [{"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
              "options": [{"name": "billing"}, {"name": "technical"}, {"name": "sales"}]},
             {"id": "refund", "type": "yes_no", "question": "The customer asks for money back."}]
PROB_TOL = 2e-3  # absolute, on probabilities: ladle serves the base from its int8 blocks, peft from float32


@pytest.fixture(scope="module")
def lora_server(lora_adapters):
    modules = {name: str(lora_adapters[name]) for name in ("attn", "mlp", "mixed")}
    config = EngineConfig(num_kv_blocks=512, enable_lora=True, max_loras=2, lora_modules=modules)
    with own_server(config) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(lora_server: Server):
    c = openai.OpenAI(base_url=lora_server.base_url, api_key="unused", max_retries=0, timeout=300)
    yield c
    c.close()


def _peft_greedy(hf_smollm2, folder, prompt: str, n: int) -> str:
    base, tok = hf_smollm2
    model = base if folder is None else peft_model(base, folder)
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1]:])


def _complete(sdk: openai.OpenAI, model: str, prompt: str = PROMPT, n: int = 10):
    return sdk.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})


def test_models_lists_each_adapter_with_its_parent(lora_server: Server, sdk: openai.OpenAI, lora_adapters) -> None:
    cards = {m.id: m for m in sdk.models.list().data}
    assert set(cards) == {MODEL, "attn", "mlp", "mixed"}
    assert cards["attn"].parent == MODEL and cards["attn"].root == str(lora_adapters["attn"])
    assert cards[MODEL].parent is None
    assert sdk.models.retrieve("mlp").parent == MODEL


def test_the_sdk_runs_completions_and_chats_on_an_adapter(sdk: openai.OpenAI, hf_smollm2, lora_adapters) -> None:
    reply = _complete(sdk, "mixed")
    assert reply.model == "mixed"
    assert reply.choices[0].text == _peft_greedy(hf_smollm2, lora_adapters["mixed"], PROMPT, 10)
    assert reply.choices[0].text != _complete(sdk, MODEL).choices[0].text
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = sdk.chat.completions.create(model="attn", messages=messages, max_tokens=12, temperature=0)
    chunks = list(sdk.chat.completions.create(model="attn", messages=messages, max_tokens=12, temperature=0,
                                              stream=True))
    assert {c.model for c in chunks} == {"attn"} and whole.model == "attn"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    base = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert base.choices[0].message.content != whole.choices[0].message.content


def test_an_unknown_adapter_is_not_found_naming_the_model(lora_server: Server, sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        _complete(sdk, "no-such-adapter")
    assert err.value.body["param"] == "model" and "no-such-adapter" in err.value.message
    assert "attn" in err.value.message  # it says what is served
    r = httpx.post(f"{lora_server.base_url}/decisions", json={"input": TICKET, "questions": QUESTIONS,
                                                                "model": "no-such-adapter"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"  # the decisions contract: a 400


def test_load_and_unload_while_another_request_streams(lora_server: Server, sdk: openai.OpenAI, hf_smollm2,
                                                       lora_adapters, tmp_path) -> None:
    url = lora_server.base_url
    streaming = threading.Event()
    pieces: list[str] = []

    def stream() -> None:
        for chunk in sdk.completions.create(model="attn", prompt="Once upon a time", max_tokens=48, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}):
            pieces.append(chunk.choices[0].text if chunk.choices else "")
            streaming.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(stream)
        assert streaming.wait(60)
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "all", "lora_path": str(lora_adapters["all"])})
        assert r.status_code == 200 and "all" in r.text
        assert _complete(sdk, "all").choices[0].text == _peft_greedy(hf_smollm2, lora_adapters["all"], PROMPT, 10)
        r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "all"})
        assert r.status_code == 200
        done.result(timeout=120)
    assert len([p for p in pieces if p]) >= 40  # the stream went on, undisturbed
    with pytest.raises(openai.NotFoundError):
        _complete(sdk, "all")
    refusals = [
        ("load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, 400, "lora_path"),
        ("load_lora_adapter", {"lora_name": "attn", "lora_path": str(lora_adapters["mlp"])}, 400, "lora_name"),
        ("load_lora_adapter", {"lora_name": MODEL, "lora_path": str(lora_adapters["mlp"])}, 400, "lora_name"),
        ("load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
        ("unload_lora_adapter", {"lora_name": "all"}, 404, "lora_name"),
    ]
    for route, body, status, param in refusals:
        r = httpx.post(f"{url}/{route}", json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
    lora_server.wait_idle()


def test_a_burst_over_more_adapters_than_slots(lora_server: Server, sdk: openai.OpenAI) -> None:
    seen: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    listener = lambda report: seen.append((report.snapshot.running_loras, report.snapshot.waiting_loras))  # noqa: E731
    lora_server.engine.add_step_listener(listener)
    models = ["attn", "mlp", "mixed", MODEL] * 3
    try:
        with ThreadPoolExecutor(len(models)) as pool:
            replies = list(pool.map(lambda m: _complete(sdk, m, n=16), models))
    finally:
        lora_server.engine.remove_step_listener(listener)
    assert all(r.usage.completion_tokens == 16 for r in replies)
    assert seen and all(len(running) <= 2 for running, _ in seen)  # --max-loras 2, never more in a step
    assert any(waiting for _, waiting in seen)  # some waited for a slot rather than being refused
    [info] = [line for line in lora_server.metrics().splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert 'max_lora="2"' in info and f'model_name="{MODEL}"' in info


def test_decisions_on_an_adapter_match_peft_and_replay_through_score(lora_server: Server, hf_smollm2,
                                                                     lora_adapters) -> None:
    url = lora_server.base_url
    body = {"input": TICKET, "questions": QUESTIONS, "return_prompt_token_ids": True}
    on_adapter = httpx.post(f"{url}/decisions", json={**body, "model": "mixed"}, timeout=120).json()
    on_base = httpx.post(f"{url}/decisions", json=body, timeout=120).json()
    assert on_adapter["model"] == "mixed"
    model = peft_model(hf_smollm2[0], lora_adapters["mixed"])
    for key, answer in on_adapter["answers"].items():
        with torch.no_grad():
            logits = model(torch.tensor([answer["prompt_token_ids"]])).logits[0, -1].float()
        expected = torch.softmax(logits[answer["label_token_ids"]], dim=-1).tolist()
        got = list(answer["probabilities"].values())
        assert max(abs(a - b) for a, b in zip(got, expected)) < PROB_TOL, key
        assert max(abs(a - b) for a, b in zip(got, on_base["answers"][key]["probabilities"].values())) > 0.01
        replay = {"query": answer["prompt_token_ids"], "label_token_ids": answer["label_token_ids"],
                  "apply_softmax": True}
        r = httpx.post(f"{url}/score", json={**replay, "model": "mixed"}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "mixed"
        assert r.json()["scores"][0] == got  # bit for bit, on the adapter
        base = httpx.post(f"{url}/score", json=replay, timeout=120).json()["scores"][0]
        assert base != got
