"""DeepSeek V3 against transformers: a tiny random model (a q LoRA, interleaved rotary dims under YaRN with
its mscale, a dense first layer, then 8 routed experts in 4 groups beside a shared one) served from a latent KV
cache. Greedy tokens and logprobs plain, chunked at odd sizes, preempted and from prefix-cache hits at several
depths; canonical scoring bit-identical cold, cached and batched; decisions reusing a shared input; the
absorbed decode against the decompressed prompt path; the cache's bytes; tensor and expert parallel on two
ranks; MTP speculation."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from sampling_refs import chi_square_p
from test_deterministic import check_scoring_is_bit_identical
from test_engine_vs_hf import LOGPROB_TOL, PROMPTS, check_logprobs, hf_greedy
from tiny_models import SMOLLM2_TOKENIZER_FILES

from ladle import LLM, SamplingParams
from ladle.model.attention import AttentionMetadata, KVCache, PrefillSpan
from ladle.model.config import ModelConfig

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

RANK, ROPE, NOPE, V, HEADS = 24, 8, 16, 12, 4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, routed_scaling_factor=2.5,
            max_position_embeddings=2048, rope_parameters=YARN, rms_norm_eps=1e-6, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MAX_TOKENS = 10


def build_tiny_deepseek(out: Path, tokenizer_from: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random DeepSeek V3 saved by transformers, with SmolLM2's tokenizer. Routers and correction
    biases drawn wide (top-k choices far from ties), norm weights spread around 1."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0, 1.0)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.3)
    model.save_pretrained(out)
    for name in SMOLLM2_TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    folder = build_tiny_deepseek(tmp_path_factory.mktemp("deepseek"), smollm2_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf_model


def check_against_transformers(llm: LLM, hf_model, prompts: list[str]) -> None:
    """Greedy tokens equal to transformers' and every sampled and prompt logprob within tolerance."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=1)
    for prompt, res in zip(prompts, llm.generate(prompts, params), strict=True):
        assert res.outputs[0].token_ids == hf_greedy(hf_model, res.prompt_token_ids, MAX_TOKENS), prompt
        assert check_logprobs(res, hf_model, 5) < LOGPROB_TOL, prompt
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # nothing leaked


def test_the_config_is_read_as_transformers_reads_it(deepseek) -> None:
    folder, _ = deepseek
    cfg = ModelConfig.from_folder(folder)
    assert cfg.mla.kv_lora_rank == RANK and cfg.mla.q_lora_rank == 32 and cfg.mla.rope_interleave
    assert cfg.moe.sparse_layers == {1, 2} and cfg.moe.scoring == "sigmoid" and cfg.moe.n_shared_experts == 1
    assert (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.routed_scaling_factor) == (4, 2, 2.5)
    assert cfg.moe.shared_expert_intermediate_size == 32 and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.cache_layer_shapes == ((1, RANK + ROPE, 0),) * 3


def test_the_hub_config_of_deepseek_v3_is_read() -> None:
    """DeepSeek-V3's config.json as the Hub has it (rope_scaling with "type", noaux_tc routing): 58 routed layers
    of 256 experts in 8 groups, YaRN's mscale in the softmax scale, 61 x 576 latent numbers per token."""
    from ladle.engine.kv_report import kv_bytes_per_token
    from ladle.model.mla import softmax_scale

    hub = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
           "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
           "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
           "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
           "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
           "rope_theta": 10000, "num_nextn_predict_layers": 1,
           "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
    cfg = ModelConfig.from_hf_dict(hub)
    assert cfg.moe.sparse_layers == set(range(3, 61)) and cfg.moe.num_experts == 256 and cfg.moe.top_k == 8
    assert cfg.moe.shared_expert_intermediate_size == 2048 and (cfg.moe.n_group, cfg.moe.topk_group) == (8, 4)
    mscale = 0.1 * math.log(40) + 1.0
    assert softmax_scale(192, cfg.rope_scaling) == pytest.approx(192**-0.5 * mscale**2)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == {"latent": 61 * 576 * 2}
    with pytest.raises(ValueError, match="noaux_tc, sigmoid"):
        ModelConfig.from_hf_dict({**hub, "topk_method": "greedy", "scoring_func": "softmax"})


