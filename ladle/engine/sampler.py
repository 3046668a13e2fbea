"""Turns next-token logits into tokens: penalties, temperature, min-p, top-k/top-p, seeds.

A seeded request draws from its own generator, so its tokens do not depend on what
else shares the batch. Logprobs are those of the model distribution before penalties and
sampling settings, as in vLLM; a constrained row's are after its grammar mask (vLLM V1
masks before its sampler too), so they are renormalised over what the grammar allows.
A token the engine forces (a think block closed on budget) is emitted as it is, with the
model's logprob for it.
"""

from __future__ import annotations

import torch

from ladle.engine.request import Sequence, TokenLogprob
from ladle.structured.matcher import apply_grammar_masks


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = logprobs.topk(k)
    return list(zip(ids.tolist(), values.tolist()))


def token_logprob(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    return TokenLogprob(token_id, float(logprobs[token_id]), top_logprobs(logprobs, k))


class Sampler:
    def __init__(self, seed: int = 0):
        self.shared_generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            logits = logits.float().contiguous()
            apply_grammar_masks(logits, constrained, [seqs[i].grammar for i in constrained])
        raw = None
        if any(s.params.logprobs is not None for s in seqs):
            raw = torch.log_softmax(logits.float(), dim=-1)
        results = []
        for i, seq in enumerate(seqs):
            token = seq.forced_token
            if token is None:
                token = self._sample_row(logits[i], seq)
            lp = None
            if raw is not None and seq.params.logprobs is not None:
                lp = token_logprob(raw[i], token, seq.params.logprobs)
            results.append((token, lp))
        return results

    def _sample_row(self, x: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        if p.needs_penalties or seq.num_output_tokens < p.min_tokens:
            unpenalised, x = x, x.clone()
            self._penalise(x, seq)
            if seq.grammar is not None and bool(torch.isneginf(x).all()):
                x = unpenalised  # min_tokens banned the only tokens the grammar allows (its end)
        if p.greedy:
            return int(x.argmax())
        # vLLM V1's order: temperature, min_p over the whole vocabulary, top_k, then top_p over
        # what is left (so with min_p, top_p's mass is counted among the tokens min_p kept)
        x = x / p.temperature
        if p.min_p > 0.0:
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k > 0 and p.top_k < x.shape[-1]:
            kth = x.topk(p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            x = _top_p(x, p.top_p)
        probs = torch.softmax(x, dim=-1)
        gen = seq.generator or self.shared_generator
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one generator call per row.
        race = torch.empty_like(probs).exponential_(1.0, generator=gen)
        return int((probs / race).argmax())

    def _penalise(self, x: torch.Tensor, seq: Sequence) -> None:
        p = seq.params
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(seq.eos_token_ids))
            if banned:
                x[torch.tensor(banned)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)))
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=x.shape[-1])[: x.shape[-1]]
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_x, order = x.sort(descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    drop_sorted = (probs.cumsum(-1) - probs) > top_p  # keep the smallest set reaching top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
