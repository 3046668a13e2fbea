"""ladle.model.triton.ops against plain-torch references of the arithmetic they must keep.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py), on the CPU. The
interpreter rounds float32 -> bfloat16 by truncation, not to nearest even, so bf16 cases are
marked `cuda`; float16 and float32 run everywhere. References are always computed on the CPU
(ladle's torch path there is what the kernels must match). Rotary must match bit for bit, and
silu_and_mul on every finite float16 gate value must be float64's silu rounded once. The norms sum
their squares in another order than torch: in float16/bf16 that can flip the rounded norm by
one ulp, which the weight multiply carries to at most two ulps of the output; in float32 the
variance's last bits reach the output too. Where the sum of squares is exact, the norms match
bit for bit. ULPS holds the bounds, each the largest error measured at realistic sizes (hidden
4096, intermediate 14336, 256 rows), under the interpreter and on an H200.
"""

from __future__ import annotations

import math

import pytest
import torch

from ladle.model.triton import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)]
MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
# (op, dtype) -> the largest error allowed, in ulps of the reference. The GPU's exp2 is approximate
# (about 2 ulps in float32), which flips float16's rounding of silu by an ulp on a few gates there
# (2 ulps after the product); bf16 keeps too few bits for it to show: exact on every gate on an H200.
SILU_FP16 = 1 if DEVICE == "cuda" else 0
FLOAT32_SLACK = 2.0**-20  # silu's relative error in float32 (16 ulps: exp, add and divide), before rounding
ULPS = {("norm", torch.float32): 5, ("norm", torch.float16): 2, ("norm", torch.bfloat16): 2,
        ("silu", torch.float32): 5, ("silu", torch.float16): 2 * SILU_FP16, ("silu", torch.bfloat16): 0}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' new tensors start as NaN, so that an element a kernel fails to write fails the test."""
    monkeypatch.setattr(ops, "_empty", lambda shape, like: torch.full(shape, math.nan, dtype=like.dtype,
                                                                      device=like.device))


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |out - ref| in units of ref's last place (in its dtype); NaN anywhere counts as inf."""
    out, ref = out.cpu(), ref.cpu()
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.isnan().any() or ref.isnan().any():
        return math.inf
    exponent = torch.frexp(ref.double())[1].clamp(min=-13 if ref.dtype == torch.float16 else -125)
    spacing = torch.ldexp(torch.ones_like(ref, dtype=torch.float64), exponent - 1 - MANTISSA[ref.dtype])
    return ((out.double() - ref.double()).abs() / spacing).max().item()


# -- references: ladle's torch arithmetic, spelled out (computed on the CPU) -------------------------

def ref_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x, w = x.cpu(), w.cpu()
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if x.dtype == torch.float32:
        return normed * w
    # round the norm to the dtype, then the product in float32 rounded once (a bf16/fp16 mul)
    return (w.float() * normed.to(x.dtype).float()).to(x.dtype)


def ref_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, cos, sin = x.cpu(), cos.cpu(), sin.cpu()
    x1, x2 = x.float().chunk(2, dim=-1)
    t1 = (x.float() * cos.float()).to(x.dtype)
    t2 = (torch.cat((x2, x1), dim=-1) * sin.float()).to(x.dtype)
    return (t1.float() + t2.float()).to(x.dtype)


def ref_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.cpu().float().chunk(2, dim=-1)
    act = (gate / (1 + torch.exp(-gate))).to(gate_up.dtype)
    return (act.float() * up).to(gate_up.dtype)