@pytest.mark.parametrize("case", ["plain", "chunked", "preempting"])
def test_deepseek_matches_transformers(deepseek, case: str) -> None:
    """chunked: prefill chunks of 13 tokens (odd: they end mid-block); preempting: a pool too small for the
    batch, sequences recomputed after losing their blocks."""
    folder, hf_model = deepseek
    args = {"plain": {}, "chunked": {"max_num_batched_tokens": 13, "long_prefill_token_threshold": 13, "block_size": 8},
            "preempting": {"num_kv_blocks": 20, "block_size": 8, "max_num_batched_tokens": 64}}[case]
    llm = LLM(str(folder), dtype="float32", **args)
    check_against_transformers(llm, hf_model, PROMPTS[:6])
    if case == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


def test_the_other_deepseek_shapes_match_transformers(tmp_path: Path, smollm2_dir: Path) -> None:
    """q_proj without a LoRA, rotary dims in halves, plain RoPE, one expert group (no group limit), the top k
    not renormalised, two shared experts fused; chunked at odd sizes."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny_deepseek(tmp_path / "deepseek", smollm2_dir, seed=3, q_lora_rank=None, rope_interleave=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, n_group=1,
                                 topk_group=1, norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.0)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=11, long_prefill_token_threshold=11, block_size=8)
    check_against_transformers(llm, hf_model, PROMPTS[2:5])


def test_prefix_cache_hits_at_several_depths(deepseek) -> None:
    """Prompts sharing a first prompt's first 1, 2 and 4 blocks (and one ending mid-block): each starts from
    the cached latents and continues as transformers does (no prompt logprobs: those recompute the prompt)."""
    folder, hf_model = deepseek
    llm = LLM(str(folder), dtype="float32", block_size=8)
    base = llm.tokenizer.encode(PROMPTS[6])
    llm.generate([base], SamplingParams(max_tokens=1))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    for depth in (8, 16, 21, 32):
        ids = base[:depth] + llm.tokenizer.encode(" and then the crew")
        hits = llm.engine.kv.stats.hits
        res = llm.generate([ids], params)[0]
        assert llm.engine.kv.stats.hits - hits >= depth // 8 * 8 > 0
        assert res.outputs[0].token_ids == hf_greedy(hf_model, ids, MAX_TOKENS), depth
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids + res.outputs[0].token_ids])).logits[0], dim=-1)
        for i, lp in enumerate(res.outputs[0].logprobs, start=len(ids) - 1):
            assert abs(lp.logprob - ref[i, lp.token_id].item()) < LOGPROB_TOL, depth


def test_scoring_is_bit_identical_cold_cached_and_batched(deepseek, kernels: str) -> None:
    """Canonical spans in block-aligned tiles, absorbed: the same bits however chunked, cached or batched,
    with the native kernels' canonical matmuls and with torch's fixed-shape ones."""
    folder, _ = deepseek
    text = " ".join(["the invoice was charged twice and the login page times out"] * 9)
    check_scoring_is_bit_identical(folder, text, kernels, dtype="float32")


def test_decisions_reuse_a_shared_input(deepseek) -> None:
    """Several questions over one input: the input's latents are computed once and the other questions' prompts
    start from them (cached tokens > 0), their probabilities a distribution."""
    import asyncio

    from ladle.config import EngineConfig
    from ladle.decisions.pipeline import decide
    from ladle.decisions.question import Option, Question
    from ladle.engine.async_engine import AsyncEngine
    from ladle.engine.engine import LLMEngine

    folder, _ = deepseek
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(folder), dtype="float32")))
    try:
        text = "The integration keeps failing every night after the upgrade. " * 6
        questions = [Question(f"q{i}", f"questions[{i}]", "choice", f"Which team should handle this ({i})?",
                              [Option("billing"), Option("technical"), Option("sales")]) for i in range(3)]
        result = asyncio.run(decide(engine, text, questions))
    finally:
        engine.shutdown()
    assert result.cached_tokens > 0
    for answer in result.answers:
        assert sum(answer.scores.probabilities) == pytest.approx(1.0)


def test_the_latent_cache_holds_one_vector_per_token(deepseek, caplog: pytest.LogCaptureFixture) -> None:
    """Per layer and token: kv_lora_rank + rope numbers and no V; the pool is sized by what is stored, and the
    start log's report says so."""
    from ladle.engine.kv_report import describe_kv_bytes, kv_bytes_per_token

    folder, _ = deepseek
    cfg = ModelConfig.from_folder(folder)
    for dtype in (torch.float32, torch.bfloat16):
        want = 3 * (RANK + ROPE) * dtype.itemsize * 16
        assert KVCache.bytes_per_block(3, 16, HEADS, ROPE, dtype, cfg.cache_layer_shapes) == want
        assert kv_bytes_per_token(cfg, dtype) == {"latent": want // 16}
    with caplog.at_level(logging.INFO, logger="ladle"):
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=10)
    assert f"(160 tokens, float32; latent {3 * (RANK + ROPE) * 4} B/token)" in caplog.text  # the start log
    cache = llm.engine.runner.kv_cache
    assert tuple(cache.k.shape) == (3, 10, 16, 1, RANK + ROPE) and cache.v.numel() == 0
    assert sum(t[:, 0].numel() * 4 for t in cache.tensors()) == llm.engine._bytes_per_block()
    assert describe_kv_bytes(cfg, torch.float32) == f"latent {3 * (RANK + ROPE) * 4} B/token"
    with pytest.raises(ValueError, match="8-bit KV cache"):  # not computed over latents yet: refused by name
        LLM(str(folder), dtype="float32", num_kv_blocks=10, kv_cache_dtype="int8")


