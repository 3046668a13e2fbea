"""Mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss, Gemma 4, DeepSeek V3): a router picks each
token's top k experts, the experts' SwiGLU (Gemma 4: GELU-gated) outputs are summed weighted by their probabilities
(DeepSeek's: sigmoid scores, chosen within the best groups of experts, DeepseekMoEBlock).

Experts run grouped: the (token, choice) pairs are sorted by expert and each active expert
takes all its rows in one matmul, never a Python loop over tokens. Under tensor
parallelism every rank holds a share of every expert and the block's output is a partial
sum, all-reduced. Under expert parallelism a rank holds whole experts: each rank routes
its own run of the tokens, sends every pair to the rank holding its expert (all-to-all),
gets the results back (all-to-all), and the ranks' runs are gathered into the full batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.model.collectives import Single
from ladle.model.config import ModelConfig, MoEConfig
from ladle.model.layers import Linear, gelu_tanh_and_mul, rms_norm, silu_and_mul
from ladle.model.quantization import GroupedWeight
from ladle.model.sharding import Shard, padded_spans

Weight = torch.Tensor | GroupedWeight


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gating: the gate clamped above at limit, up within +-limit, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass
class Expert:
    """One SwiGLU MLP: gate and up fused, then down."""

    gate_up: Linear
    down: Linear
    clamp: tuple[float, float] | None = None  # gpt-oss's clamped SwiGLU: (alpha, limit)
    gelu: bool = False  # Gemma 4: gelu (tanh) gating

    def __call__(self, x: torch.Tensor, inv: bool) -> torch.Tensor:
        gate_up = self.gate_up(x, inv)
        if self.gelu:
            act = gelu_tanh_and_mul(gate_up)
        else:
            act = silu_and_mul(gate_up) if self.clamp is None else clamped_swiglu(gate_up, *self.clamp)
        return self.down(act, inv)

    @property
    def linears(self) -> tuple[Linear, Linear]:
        return (self.gate_up, self.down)


@dataclass
class MoEBlock:
    cfg: MoEConfig
    router: Linear  # hidden -> num_experts, whole on every rank
    experts: list[Expert]  # this rank's, global ids first_expert, first_expert + 1, ...
    first_expert: int
    shared: Expert | None  # Qwen2-MoE's shared expert, scaled by sigmoid(shared_gate(x))
    shared_gate: Linear | None
    expert_parallel: bool
    comm: object = Single()  # ladle.model.collectives
    tokens_per_expert: torch.Tensor | None = None  # int64 [num_experts], every routed (token, choice) counted

    def __post_init__(self) -> None:
        self.tokens_per_expert = torch.zeros(self.cfg.num_experts, dtype=torch.int64)

    @property
    def linears(self) -> list[Linear]:
        out = [self.router] + [lin for e in self.experts for lin in e.linears]
        if self.shared is not None:
            out += [*self.shared.linears] + ([self.shared_gate] if self.shared_gate is not None else [])
        return out

    def __call__(self, x: torch.Tensor, inv: bool) -> torch.Tensor:
        """The block's output for x [T, hidden], complete (already reduced over ranks)."""
        weights, chosen = self.route(x, inv)
        self.tokens_per_expert += torch.bincount(chosen.flatten(), minlength=self.cfg.num_experts)
        if self.expert_parallel and self.comm.world > 1:
            return self._expert_parallel(x, weights, chosen, inv)
        out = self._combine(self._run_experts(x, torch.arange(chosen.numel()) // self.cfg.top_k,
                                              chosen.flatten(), inv), weights)
        if self.shared is not None:
            out = out + self._shared(x, inv)
        return self.comm.all_reduce(out, ordered=inv)

    def route(self, x: torch.Tensor, inv: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k probabilities (softmax in float32, renormalised where the model does)
        and expert ids, [T, k] each, as transformers computes them."""
        logits = self.router(x, inv).float()
        if self.cfg.softmax_of_top_k:  # gpt-oss: the top k logits, then their softmax
            top, chosen = torch.topk(logits, self.cfg.top_k, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        probs = torch.softmax(logits, dim=-1)
        weights, chosen = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def _run_experts(self, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, inv: bool) -> torch.Tensor:
        """Row i of the result: expert[i] (a global id held here) applied to x[token[i]]."""
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert - self.first_expert, minlength=len(self.experts)).tolist()
        out = x.new_empty(expert.numel(), x.shape[1])
        start = 0
        for local, n in enumerate(counts):
            if n:
                rows = order[start : start + n]
                out[rows] = self.experts[local](x.index_select(0, token[rows]), inv)
                start += n
        return out

    def _combine(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[T * k, hidden] expert outputs (choice-major per token) -> their weighted sum per token, summed
        over the k choices in a fixed order: a token's bits do not depend on its batch."""
        t, k = weights.shape
        weighted = outputs * weights.reshape(-1, 1).to(outputs.dtype)
        return weighted.view(t, k, outputs.shape[1]).sum(dim=1)

    def _shared(self, x: torch.Tensor, inv: bool) -> torch.Tensor:
        """The shared expert's output, sigmoid-gated (Qwen2-MoE) or as it is (DeepSeek's, without a gate)."""
        if self.shared_gate is None:
            return self.shared(x, inv)
        return torch.sigmoid(self.shared_gate(x, inv)) * self.shared(x, inv)

    def _expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                         inv: bool) -> torch.Tensor:
        comm, k = self.comm, self.cfg.top_k
        per_rank = self.cfg.num_experts // comm.world
        spans = [(s.start, s.stop) for s in padded_spans(x.shape[0], comm.world)]
        lo, hi = spans[comm.rank]
        # what this rank sends: its tokens' choices, sorted by expert, hence by the rank that holds it
        mine = chosen[lo:hi].flatten()
        order = torch.argsort(mine, stable=True)
        send = torch.bincount(mine // per_rank, minlength=comm.world).tolist()
        # what it receives is known too (every rank routed every token alike): the choices of each
        # rank's tokens that fall on this rank's experts, in expert order
        arriving = [torch.sort(c[c // per_rank == comm.rank]).values
                    for c in (chosen[a:b].flatten() for a, b in spans)]
        recv = [len(a) for a in arriving]
        rows = comm.all_to_all_rows(x[lo:hi].index_select(0, order // k), send, recv)
        ids = torch.cat(arriving)
        done = self._run_experts(rows, torch.arange(len(ids)), ids, inv)
        back = comm.all_to_all_rows(done, recv, send)
        outputs = back.new_empty(back.shape)
        outputs[order] = back
        out = self._combine(outputs, weights[lo:hi])
        if self.shared is not None:
            out = out + self._shared(x[lo:hi], inv)
        return comm.all_gather_rows(out, [b - a for a, b in spans])


@dataclass
class Gemma4MoEBlock(MoEBlock):
    """Gemma 4's experts, run beside its dense MLP, on the layer's residual stream: the router reads it normed
    (without a weight), times its scale and hidden^-0.5, and weighs each chosen expert by the renormalised
    top-k probability times that expert's own scale; the experts read it through their own norm."""

    router_scale: torch.Tensor | None = None  # [hidden]
    per_expert_scale: torch.Tensor | None = None  # [num_experts]
    input_norm: torch.Tensor | None = None  # pre_feedforward_layernorm_2's float32 weight
    eps: float = 1e-6

    def __call__(self, residual: torch.Tensor, inv: bool) -> torch.Tensor:
        weights, chosen = self.route(residual, inv)
        self.tokens_per_expert += torch.bincount(chosen.flatten(), minlength=self.cfg.num_experts)
        x = rms_norm(residual, self.input_norm, self.eps)
        tokens = torch.arange(chosen.numel(), device=x.device) // self.cfg.top_k
        return self._combine(self._run_experts(x, tokens, chosen.flatten(), inv), weights)

    def route(self, residual: torch.Tensor, inv: bool) -> tuple[torch.Tensor, torch.Tensor]:
        unit = torch.ones(residual.shape[1], device=residual.device)
        x = rms_norm(residual, unit, self.eps) * self.router_scale * residual.shape[1] ** -0.5
        probs = torch.softmax(self.router(x, inv).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.cfg.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen


@dataclass
class DeepseekMoEBlock(MoEBlock):
    """DeepSeek V3's routing ("noaux_tc"): sigmoid scores in float32; a learned per-expert bias added to them to
    choose (it balances the load) but not to weigh; the experts split into n_group groups, each scored by the
    sum of its two best, and the top k chosen within the topk_group best groups; the chosen scores
    renormalised where the model does, then times routed_scaling_factor."""

    correction_bias: torch.Tensor | None = None  # float32 [num_experts]: e_score_correction_bias

    def route(self, x: torch.Tensor, inv: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        scores = torch.sigmoid(self.router(x.float(), inv))
        choice = scores + self.correction_bias
        if cfg.n_group > 1:
            groups = choice.view(x.shape[0], cfg.n_group, -1)
            best = torch.topk(groups.topk(2, dim=-1).values.sum(dim=-1), cfg.topk_group, dim=-1).indices
            kept = torch.zeros(x.shape[0], cfg.n_group, dtype=torch.bool, device=x.device).scatter_(1, best, True)
            choice = groups.masked_fill(~kept[..., None], float("-inf")).view(x.shape[0], -1)
        chosen = torch.topk(choice, cfg.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, chosen


def load_gemma4_moe_block(w: dict[str, Weight], layer: int, cfg: ModelConfig,
                          linear: Callable[[Weight, torch.Tensor | None], Linear]) -> Gemma4MoEBlock:
    """Layer `layer`'s Gemma 4 experts and router, taken out of `w` (one rank holds them all)."""
    p = f"model.layers.{layer}."
    gate_up, down = w.pop(p + "experts.gate_up_proj"), w.pop(p + "experts.down_proj")  # [E, 2I, H], [E, H, I]
    experts = [Expert(linear(gate_up[j].contiguous(), None), linear(down[j].contiguous(), None), gelu=True)
               for j in range(cfg.moe.num_experts)]
    return Gemma4MoEBlock(cfg.moe, linear(w.pop(p + "router.proj.weight"), None), experts, 0, None, None, False,
                          router_scale=w.pop(p + "router.scale"), per_expert_scale=w.pop(p + "router.per_expert_scale"),
                          # Gemma 4's norms multiply by their weight itself, in float32
                          input_norm=w.pop(p + "pre_feedforward_layernorm_2.weight").float(), eps=cfg.rms_norm_eps)


def _expert_weights(w: dict[str, Weight], prefix: str, j: int, model_type: str) -> tuple[Weight, Weight, Weight]:
    """(gate, up, down) of expert j, from per-expert tensors or transformers' fused 3-D ones."""
    e = f"{prefix}experts.{j}."
    if model_type == "gpt_oss":  # [experts, in, out], gate and up interleaved column by column
        gate_up, down = w[prefix + "experts.gate_up_proj"][j], w[prefix + "experts.down_proj"][j]
        return gate_up[:, ::2].t().contiguous(), gate_up[:, 1::2].t().contiguous(), down.t().contiguous()
    if model_type == "mixtral":
        return w.pop(e + "w1.weight"), w.pop(e + "w3.weight"), w.pop(e + "w2.weight")
    if e + "gate_proj.weight" in w:
        return w.pop(e + "gate_proj.weight"), w.pop(e + "up_proj.weight"), w.pop(e + "down_proj.weight")
    gate_up, down = w[prefix + "experts.gate_up_proj"][j], w[prefix + "experts.down_proj"][j]
    gate, up = gate_up.chunk(2, dim=0)
    return gate, up, down


def load_moe_block(w: dict[str, Weight], layer: int, cfg: ModelConfig, shard: Shard,
                   linear: Callable[[Weight, torch.Tensor | None], Linear],
                   cat: Callable[[list], Weight], comm: object) -> MoEBlock:
    """Layer `layer`'s MoE block, this rank's part of it, taken out of `w`."""
    moe = cfg.moe
    prefix = f"model.layers.{layer}." + ("block_sparse_moe." if cfg.model_type == "mixtral" else "mlp.")

    def expert(gate: Weight, up: Weight, down: Weight, whole: bool,
               biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> Expert:
        gate_up_bias, down_bias = biases or (None, None)
        if not whole:
            span = shard.span(gate.shape[0])
            gate, up, down = shard.rows(gate, span), shard.rows(up, span), shard.columns(down, span)
            if gate_up_bias is not None:  # gate's half and up's cut as their rows; the summed output's bias once
                gate_up_bias = torch.cat([shard.rows(b, span) for b in gate_up_bias.chunk(2)])
                down_bias = shard.row_parallel_bias(down_bias)
        return Expert(linear(cat([gate, up]), gate_up_bias), linear(down, down_bias), moe.clamped_swiglu)

    held = shard.experts(moe.num_experts)
    experts = []
    for j in range(moe.num_experts):
        parts = _expert_weights(w, prefix, j, cfg.model_type)
        if j in held:
            experts.append(expert(*parts, whole=shard.expert_parallel, biases=_expert_biases(w, prefix, j, moe)))
    for fused in ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias", "experts.down_proj_bias"):
        w.pop(prefix + fused, None)
    shared = shared_gate = None
    if moe.shared_expert_intermediate_size:
        s = prefix + ("shared_experts." if moe.n_shared_experts else "shared_expert.")
        # whole under expert parallelism: each rank computes it for its own run of the tokens
        shared = expert(w.pop(s + "gate_proj.weight"), w.pop(s + "up_proj.weight"), w.pop(s + "down_proj.weight"),
                        whole=shard.expert_parallel)
        if not moe.n_shared_experts:  # DeepSeek's shared experts have no gate
            shared_gate = linear(w.pop(prefix + "shared_expert_gate.weight"), None)
    if moe.scoring == "sigmoid":  # DeepSeek: the router in float32, as transformers keeps it
        router = Linear(w.pop(prefix + "gate.weight").float())
        return DeepseekMoEBlock(moe, router, experts, held.start, shared, None, shard.expert_parallel, comm,
                                correction_bias=w.pop(prefix + "gate.e_score_correction_bias").float())
    router = (linear(w.pop(prefix + "router.weight"), w.pop(prefix + "router.bias")) if cfg.model_type == "gpt_oss"
              else linear(w.pop(prefix + "gate.weight"), None))
    return MoEBlock(moe, router, experts, held.start, shared, shared_gate, shard.expert_parallel, comm)


def _expert_biases(w: dict[str, Weight], prefix: str, j: int,
                   moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """gpt-oss: expert j's gate_up bias (gate's then up's, de-interleaved as its weight) and down bias."""
    if not moe.biases:
        return None
    gate_up = w[prefix + "experts.gate_up_proj_bias"][j]
    return torch.cat((gate_up[::2], gate_up[1::2])), w[prefix + "experts.down_proj_bias"][j]