def rope_tables(t: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, [T, 1, D], for random positions (as RotaryEmbedding.tables lays them out)."""
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(seed)).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(positions, inv_freq).unsqueeze(1)
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat((cos, cos), -1).to(dtype).to(DEVICE), torch.cat((-sin, sin), -1).to(dtype).to(DEVICE))


# -- rms_norm ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 80), (3, 1024), (2, 3, 4, 48)], ids=["odd", "pow2", "4d"])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = randn(*shape, dtype=dtype, seed=0) * 3
    w = randn(shape[-1], dtype=dtype, seed=1)
    out = ops.rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert ulps(out, ref_rms_norm(x, w)) <= ULPS["norm", dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_qkv_heads(dtype: torch.dtype) -> None:
    """q and k norms over [T, heads, D] views of a fused qkv output (row and head strides)."""
    t, heads, kv_heads, d = 5, 4, 2, 48
    qkv = randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, seed=2)
    before = qkv.clone()
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    for view, seed in ((q, 3), (k, 4)):
        w = randn(d, dtype=dtype, seed=seed)
        out = ops.rms_norm(view, w, EPS)
        assert out.shape == view.shape and out.is_contiguous()
        assert ulps(out, ref_rms_norm(view, w)) <= ULPS["norm", dtype]
    assert torch.equal(qkv, before)
    padded = randn(t, heads, d + 16, dtype=dtype, seed=18)[..., 8 : 8 + d]  # heads not D apart
    w = randn(d, dtype=dtype, seed=19)
    assert ulps(ops.rms_norm(padded, w, EPS), ref_rms_norm(padded, w)) <= ULPS["norm", dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_bit_exact_when_the_sum_is(dtype: torch.dtype) -> None:
    """With few significant bits in x, the sum of squares is exact in any order: then both norms must
    match bit for bit (rounding of the norm before the weight, and of h + a, included)."""
    g = torch.Generator().manual_seed(20)
    x = torch.randint(-8, 9, (6, 80), generator=g).to(dtype).to(DEVICE)
    w = randn(80, dtype=dtype, seed=21)
    assert torch.equal(ops.rms_norm(x, w, EPS).cpu(), ref_rms_norm(x, w))
    # h + a rounds back to h (a has h's sign and is under half its ulp), but only once the add is rounded
    h = torch.randint(1, 4, (6, 80), generator=g) * 2048.0 * (torch.randint(0, 2, (6, 80), generator=g) * 2 - 1)
    a = h.sign() * 0.375 * 2.0 ** (11 - MANTISSA[dtype])
    h, a = h.to(dtype).to(DEVICE), a.to(dtype).to(DEVICE)
    h_ref = h.cpu().clone()
    out = ops.add_rms_norm(h, a, w, EPS)
    assert torch.equal(h.cpu(), h_ref) and torch.equal(out.cpu(), ref_rms_norm(h_ref, w))


# -- add_rms_norm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [80, 512])
def test_add_rms_norm(dtype: torch.dtype, n: int) -> None:
    h = randn(6, n, dtype=dtype, seed=5) * 4
    a = randn(6, n, dtype=dtype, seed=6)
    h_ref = (h.cpu().float() + a.cpu().float()).to(dtype)  # h.add_(a) rounds to h's dtype
    w = randn(n, dtype=dtype, seed=7)
    out = ops.add_rms_norm(h, a, w, EPS)
    assert torch.equal(h.cpu(), h_ref), "h is updated in place, rounded once"
    assert ulps(out, ref_rms_norm(h_ref, w)) <= ULPS["norm", dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_strided_rows(dtype: torch.dtype) -> None:
    """h and a as column slices of wider buffers: their row strides are kept, the rest untouched."""
    n = 80
    hbuf, abuf = randn(5, 2 * n, dtype=dtype, seed=8), randn(5, 3 * n, dtype=dtype, seed=9)
    h, a = hbuf[:, n:], abuf[:, :n]
    hbuf_before = hbuf.clone()
    h_ref = (h.cpu().float() + a.cpu().float()).to(dtype)
    w = randn(n, dtype=dtype, seed=10)
    out = ops.add_rms_norm(h, a, w, EPS)
    assert torch.equal(h.cpu(), h_ref) and torch.equal(hbuf[:, :n], hbuf_before[:, :n])
    assert ulps(out, ref_rms_norm(h_ref, w)) <= ULPS["norm", dtype]


# -- rotary ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 128])
def test_rotary_qkv_in_place(dtype: torch.dtype, d: int) -> None:
    """q and k columns of a fused qkv output, viewed as [T, H + KVH, D], rotated in place bit for bit;
    v untouched."""
    t, heads, kv_heads = 5, 4, 2
    qkv = randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, seed=11) * 2
    before = qkv.clone()
    x = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    cos, sin = rope_tables(t, d, dtype, seed=12)
    expected = ref_rotary(x, cos, sin)
    assert ops.rotary(x, cos, sin) is x
    assert torch.equal(x.cpu(), expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])
    padded = randn(t, heads, d + 16, dtype=dtype, seed=22)  # heads not D apart
    x = padded[..., 8 : 8 + d]
    expected, edges = ref_rotary(x, cos, sin), padded[..., :8].clone()
    ops.rotary(x, cos, sin)
    assert torch.equal(x.cpu(), expected) and torch.equal(padded[..., :8], edges)


def test_rotary_over_more_heads_than_one_program_takes() -> None:
    """70 heads of 128: two programs per token (64 heads each), the second one partly masked."""
    t, heads, d = 3, 70, 128
    x = randn(t, heads, d, dtype=torch.float16, seed=31) * 2
    cos, sin = rope_tables(t, d, torch.float16, seed=32)
    expected = ref_rotary(x, cos, sin)
    ops.rotary(x, cos, sin)
    assert torch.equal(x.cpu(), expected)


# -- silu_and_mul ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("i", [80, 1100], ids=["odd", "two-blocks"])
def test_silu_and_mul(dtype: torch.dtype, i: int) -> None:
    buf = randn(3, 2 * i + 16, dtype=dtype, seed=13) * 3
    gate_up = buf[:, 16:]  # rows strided
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (3, i) and out.dtype == dtype and out.is_contiguous()
    assert ulps(out, ref_silu_and_mul(gate_up)) <= ULPS["silu", dtype]


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)])
@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's exp2 of huge gates: inf, as meant
def test_silu_every_gate(dtype: torch.dtype) -> None:
    """silu on every finite gate value (up = 1) is float64's silu rounded once to the dtype, but where
    that value lies within float32's evaluation error of a tie, where either neighbour is right. The
    float32 exp differs by a few ulps between CPUs (torch's reference on an AVX2-only EPYC rounds one
    float16 gate the other way from float64, where the kernel does not) and on a GPU (its exp2 is
    approximate); an error of one ulp in the dtype anywhere else fails."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    gate = gate[gate.isfinite()]
    gate_up = torch.cat((gate, torch.ones_like(gate))).view(1, -1).to(DEVICE)
    out = ops.silu_and_mul(gate_up).cpu()[0]
    g = gate.double()
    exact = g / (1 + torch.exp(-g))
    low, high = (exact * (1 - FLOAT32_SLACK)).to(dtype), (exact * (1 + FLOAT32_SLACK)).to(dtype)
    assert ((out == low) | (out == high)).all(), gate[(out != low) & (out != high)][:8]


# -- transformers' own modules, float32 --------------------------------------------------------------

def test_matches_transformers_llama() -> None:
    """LlamaRMSNorm within the float32 norm bound; apply_rotary_pos_emb with LlamaRotaryEmbedding's
    tables bit for bit (rotate_half's sign moved into sin changes no bits)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    t, heads, kv_heads, d = 6, 4, 2, 64
    norm = LlamaRMSNorm(heads * d, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(heads * d, generator=torch.Generator().manual_seed(14)))
    x = randn(t, heads * d, dtype=torch.float32, seed=15)
    with torch.no_grad():
        expected = norm(x.cpu())
    assert ulps(ops.rms_norm(x, norm.weight.detach().to(DEVICE), EPS), expected) <= ULPS["norm", torch.float32]

    config = LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=d, max_position_embeddings=4096, rope_theta=500000.0)
    q, k = randn(t, heads, d, dtype=torch.float32, seed=16), randn(t, kv_heads, d, dtype=torch.float32, seed=17)
    positions = torch.tensor([[0, 1, 2, 37, 1000, 4095]])
    cos, sin = LlamaRotaryEmbedding(config)(q.cpu(), positions)  # [1, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.cpu().transpose(0, 1)[None], k.cpu().transpose(0, 1)[None], cos, sin)
    cos_t, sin_t = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
    signed = torch.cat((-sin_t[..., : d // 2], sin_t[..., d // 2 :]), dim=-1)
    qk = torch.cat((q, k), dim=1)  # [T, H + KVH, D], as a fused qkv's columns
    ops.rotary(qk, cos_t.to(DEVICE), signed.to(DEVICE))
    assert torch.equal(qk[:, :heads].cpu(), q_hf[0].transpose(0, 1))
    assert torch.equal(qk[:, heads:].cpu(), k_hf[0].transpose(0, 1))