def test_the_kv_report_of_a_full_attention_model() -> None:
    from ladle.engine.kv_report import kv_bytes_per_token

    cfg = ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})
    assert kv_bytes_per_token(cfg, torch.bfloat16) == {"full": 2 * 2 * 2 * 16 * 2}


def _attention_inputs(seed: int = 0):
    """A latent cache of one layer holding a 37-token sequence's latents (blocks out of order), its queries, and
    random per-head maps."""
    from ladle.model.layers import Linear
    from ladle.model.mla_attention import LatentHeads, MLAPagedAttention

    gen = torch.Generator().manual_seed(seed)
    n, bs = 37, 8
    cache = KVCache(1, 8, bs, 1, RANK + ROPE, layer_shapes=((1, RANK + ROPE, 0),))
    attention = MLAPagedAttention(cache, RANK, ROPE, (NOPE + ROPE) ** -0.5)
    table = torch.tensor([5, 2, 7, 0, 3])
    slots = torch.stack([table[p // bs] * bs + p % bs for p in range(n)])
    latent, k_pe = torch.randn(n, RANK, generator=gen), torch.randn(n, ROPE, generator=gen)
    attention.write(0, latent, k_pe, AttentionMetadata(slot_mapping=slots))
    heads = LatentHeads.of(Linear(torch.randn(HEADS * (NOPE + V), RANK, generator=gen) * 0.3), HEADS, NOPE, V)
    q_nope, q_pe = torch.randn(n, HEADS, NOPE, generator=gen), torch.randn(n, HEADS, ROPE, generator=gen)
    return attention, table, latent, k_pe, heads, q_nope, q_pe


def test_the_absorbed_decode_equals_the_decompressed_prompt_path() -> None:
    """The last token's attention three ways: as a decode (absorbed, read through the block table), as the last
    row of the whole prompt (decompressed into per-head K/V, SDPA) and as a canonical span (absorbed tiles)."""
    attention, table, latent, k_pe, heads, q_nope, q_pe = _attention_inputs()
    n = latent.shape[0]
    prompt = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSpan(0, n, n, table)])
    whole = attention.attend(0, q_nope, q_pe, latent, k_pe, heads, prompt)
    decode = AttentionMetadata(slot_mapping=torch.tensor([0]), num_decodes=1, decode_block_tables=table[None],
                               decode_context_lens=torch.tensor([n]))
    attention.prepare(decode)
    last = attention.attend(0, q_nope[-1:], q_pe[-1:], latent[-1:], k_pe[-1:], heads, decode)
    assert torch.allclose(last, whole[-1:], atol=1e-5, rtol=1e-4)
    # the prompt's second half continuing from the cache, and canonically from mid-block
    rest = AttentionMetadata(slot_mapping=torch.arange(n - 20), prefills=[PrefillSpan(0, 20, n, table)])
    assert torch.allclose(attention.attend(0, q_nope[-20:], q_pe[-20:], latent[-20:], k_pe[-20:], heads, rest),
                          whole[-20:], atol=1e-5, rtol=1e-4)
    rest.prefills[0].canonical = True
    assert torch.allclose(attention.attend(0, q_nope[-20:], q_pe[-20:], latent[-20:], k_pe[-20:], heads, rest),
                          whole[-20:], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="--enforce-eager"):  # CUDA graphs: refused by name, not captured
        attention.static_decode(table[None], torch.tensor([n]))


@pytest.mark.slow  # starts a worker process
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_match_one_process_and_transformers(deepseek, expert_parallel: bool) -> None:
    """Tensor parallel: each rank its half of the heads (q_b and kv_b rows, o_proj columns), of the dense
    first layer and, without expert parallel, of every expert; with it, half the experts whole. Every rank
    computes the whole latent, so each caches what one rank would."""
    folder, hf_model = deepseek
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    threads = torch.get_num_threads()
    single = LLM(str(folder), dtype="float32").generate(PROMPTS[3:6], params)
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              max_num_batched_tokens=32)  # chunked: prefill chunks beside decodes
    try:
        parallel = llm.generate(PROMPTS[3:6], params)
        for a, b in zip(single, parallel, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids == hf_greedy(hf_model, a.prompt_token_ids, 6)
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs)) < 2e-4
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
        assert sum(map(sum, llm.engine.expert_load().values())) > 0
    finally:
        llm.engine.close()
        torch.set_num_threads(threads)


