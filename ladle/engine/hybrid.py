"""What a hybrid model (Qwen3.5, Qwen3-Next: linear-attention layers with a recurrent state per sequence)
needs of the engine: its state slots, and the features it refuses because they would need the state too."""

from __future__ import annotations

import logging

from ladle.config import EngineConfig
from ladle.engine.state_cache import StateCache
from ladle.model.config import ModelConfig

log = logging.getLogger("ladle.engine")

# each would need the recurrent state to move, roll back or be split as K/V are
_UNSUPPORTED = {
    "tensor_parallel_size (--tensor-parallel-size)": lambda c: c.tensor_parallel_size > 1,
    "enable_lora (--enable-lora)": lambda c: c.enable_lora,
    "speculative_config (--speculative-config)": lambda c: c.speculative_config is not None,
    "kv_offload_gib (--kv-offload-gib)": lambda c: c.kv_offload_gib > 0,
    "kv_transfer_config (--kv-transfer-config)": lambda c: c.kv_transfer_config is not None,
}


def check_hybrid(config: EngineConfig, model: ModelConfig) -> None:
    """Refuse, naming the flag, what ladle does not run with a hybrid model (ValueError)."""
    if model.hybrid is None:
        return
    bad = [flag for flag, on in _UNSUPPORTED.items() if on(config)]
    if bad:
        raise ValueError(f"{model.model_type} keeps a linear-attention state per sequence: ladle does not run it "
                         f"with {', '.join(bad)}")


def start_states(config: EngineConfig, model: ModelConfig) -> StateCache | None:
    """The state slots of a hybrid model: one per running sequence, and the prefix cache's snapshots."""
    if model.hybrid is None:
        return None
    snapshots = config.max_state_snapshots if config.enable_prefix_caching else 0
    states = StateCache(config.max_num_seqs, snapshots)
    mib = model.hybrid.state_bytes / 2**20
    log.info("linear-attention state: %.2f MiB per sequence; %d slots (%d running, %d prefix-cache snapshots): "
             "%.1f MiB", mib, states.num_slots, config.max_num_seqs, snapshots, mib * states.num_slots)
    return states
