"""LoRA adapters the tests build themselves with peft over transformers' load of the default model,
saved in PEFT's format (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# name -> LoraConfig arguments: different targets, ranks, rsLoRA and per-module patterns
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
    "mlp": dict(r=4, lora_alpha=8, target_modules=MLP, use_rslora=True),
    "mixed": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "up_proj"],
                  rank_pattern={"down_proj": 4}, alpha_pattern={"v_proj": 32}, layers_to_transform=list(range(20))),
    "all": dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP),
}


def build_adapter(base, out: Path, seed: int, b_std: float = 0.2, **lora_args) -> Path:
    """A random adapter over `base` (a transformers model, left unchanged): A as peft initialises it,
    B drawn N(0, b_std) so the adapter changes what the model says."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(task_type="CAUSAL_LM", **lora_args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    model.save_pretrained(out)
    return out


def peft_model(base, folder: Path):
    """transformers + peft on a saved adapter (a copy of base)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