def test_mtp_under_tensor_parallel_is_refused(deepseek) -> None:
    folder, _ = deepseek
    with pytest.raises(ValueError, match='method "mtp"'):
        LLM(str(folder), dtype="float32", tensor_parallel_size=2, speculative_config=MTP)


MTP = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 64}


def add_mtp_layer(folder: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """transformers saves no MTP layer: write one into the checkpoint as DeepSeek V3's are laid out
    (model.layers.{num_hidden_layers}.*: enorm, hnorm, eh_proj, shared_head.norm, and a routed decoder layer,
    drawn at random), and return its tensors."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    n, hidden = TINY["num_hidden_layers"], TINY["hidden_size"]
    mtp = {}
    for name, t in tensors.items():
        if name.startswith(f"model.layers.{n - 1}."):  # a routed layer's shapes, values of its own
            spread = 1.0 if name.endswith("gate.weight") else 0.2
            values = torch.rand(t.shape, generator=gen) + 0.5 if "norm" in name else torch.randn(t.shape, generator=gen)
            mtp[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = values if "norm" in name else values * spread
    mtp[f"model.layers.{n}.mlp.gate.e_score_correction_bias"] = torch.zeros(TINY["n_routed_experts"])
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{n}.{norm}.weight"] = torch.rand(hidden, generator=gen) + 0.5
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.2
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    return mtp


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, deepseek):
    folder = build_tiny_deepseek(tmp_path_factory.mktemp("deepseek-mtp"), smollm2_dir)
    return folder, deepseek[1], add_mtp_layer(folder)


def reference_drafts(hf_model, mtp: dict[str, torch.Tensor], context: list[int], k: int) -> list[int]:
    """DeepSeek's MTP drafting written out with transformers' modules: the target's final hidden states
    before the last token, joined with the embeddings of the tokens after each position (position 0's zeroed),
    through the MTP decoder layer; then k - 1 more positions, each fed the layer's last output and the draft."""
    from torch import nn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    n, cfg = TINY["num_hidden_layers"], hf_model.config
    p = f"model.layers.{n}."
    layer = DeepseekV3DecoderLayer(cfg, n).eval()
    state = {k[len(p):]: v for k, v in mtp.items()
             if k[len(p):].split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
    experts = range(cfg.n_routed_experts)  # transformers holds the experts fused, [experts, out, in]
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([state.pop(f"mlp.experts.{j}.gate_proj.weight"),
                                                                state.pop(f"mlp.experts.{j}.up_proj.weight")])
                                                     for j in experts])
    state["mlp.experts.down_proj"] = torch.stack([state.pop(f"mlp.experts.{j}.down_proj.weight") for j in experts])
    layer.load_state_dict(state)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].weight.data = mtp[f"{p}{name}.weight"]
    eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    eh_proj.weight.data = mtp[p + "eh_proj.weight"]
    embed, head = hf_model.model.embed_tokens, hf_model.lm_head
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([context[:-1]])).last_hidden_state[0]
        tokens, drafts, rows = list(context[1:]), [], []
        for step in range(k):
            emb = embed(torch.tensor(tokens))
            emb[0] = 0
            joined = eh_proj(torch.cat([norms["enorm"](emb), norms["hnorm"](hidden)], dim=-1))[None]
            positions = torch.arange(len(tokens))[None]
            mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
            out = layer(joined, mask, positions, position_embeddings=hf_model.model.rotary_emb(joined, positions))[0]
            drafts.append(int(head(norms["shared_head.norm"](out[-1])).argmax()))
            tokens.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
    return drafts


