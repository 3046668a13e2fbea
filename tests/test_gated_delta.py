"""Gated DeltaNet (ladle.model.gated_delta), the linear attention of Qwen3.5 and Qwen3-Next, against
transformers: its token-by-token reference of the gated delta rule, and its whole Qwen3_5GatedDeltaNet
layer on random weights; prompts cut into chunks anywhere carry the state to the same end."""

from __future__ import annotations

import pytest
import torch

from ladle.model.gated_delta import (
    GatedDeltaNetWeights, LinearAttentionState, causal_conv, gated_delta_net, gated_delta_rule, gated_delta_step,
    l2_normalize,
)

HK, HV, DK, DV = 2, 4, 16, 8  # grouped: each key head serves two value heads
CUTS = [0, 17, 64, 100, 150]  # a chunk inside a CHUNK, one across its edge, a whole one, a short tail


def random_inputs(t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(t, HK, DK, generator=gen), "k": torch.randn(t, HK, DK, generator=gen),
            "v": torch.randn(t, HV, DV, generator=gen),
            "g": -torch.rand(t, HV, generator=gen) * 0.5,  # log decays, <= 0
            "beta": torch.rand(t, HV, generator=gen),
            "state": torch.randn(HV, DK, DV, generator=gen) * 0.1}


def prepared(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as ladle's rule takes them: normalised, q scaled, repeated over the value heads."""
    q, k = (l2_normalize(x[n]).repeat_interleave(HV // HK, dim=1) for n in "qk")
    return q * DK**-0.5, k


def transformers_rule(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    out, state = torch_recurrent_gated_delta_rule(x["q"][None], x["k"][None], x["v"][None], g=x["g"][None],
                                                  beta=x["beta"][None], initial_state=x["state"][None].clone(),
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


def test_the_chunked_rule_matches_transformers_token_by_token_reference() -> None:
    x = random_inputs(150)
    q, k = prepared(x)
    out, state = gated_delta_rule(q, k, x["v"], x["g"], x["beta"], x["state"])
    want_out, want_state = transformers_rule(x)
    assert torch.allclose(out, want_out, atol=2e-5) and torch.allclose(state, want_state, atol=2e-5)


def test_a_prompt_cut_anywhere_carries_the_state_to_the_same_end() -> None:
    x = random_inputs(150, seed=1)
    q, k = prepared(x)
    whole, whole_state = gated_delta_rule(q, k, x["v"], x["g"], x["beta"], x["state"])
    state, parts = x["state"], []
    for a, b in zip(CUTS, CUTS[1:]):
        out, state = gated_delta_rule(q[a:b], k[a:b], x["v"][a:b], x["g"][a:b], x["beta"][a:b], state)
        parts.append(out)
    assert torch.allclose(torch.cat(parts), whole, atol=1e-5) and torch.allclose(state, whole_state, atol=1e-5)


def test_decode_steps_continue_a_prompt_as_the_chunked_form_does() -> None:
    """Three sequences decoded a token at a time together, from their prompts' states."""
    seqs = [random_inputs(40, seed=s) for s in (2, 3, 4)]
    preps = [prepared(x) for x in seqs]
    prompts = [gated_delta_rule(q[:30], k[:30], x["v"][:30], x["g"][:30], x["beta"][:30], x["state"])
               for (q, k), x in zip(preps, seqs)]
    states = torch.stack([s for _, s in prompts])
    for t in range(30, 40):
        out, states = gated_delta_step(*(torch.stack([p[i][t] for p in preps]) for i in (0, 1)),
                                       *(torch.stack([x[n][t] for x in seqs]) for n in ("v", "g", "beta")), states)
        for b, ((q, k), x) in enumerate(zip(preps, seqs)):
            want, _ = gated_delta_rule(q[: t + 1], k[: t + 1], x["v"][: t + 1], x["g"][: t + 1], x["beta"][: t + 1],
                                       x["state"])
            assert torch.allclose(out[b], want[t], atol=2e-5)


def test_the_convolution_continues_from_its_state() -> None:
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(30, 6, generator=gen), torch.randn(6, 4, generator=gen)
    whole, whole_state = causal_conv(x, weight, torch.zeros(6, 3))
    first, state = causal_conv(x[:11], weight, torch.zeros(6, 3))
    rest, state = causal_conv(x[11:], weight, state)
    assert torch.allclose(torch.cat([first, rest]), whole, atol=1e-6) and torch.equal(state, whole_state)
    assert torch.equal(whole_state, x[-3:].T)
    # the first output sees zeros before the sequence: SiLU of the last tap alone
    assert torch.allclose(whole[0], torch.nn.functional.silu(x[0] * weight[:, -1]), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_layer_matches_transformers_qwen3_5_gated_deltanet(dtype: torch.dtype) -> None:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(6)
    cfg = Qwen3_5TextConfig(hidden_size=48, linear_num_key_heads=HK, linear_num_value_heads=HV,
                            linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
                            num_hidden_layers=1, layer_types=["linear_attention"])
    layer = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    layer = layer.to(dtype)
    x = torch.randn(150, 48).to(dtype)
    with torch.no_grad():
        want = layer(x[None])[0]
    sd = {n: p.detach() for n, p in layer.named_parameters()}
    w = GatedDeltaNetWeights(sd["in_proj_qkv.weight"], sd["in_proj_z.weight"], sd["in_proj_b.weight"],
                             sd["in_proj_a.weight"], sd["conv1d.weight"][:, 0], sd["dt_bias"], sd["A_log"],
                             sd["norm.weight"], sd["out_proj.weight"], HK, HV, DK, DV, cfg.rms_norm_eps)
    state = LinearAttentionState.zeros(2 * HK * DK + HV * DV, 4, HV, DK, DV)
    got = torch.cat([gated_delta_net(w, x[a:b], state) for a, b in zip(CUTS, CUTS[1:])])
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    assert got.dtype == dtype and (got.float() - want.float()).abs().max().item() < tol * want.abs().max().item()
