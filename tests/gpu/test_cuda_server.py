"""A ladle server computing on the GPU answers the `openai` SDK: chat, completions with logprobs,
streaming, embeddings and a decision."""

from __future__ import annotations

import openai
import pytest

from ladle.config import EngineConfig
from ladle.engine.async_engine import AsyncEngine
from ladle.engine.engine import LLMEngine
from ladle.server.app import create_app
from server_utils import ServerThread

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu_client(tiny_models):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_models["llama"]), device="cuda", dtype="bfloat16",
                                                kv_cache_memory_gib=0.25, max_num_seqs=8)))
    engine.start()
    thread = ServerThread(create_app(engine, "tiny")).start()
    client = openai.OpenAI(base_url=f"{thread.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()
    thread.stop()
    engine.shutdown()


def test_chat_and_completions_on_the_gpu(gpu_client: openai.OpenAI) -> None:
    chat = gpu_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    done = gpu_client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=6,
                                         temperature=0, logprobs=2)
    assert len(done.choices[0].logprobs.tokens) == done.usage.completion_tokens
    assert all(lp <= 0 for lp in done.choices[0].logprobs.token_logprobs)
    chunks = list(gpu_client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=6,
                                                temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text


def test_version_names_the_gpu(gpu_client: openai.OpenAI) -> None:
    import httpx

    info = httpx.get(str(gpu_client.base_url).removesuffix("/v1/") + "/version").json()
    assert info["device"].startswith("cuda:") and "triton" in info["kernels"]


def test_embeddings_on_the_gpu(gpu_client: openai.OpenAI) -> None:
    out = gpu_client.embeddings.create(model="tiny", input=["one sentence", "another one"])
    assert len(out.data) == 2 and len(out.data[0].embedding) == 64