def test_mtp_drafts_are_deepseeks_and_greedy_output_is_unchanged(deepseek_mtp, monkeypatch) -> None:
    """With the checkpoint's MTP layer drafting 3 tokens: every draft what DeepSeek's MTP drafting gives (caught
    up over the prompt, then over each verified step), and the greedy output still transformers'."""
    from ladle.spec_decode.mtp import MTPDrafter

    folder, hf_model, mtp = deepseek_mtp
    calls = []
    propose = MTPDrafter.propose

    def recorded(self, seqs, rooms):
        drafts = propose(self, seqs, rooms)
        calls.extend((list(seq.token_ids), room, draft) for seq, room, draft in zip(seqs, rooms, drafts))
        return drafts

    monkeypatch.setattr(MTPDrafter, "propose", recorded)
    llm = LLM(str(folder), dtype="float32", block_size=8, speculative_config=MTP)
    assert llm.engine.runner.model.mtp is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, res in zip(PROMPTS[1:4], llm.generate(PROMPTS[1:4], params), strict=True):
        assert res.outputs[0].token_ids == hf_greedy(hf_model, res.prompt_token_ids, MAX_TOKENS), prompt
    assert llm.engine.stats.spec.num_drafts > 0 and len(calls) >= 6
    for context, room, drafts in calls[:: max(1, len(calls) // 6)]:
        assert drafts == reference_drafts(hf_model, mtp, context, room)
    # preempted sequences lose their blocks, and the MTP layer catches up from scratch when they draft again
    squeezed = LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=12, speculative_config=MTP)
    for prompt, res in zip(PROMPTS[1:4], squeezed.generate(PROMPTS[1:4], params), strict=True):
        assert res.outputs[0].token_ids == hf_greedy(hf_model, res.prompt_token_ids, MAX_TOKENS), prompt
    assert squeezed.engine.scheduler.num_preemptions > 0


def test_mtp_needs_an_mtp_layer(deepseek) -> None:
    folder, _ = deepseek
    with pytest.raises(ValueError, match="this model has none"):
        LLM(str(folder), dtype="float32", speculative_config=MTP)


def test_mtp_keeps_seeded_samples_and_frees_every_block(deepseek_mtp) -> None:
    """One draw per emitted token, in order: seeded requests (n=2) emit the same tokens with MTP drafting as
    without; drafts counted in the metrics, and every block back in the pool after."""
    folder, _, _ = deepseek_mtp
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=12, n=2) for s in range(3)]
    plain = LLM(str(folder), dtype="float32").generate(PROMPTS[:3], params)
    spec = LLM(str(folder), dtype="float32", speculative_config=MTP)
    drafted = spec.generate(PROMPTS[:3], params)
    assert [[o.token_ids for o in r.outputs] for r in drafted] == [[o.token_ids for o in r.outputs] for r in plain]
    stats = spec.engine.stats.spec
    assert stats.num_draft_tokens > 0 and sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks


