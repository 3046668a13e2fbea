"""Device selection, KV sizing, graph bookkeeping and dummy weights: the CUDA path's parts that need no GPU."""

from __future__ import annotations

import pytest
import torch

from ladle.config import EngineConfig
from ladle.engine.cuda_graphs import StaticInputs, capture_sizes, padded_size
from ladle.model.config import ModelConfig
from ladle.platform import CpuPlatform, cuda_probe, resolve_platform
from ladle.platform.cuda import unsupported_on_cuda
from ladle.platform.memory import GRAPH_RESERVE, KVBudget, graph_reserve, sampler_reserve

GIB = 2**30


def test_auto_is_the_cpu_without_a_gpu_and_cuda_is_refused_with_the_reason() -> None:
    assert not torch.cuda.is_available()  # CI has no GPU; tests/gpu covers the other side
    assert isinstance(resolve_platform("auto"), CpuPlatform)
    usable, why = cuda_probe()
    assert not usable and ("no CUDA" in why or "sees no CUDA GPU" in why)
    with pytest.raises(ValueError, match="--device cuda: "):
        resolve_platform("cuda")


def test_the_triton_backend_on_the_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--attention-backend triton"):
        resolve_platform("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_platform("cpu", "triton").attention == "triton"


@pytest.mark.parametrize("field, value", [("device", "tpu"), ("gpu_memory_utilization", 0.0),
                                          ("gpu_memory_utilization", 1.5), ("attention_backend", "flash"),
                                          ("load_format", "pt"), ("kv_cache_memory_gib", -1.0)])
def test_bad_device_flags_are_refused_by_name(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_cuda_refuses_what_it_cannot_run_by_flag() -> None:
    assert unsupported_on_cuda(EngineConfig()) == []
    refused = unsupported_on_cuda(EngineConfig(quantization="int8", tensor_parallel_size=2,
                                               speculative_config={"method": "draft_model", "model": "x",
                                                                   "num_speculative_tokens": 2}))
    assert [r.split(" (")[0] for r in refused] == [
        "--tensor-parallel-size above 1", "--quantization int8", '--speculative-config with "method": "draft_model"']


def test_the_kv_budget_is_the_share_left_after_weights_activations_and_reserve() -> None:
    budget = KVBudget(total=140 * GIB, utilization=0.9, in_use=17 * GIB, activation_peak=2 * GIB,
                      reserve=sampler_reserve(256, 128256))
    assert budget.kv_bytes == int(140 * GIB * 0.9) - 19 * GIB - 4 * 256 * 128256 * 4
    per_block = 2 * 32 * 16 * 8 * 128 * 2  # Llama-3.1-8B's bf16 K and V, 16 tokens a block
    assert budget.num_blocks(per_block) == budget.kv_bytes // per_block
    assert "GiB for KV" in budget.describe()
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.1 leaves no room"):
        KVBudget(140 * GIB, 0.1, 17 * GIB, 2 * GIB, 0).num_blocks(per_block)


def test_graphs_hold_the_rows_of_the_largest_verification_step() -> None:
    """Each sequence's last token and its drafts: 4 tokens up to a quarter of disable_by_batch_size, 2
    (half of 3, and the token) up to a half, the token and one draft below it, nothing drafted from it on."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    assert EngineConfig(max_num_seqs=256).decode_graph_rows == 256
    assert EngineConfig(max_num_seqs=8, speculative_config=spec).decode_graph_rows == 32
    assert EngineConfig(max_num_seqs=24, speculative_config=spec).decode_graph_rows == 64  # 16 x 4 beats 24 x 2
    assert EngineConfig(max_num_seqs=256, speculative_config=spec).decode_graph_rows == 256  # 63 x 2 = 126 fewer
    assert graph_reserve(8, 32, 1000) == GRAPH_RESERVE + 24 * 1000 * 4


def test_capture_sizes_follow_the_ladder_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [248, 256] and len(sizes) == 35
    assert capture_sizes(300)[-3:] == [272, 288, 300]
    assert capture_sizes(4096)[-1] == 512
    assert padded_size(sizes, 3) == 4 and padded_size(sizes, 17) == 24 and padded_size(sizes, 257) is None


def test_static_inputs_pad_rows_so_they_write_and_read_nothing() -> None:
    inputs = StaticInputs.allocate(rows=8, width=4, device=torch.device("cpu"))
    inputs.fill(8, [5, 6, 7], [10, 11, 12], [40, 41, 42], [[2, 3], [4], [5, 6, 7]], [11, 12, 13])
    tokens, positions, slots, lens, tables = inputs.device_views(4)
    assert tokens.tolist() == [5, 6, 7, 0] and positions.tolist() == [10, 11, 12, 0]
    assert slots.tolist() == [40, 41, 42, -1] and lens.tolist() == [11, 12, 13, 0]
    assert tables[:3].tolist() == [[2, 3, 0, 0], [4, 0, 0, 0], [5, 6, 7, 0]]
    inputs.fill(8, [9], [3], [1], [[1]], [4])  # a smaller step: the rows it leaves become padding again
    assert inputs.device_views(4)[2].tolist() == [1, -1, -1, -1]


def test_dummy_weights_have_transformers_names_and_shapes(tmp_path) -> None:
    from transformers import Qwen2Config, Qwen3Config

    from ladle.model.dummy import dummy_weights

    for cls, extra in ((Qwen2Config, {}), (Qwen3Config, {"head_dim": 32})):
        hf = cls(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False, **extra)
        from transformers import AutoModelForCausalLM

        want = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(hf).state_dict().items()
                if "rotary" not in k}
        weights = dummy_weights(ModelConfig.from_hf_dict(hf.to_dict()), torch.bfloat16)
        assert {k: tuple(v.shape) for k, v in weights.items()} == want
        w = weights["model.layers.0.mlp.down_proj.weight"].float()
        assert w.dtype == torch.float32 and 0.015 < w.std() < 0.025 and weights["model.norm.weight"].eq(1).all()
