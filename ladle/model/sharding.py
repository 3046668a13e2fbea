"""Which part of each weight a tensor-parallel rank holds.

Megatron's split: q/k/v and gate/up are column-parallel (each rank keeps its heads' and its
share of the intermediate's output rows), o and down row-parallel (the matching input
columns; their outputs are partial sums, all-reduced). The LM head is split by vocabulary
rows and its logits gathered. Embeddings, norms and routers are kept whole. With expert
parallelism a rank keeps whole experts, a contiguous run of them, instead of a share of each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ladle.model.config import ModelConfig
from ladle.model.fp8 import Fp8Weight
from ladle.model.quantization import GroupedWeight

Weight = torch.Tensor | GroupedWeight | Fp8Weight


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1
    expert_parallel: bool = False

    @property
    def whole(self) -> bool:
        return self.world == 1

    def span(self, n: int) -> slice:
        """This rank's share of n items split evenly (n divisible by world)."""
        part = n // self.world
        return slice(self.rank * part, (self.rank + 1) * part)

    def padded_span(self, n: int) -> slice:
        """This rank's share of n rows split in ceil(n / world) runs, the last one short."""
        return padded_spans(n, self.world)[self.rank]

    def experts(self, num_experts: int) -> range:
        """The experts this rank computes: all of them unless experts are spread over ranks."""
        if not self.expert_parallel:
            return range(num_experts)
        s = self.span(num_experts)
        return range(s.start, s.stop)

    def check(self, cfg: ModelConfig) -> None:
        """Raises ValueError where cfg does not split evenly over world ranks."""
        if self.whole:
            return
        if cfg.model_type == "gemma4_text":  # its per-layer attention shapes, shared K/V and per-layer inputs
            raise ValueError("Gemma 4 runs on one rank only for now (no tensor parallel)")
        sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                 "intermediate_size": cfg.intermediate_size}
        if cfg.moe is not None:
            key = "num_experts" if self.expert_parallel else "moe_intermediate_size"
            sizes[key] = cfg.moe.num_experts if self.expert_parallel else cfg.moe.intermediate_size
            if cfg.moe.shared_expert_intermediate_size and not self.expert_parallel:
                sizes["shared_expert_intermediate_size"] = cfg.moe.shared_expert_intermediate_size
        bad = {k: v for k, v in sizes.items() if v % self.world}
        if bad:
            listed = ", ".join(f"{k}={v}" for k, v in bad.items())
            raise ValueError(f"tensor_parallel_size {self.world} does not divide the model's {listed}")

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes one rank computes with: its heads and its share of each MLP."""
        if self.whole:
            return cfg
        moe = cfg.moe
        if moe is not None and not self.expert_parallel:
            moe = replace(moe, intermediate_size=moe.intermediate_size // self.world,
                          shared_expert_intermediate_size=moe.shared_expert_intermediate_size // self.world)
        return replace(cfg, num_attention_heads=cfg.num_attention_heads // self.world,
                       num_key_value_heads=cfg.num_key_value_heads // self.world,
                       intermediate_size=cfg.intermediate_size // self.world, moe=moe)

    def rows(self, w: Weight, span: slice) -> Weight:
        """Output rows `span` of w (or of a bias)."""
        if self.whole:
            return w
        if isinstance(w, Fp8Weight):
            return w.rows(span)
        if isinstance(w, GroupedWeight):
            mins = None if w.mins is None else w.mins[span].clone()
            return GroupedWeight(w.q[span].clone(), w.scales[span].clone(), mins, w.source)
        return w[span].clone()

    def columns(self, w: Weight, span: slice) -> Weight:
        """Input columns `span` of w; a grouped weight's groups must not straddle the cut."""
        if self.whole:
            return w
        if isinstance(w, Fp8Weight):
            return w.columns(span)
        if isinstance(w, GroupedWeight):
            size = w.size
            if span.start % size or span.stop % size:
                raise ValueError(f"a quantised weight's groups of {size} inputs do not split at column "
                                 f"{span.start}: run tensor-parallel with --quantization none")
            groups = slice(span.start // size, span.stop // size)
            mins = None if w.mins is None else w.mins[:, groups].clone()
            return GroupedWeight(w.q[:, span].clone(), w.scales[:, groups].clone(), mins, w.source)
        return w[:, span].clone()

    def row_parallel_bias(self, bias: torch.Tensor) -> torch.Tensor | None:
        """A row-parallel layer's bias: its ranks' outputs are partial sums, so one rank adds it."""
        return bias if self.rank == 0 else None

    def column_parallel(self, parts: list[Weight]) -> list[Weight]:
        """Each of several fused projections (gate and up, say) cut to this rank's output rows."""
        return [self.rows(p, self.span(p.shape[0])) for p in parts]


def padded_spans(n: int, world: int) -> list[slice]:
    """Every rank's share of n rows split in ceil(n / world) runs, the last one short (or empty)."""
    part = -(-n // world)
    return [slice(min(n, r * part), min(n, (r + 1) * part)) for r in range(world)]


def head_rows(shard: Shard, num_heads: int, head_dim: int) -> slice:
    s = shard.span(num_heads)
    return slice(s.start * head_dim, s.stop * head_dim)
