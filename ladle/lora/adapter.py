"""A LoRA adapter read from a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`).

Its weights say what it targets: every `lora_A`/`lora_B` pair under a decoder layer's q, k, v,
o, gate, up or down projection. B is kept multiplied by its scaling (lora_alpha / r, or
lora_alpha / sqrt(r) under rsLoRA, per module where rank_pattern or alpha_pattern say so), so
serving adds (x A^T) B^T to the base projection as peft does. What ladle cannot serve exactly
(DoRA, biases, embedding or head adapters, modules_to_save) is refused with the reason.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ladle.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")
_ids = itertools.count(1)


class AdapterError(ValueError):
    """An adapter folder ladle cannot serve; the message says why."""


class AdapterNameError(AdapterError):
    """The adapter's name is the fault (empty, or already taken), not its folder."""


@dataclass(frozen=True, eq=False)
class AdapterRef:
    """One loaded adapter, as requests and the prefix cache know it: `id` is unique per load,
    so an adapter unloaded and loaded again under the same name never shares KV or a slot."""

    name: str
    path: Path
    rank: int  # the largest rank of its modules
    id: int = field(default_factory=lambda: next(_ids))


@dataclass
class AdapterWeights:
    """(layer, projection) -> (A [r, in], B * scaling [out, r]), float32."""

    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may target."""
    hidden, q, kv, inter = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                            cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_config(path: Path) -> dict:
    """adapter_config.json, checked for what ladle serves."""
    if not path.is_dir():
        raise AdapterError(f"{path} is not a folder (a PEFT adapter is a folder with {CONFIG_FILE} and {WEIGHTS_FILE})")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise AdapterError(f"{path} has no {name}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path / CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type is {config.get('peft_type')!r}; ladle serves LORA adapters")
    unsupported = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "lora_bias": "LoRA biases"}
    for key, what in unsupported.items():
        if config.get(key):
            raise AdapterError(f"{what} ({key}) are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias {config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {config['modules_to_save']} is not supported: only LoRA weights")
    if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), (int, float)):
        raise AdapterError(f"{CONFIG_FILE} needs an integer r and a number lora_alpha")
    return config


def _pattern_value(patterns: dict, module: str, default):
    """alpha_pattern as peft reads it: a key matches a module name ending in it (ranks come from the
    weights' shapes, so rank_pattern needs no reading)."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> tuple[AdapterRef, AdapterWeights]:
    """Read and check an adapter for a model of `cfg`; raises AdapterError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    config = read_config(path)
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise AdapterError(f"{path / WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in PROJECTIONS:
            raise AdapterError(f"weight {key!r} is not a LoRA A/B matrix of a q/k/v/o/gate/up/down projection")
        if int(m.group(2)) >= cfg.num_hidden_layers:
            raise AdapterError(f"weight {key!r} names layer {m.group(2)}; the model has {cfg.num_hidden_layers}")
        pairs.setdefault(m.group(1), {})[m.group(4)] = tensor
    if not pairs:
        raise AdapterError(f"{path / WEIGHTS_FILE} holds no LoRA weights")
    shapes = projection_shapes(cfg)
    modules, largest = {}, 0
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{module} has lora_{'A' if 'A' in ab else 'B'} without its pair")
        layer, proj = int(module.split(".")[2]), module.rsplit(".", 1)[1]
        a, b = ab["A"].float(), ab["B"].float()
        rank = a.shape[0]
        (d_in, d_out) = shapes[proj]
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise AdapterError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this "
                               f"model's {proj} ({d_in} -> {d_out}); was the adapter trained on another base?")
        if rank > max_rank:
            raise AdapterError(f"{module} has rank {rank}, over --max-lora-rank {max_rank}")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{module} holds non-finite weights")
        modules[(layer, proj)] = (a.contiguous(), (b * scaling).contiguous())
        largest = max(largest, rank)
    return AdapterRef(name, path, largest), AdapterWeights(modules)