def test_mtp_samples_keep_the_targets_distribution(deepseek_mtp) -> None:
    """1,500 seeded samples with MTP drafting: the second token, the verification step's first row (a draft
    for it proposed by the MTP layer), against softmax(z / T) of transformers' logits (a chi-square test),
    given the most common first."""
    folder, hf_model, _ = deepseek_mtp
    temperature, n = 0.35, 1500
    prompt = PROMPTS[1]
    llm = LLM(str(folder), dtype="float32", max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=1024,
              speculative_config={**MTP, "num_speculative_tokens": 1, "disable_by_batch_size": 10**6})
    results = llm.generate([prompt] * n, [SamplingParams(temperature=temperature, seed=s, max_tokens=3,
                                                          ignore_eos=True) for s in range(n)])
    # a draft for every sequence's second token; the random MTP layer's are rejected (its favourite is not the
    # model's), so the second token comes from the verification's residual, which must still be the model's own
    assert llm.engine.stats.spec.num_draft_tokens == n
    tokens = torch.tensor([r.outputs[0].token_ids[:2] for r in results])
    first = int(tokens[:, 0].mode().values)
    rows = tokens[tokens[:, 0] == first, 1]
    assert len(rows) > 300
    with torch.no_grad():
        logits = hf_model(torch.tensor([results[0].prompt_token_ids + [first]])).logits[0, -1].double()
    probs = torch.softmax(logits / temperature, -1)
    assert chi_square_p(torch.bincount(rows, minlength=probs.shape[0]), probs) > 1e-4


def test_the_offload_tier_restores_latents(deepseek, tmp_path: Path) -> None:
    """A session's prefix evicted from a small pool goes to the disk tier as latents (the zero-width V holds
    nothing to write) and comes back: turn 2 starts from it and continues as on a pool that never evicted."""
    from test_kv_offload import assert_no_leak, session

    folder, _ = deepseek
    want_out, want_logprobs, _ = session(LLM(str(folder), dtype="float32", num_kv_blocks=200, deterministic=True),
                                         evict=False)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=24, kv_offload_gib=0.01, kv_offload_dir=str(tmp_path),
              deterministic=True)
    out, logprobs, cached = session(llm, evict=True)
    assert llm.engine.kv.offload.tier.stats.restored >= 5 and cached >= 176
    assert out == want_out and [lp.logprob for lp in logprobs] == [lp.logprob for lp in want_logprobs]
    assert_no_leak(llm)


def test_deepseeks_own_fp8_format_serves_what_transformers_fp8_loader_serves(deepseek, tmp_path: Path) -> None:
    """DeepSeek V3's checkpoints as released: every projection in e4m3 with a scale per block
    (weight_scale_inv), read by transformers' own FP8 loader as the reference; ladle dequantises on the CPU."""
    from test_fp8_checkpoints import write_checkpoint
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    folder = tmp_path / "fp8"
    write_checkpoint(deepseek[0], folder, "hf-block", block=(8, 8))
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    check_against_transformers(LLM(str(folder), dtype="float32"), hf_model, PROMPTS[:3])
