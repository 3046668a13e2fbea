"""8-bit KV caches (--kv-cache-dtype int8|fp8): the quantiser against its definition, the native
writes against torch's bytes, the attention kernel against float64 on every instruction set, and
a model on an 8-bit cache against the same model on float32's: agreement over a long text, the
pool's size, and bit-identical scoring cold, cached, batched and from a partly shared block."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch
from server_utils import GREEDY, HELLO, MODEL, own_server
from test_deterministic import WORDS, check_scoring_is_bit_identical

from ladle import LLM, SamplingParams
from ladle.config import KV_8BIT_NAMES, EngineConfig
from ladle.model import kv_quant
from ladle.model.attention import KVCache

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {torch.int8: 127, torch.float8_e4m3fn: 448}

PARAGRAPHS = [
    "The river rose through the night, and by morning the low fields were under water. Farmers moved their "
    "animals to the hills, and the school opened its doors to families who had nowhere else to go. By noon the "
    "rain had stopped, but the water kept rising, fed by the streams that came down from the mountains.",
    "In the old town the streets are narrow and the houses lean toward each other, so that in places a person "
    "could almost shake hands with a neighbour across the way. Tourists come for the market on Saturdays, where "
    "farmers sell cheese, honey, bread and vegetables from stalls that have stood in the same place for centuries.",
    "A good experiment begins with a question that can be answered. The scientist writes down what she expects "
    "to see, designs a test that could prove her wrong, and records every measurement, including the ones that "
    "do not fit. Only after the data are in does she decide what they mean.",
    "The train left the station at seven. Through the window the city gave way to suburbs, then to fields and "
    "small villages with church towers. A man across the aisle read a newspaper, folded it carefully, and fell "
    "asleep before the first stop.",
    "To make bread you need flour, water, salt and yeast. Mix them into a dough, knead it until it is smooth and "
    "springs back when pressed, and leave it somewhere warm to rise. After an hour, shape the loaf, let it rise "
    "again, and bake it in a hot oven until the crust is brown and the bottom sounds hollow when tapped.",
    "The committee met on Tuesday to discuss the budget for next year. The treasurer reported that costs had "
    "risen faster than income, mostly because of the new heating system, and proposed raising the membership "
    "fee. After a long discussion the members agreed to a smaller increase and asked for a revised plan.",
]


def long_text() -> str:
    """About 700 tokens of fixed English prose: the paragraphs, then again in reverse order (a
    second pass the model can copy from far back, which only a faithful cache allows)."""
    return "\n\n".join(PARAGRAPHS + PARAGRAPHS[::-1])


def test_the_formats_are_the_configs() -> None:
    assert set(KV_8BIT_NAMES) == set(kv_quant.KV_8BIT)


@pytest.mark.parametrize("name", FORMATS)
def test_quantiser_rounds_to_the_nearest_step(name: str) -> None:
    dtype = FORMATS[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 4, 64, generator=gen) * torch.rand(50, 4, 1, generator=gen) * 20
    x[7, 2] = 0.0
    q, scales = kv_quant.quantize(x, dtype)
    assert q.dtype == dtype and scales.shape == (50, 4)
    assert (scales[7, 2] == 0) and (q[7, 2].float() == 0).all()  # an all-zero head stays zero
    assert torch.equal(q.float().abs().amax(-1)[scales > 0], torch.full(((scales > 0).sum(),), float(QMAX[dtype])))
    err = (kv_quant.dequantize(q, scales) - x).abs()
    if dtype == torch.int8:  # half a step of the head's scale
        bound = scales[..., None] / 2
    else:  # half a unit in the last of 3 mantissa bits, or half the smallest subnormal (2^-9)
        y = (x / torch.where(scales > 0, scales, 1)[..., None]).abs()
        bound = torch.maximum(y * 2.0**-4, torch.full_like(y, 2.0**-10)) * scales[..., None]
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("name", FORMATS)
def test_native_writes_are_torchs_bytes_ties_included(isa_kernels, name: str) -> None:
    dtype = FORMATS[name]
    qmax = QMAX[dtype]
    if dtype == torch.int8:  # every half-integer in range: ties go to even
        ties = torch.arange(-qmax, qmax) + 0.5
    else:  # every midpoint between neighbouring e4m3 values, both signs
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        ties = torch.cat([(grid[1:] + grid[:-1]) / 2, -(grid[1:] + grid[:-1]) / 2])
    gen = torch.Generator().manual_seed(2)
    values = torch.cat([ties, torch.randn(24 * 63 - len(ties), generator=gen) * qmax / 3])
    # each head's max is the format's, so its scale is exactly 1 and x is quantised as it is
    k = torch.cat([torch.full((24, 1), float(qmax)), values[torch.randperm(len(values), generator=gen)].view(24, 63)],
                  dim=1).view(24, 1, 64)
    v = -k.flip(0)
    slots = torch.randperm(4 * 8, generator=gen)[: len(k)]
    caches = [torch.zeros(4, 8, 1, 64, dtype=dtype) for _ in range(2)]
    scales = [torch.zeros(4, 8, 1) for _ in range(2)]
    isa_kernels.write_kv_quantized(k, v, *caches, *scales, slots)
    for x_, cache, s in zip((k, v), caches, scales):
        q, expect = kv_quant.quantize(x_, dtype)
        assert torch.equal(cache.view(-1, 1, 64)[slots].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(s.view(-1, 1)[slots], expect)
    with pytest.raises(IndexError):
        isa_kernels.write_kv_quantized(k, v, *caches, *scales, slots + 100)


@pytest.mark.parametrize("name", FORMATS)
def test_prompt_attention_on_an_8bit_cache_matches_float64(isa_kernels, name: str) -> None:
    """Against float64 attention over the dequantised cache: within 1e-5 for values up to about 10."""
    dtype = FORMATS[name]
    heads, kv_heads, d, block_size = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(3)
    k_float, v_float = (torch.randn(10, block_size, kv_heads, d, generator=gen) * 3 for _ in range(2))
    (k, k_scales), (v, v_scales) = kv_quant.quantize(k_float, dtype), kv_quant.quantize(v_float, dtype)
    rows, first = 40, 20  # queries at positions 20..59 over blocks 3, 7, 1, 9
    table = torch.tensor([[3, 7, 1, 9]])
    q = torch.randn(rows, heads, d, generator=gen)
    out = torch.empty(rows, heads * d)
    isa_kernels.prompt_attention(q, k, v, table, torch.tensor([0]), torch.tensor([rows]), torch.tensor([first]),
                                 d**-0.5, out, k_scales, v_scales)
    keys = kv_quant.dequantize(k, k_scales)[table[0]].reshape(-1, kv_heads, d).double()
    values = kv_quant.dequantize(v, v_scales)[table[0]].reshape(-1, kv_heads, d).double()
    group = heads // kv_heads
    for t in range(rows):
        n = first + t + 1
        for h in range(heads):
            p = torch.softmax(q[t, h].double() @ keys[:n, h // group].T * d**-0.5, -1)
            assert torch.allclose(out[t, h * d : (h + 1) * d].double(), p @ values[:n, h // group], atol=1e-5)
    with pytest.raises(ValueError, match="scales"):
        isa_kernels.prompt_attention(q, k, v, table, torch.tensor([0]), torch.tensor([rows]), torch.tensor([first]),
                                     d**-0.5, out)


def test_an_8bit_cache_holds_over_1_9x_the_tokens_of_float32(smollm2_dir: Path) -> None:
    sizes = {}
    for kv in ("float32", "bfloat16", "int8", "fp8"):
        llm = LLM(str(smollm2_dir), kv_cache_dtype=kv, kv_cache_memory_gib=0.25)
        sizes[kv] = llm.engine.kv.num_blocks
        cache = llm.engine.runner.kv_cache
        held = sum(t.numel() * t.element_size() for t in cache.tensors())
        assert held <= 0.25 * 2**30 and held == sizes[kv] * KVCache.bytes_per_block(
            30, 16, 3, 64, llm.engine.kv_dtype)  # SmolLM2-135M: 30 layers, 3 KV heads of 64
        assert llm.engine.runtime_info()["kv_cache_dtype"] == {"fp8": "fp8_e4m3"}.get(kv, kv)
    assert sizes["int8"] == sizes["fp8"] >= 3.7 * sizes["float32"]  # 68 bytes per head and token against 256
    assert sizes["int8"] >= 1.85 * sizes["bfloat16"]


@pytest.fixture(scope="module")
def long_text_logprobs(smollm2_dir: Path) -> dict[str, list]:
    out = {}
    for kv in ("float32", "int8", "fp8"):
        llm = LLM(str(smollm2_dir), kv_cache_dtype=kv, kv_cache_memory_gib=0.25)
        ids = llm.tokenizer.encode(long_text())
        assert len(ids) > 600
        result = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        out[kv] = result[0].prompt_logprobs[1:]
    return out


@pytest.mark.parametrize("name, min_agreement, max_delta", [("int8", 0.98, 0.04), ("fp8", 0.96, 0.09)])
def test_an_8bit_cache_tracks_float32_over_a_long_text(long_text_logprobs, name: str, min_agreement: float,
                                                       max_delta: float) -> None:
    """Teacher-forced over ~700 tokens: the greedy next token agrees with the float32 cache's at
    the stated share of positions, each actual token's log-probability moves by less than the
    stated mean, and perplexity by less than 3%."""
    ref, got = long_text_logprobs["float32"], long_text_logprobs[name]
    agree = sum(r.top[0][0] == g.top[0][0] for r, g in zip(ref, got)) / len(ref)
    delta = sum(abs(r.logprob - g.logprob) for r, g in zip(ref, got)) / len(ref)
    assert agree >= min_agreement and delta < max_delta, (agree, delta)
    ppl = [math.exp(-sum(lp.logprob for lp in lps) / len(lps)) for lps in (ref, got)]
    assert abs(ppl[1] / ppl[0] - 1) < 0.03, ppl


@pytest.mark.parametrize("name", FORMATS)
def test_scoring_on_an_8bit_cache_is_bit_identical(smollm2_dir: Path, kernels: str, name: str) -> None:
    """Cold, cached, batched, and from a block copied in part (its scales copied with it)."""
    text = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(160))
    check_scoring_is_bit_identical(smollm2_dir, text, kernels, deterministic=True, kv_cache_dtype=name)


def test_a_server_on_an_fp8_cache_reports_its_pool_and_answers() -> None:
    gib = 0.05
    with own_server(EngineConfig(kv_cache_dtype="fp8", kv_cache_memory_gib=gib)) as server:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": HELLO, "max_tokens": 8, **GREEDY}).json()
        assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["message"]["content"]
        server.wait_idle()
        info = [k for k in server.scrape() if k.startswith("vllm:cache_config_info")]
    blocks = int(gib * 2**30) // KVCache.bytes_per_block(30, 16, 3, 64, torch.float8_e4m3fn)
    assert info == [f"vllm:cache_config_info{{block_size=16,cache_dtype=fp8_e4m3,enable_prefix_caching=True,"
                    f"num_gpu_blocks={blocks}}}"]
