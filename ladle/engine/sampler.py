"""Turns next-token logits into tokens: allowed tokens, bad words, penalties, temperature, min-p,
top-k/top-p, seeds.

A seeded request draws from its own generator, so its tokens do not depend on what
else shares the batch. Logprobs are those of the model distribution before allowed_token_ids,
bad words, penalties and sampling settings, as in vLLM (its default raw_logprobs); a constrained
row's are after its grammar mask (vLLM V1 masks before its sampler too), so they are renormalised
over what the grammar allows.
A token the engine forces (a think block closed on budget) is emitted as it is, with the
model's logprob for it.

The whole batch is sampled with tensor ops on the logits' device: each row's settings go up
in two copies that do not wait for the device, and the tokens (with any logprobs) come back
in one copy, the call's only wait on the device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.engine.request import Sequence, TokenLogprob
from ladle.structured.matcher import apply_grammar_masks

NEG_INF = float("-inf")
# (probs [B, V], top_p [B]) -> probs with each row's tokens outside its nucleus zeroed, in place
NucleusKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = logprobs.topk(k)
    return list(zip(ids.tolist(), values.tolist()))


def token_logprob(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """A prompt token's logprob, the k most likely tokens, and its rank (tokens at least as likely)."""
    value = logprobs[token_id]
    return TokenLogprob(token_id, float(value), top_logprobs(logprobs, k), rank=int((logprobs >= value).sum()))


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device`, copied from pinned memory without waiting for the device."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


@dataclass
class BatchSettings:
    """Each row's settings on the device ([B] tensors); token indices are flat (row * V + token)."""

    temperature: torch.Tensor  # 1 for greedy rows, which take the argmax before it
    min_p: torch.Tensor
    top_p: torch.Tensor  # inf: off
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    top_k: torch.Tensor  # 0: off
    greedy: torch.Tensor
    forced: torch.Tensor  # the forced token, -1: none
    constrained: torch.Tensor  # has a grammar
    restricted: torch.Tensor  # has allowed_token_ids ...
    allowed: torch.Tensor  # ... which are these
    banned: torch.Tensor  # bad words' last tokens; and before min_tokens, stop tokens and EOS
    seen: torch.Tensor  # prompt and output tokens (repetition penalty), each once
    generated: torch.Tensor  # output tokens (presence and frequency penalties), each once ...
    counts: torch.Tensor  # ... with how often it was generated
    seeded: list[int]  # sampled rows with their own generator
    unseeded: bool  # some sampled row draws from the shared generator
    all_sampled: bool  # every row draws (no argmax needed)
    any_constrained: bool
    any_min_p: bool
    max_top_k: int  # 0: no row uses top_k
    any_top_p: bool

    @classmethod
    def of(cls, seqs: list[Sequence], vocab: int, device: torch.device) -> BatchSettings:
        ps = [s.params for s in seqs]
        sampled = [s.forced_token is None and not p.greedy for s, p in zip(seqs, ps)]
        floats = [[1.0 if p.greedy else p.temperature for p in ps], [p.min_p for p in ps],
                  [p.top_p if p.top_p < 1.0 else float("inf") for p in ps], [p.repetition_penalty for p in ps],
                  [p.presence_penalty for p in ps], [p.frequency_penalty for p in ps]]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]
        forced = [-1 if s.forced_token is None else s.forced_token for s in seqs]
        ints = [top_k, [p.greedy for p in ps], forced, [s.grammar is not None for s in seqs],
                [p.allowed_token_ids is not None for p in ps], _allowed_tokens(seqs, vocab),
                *_penalised_tokens(seqs, vocab)]
        uploaded = _upload([v for column in ints for v in column], torch.int64, device)
        top_k_t, greedy, forced_t, constrained, restricted, *masked = uploaded.split([len(c) for c in ints])
        return cls(*_upload(floats, torch.float32, device), top_k_t, greedy.bool(), forced_t, constrained.bool(),
                   restricted.bool(), *masked,
                   seeded=[i for i, s in enumerate(seqs) if sampled[i] and s.generator is not None],
                   unseeded=any(sampled[i] and s.generator is None for i, s in enumerate(seqs)),
                   all_sampled=all(sampled),
                   any_constrained=any(s.grammar is not None for s in seqs), any_min_p=any(p.min_p > 0.0 for p in ps),
                   max_top_k=max(top_k), any_top_p=any(p.top_p < 1.0 for p in ps))

    @property
    def penalised(self) -> bool:
        return bool(self.allowed.numel() or self.banned.numel() or self.seen.numel() or self.generated.numel())


def _allowed_tokens(seqs: list[Sequence], vocab: int) -> list[int]:
    """Flat indices of the tokens restricted rows may sample (the entry points check the ids)."""
    return [row * vocab + t for row, seq in enumerate(seqs) for t in seq.params.allowed_token_ids or ()]


def bad_word_bans(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """vLLM's rule: a bad word's last token is banned where the output ends with the rest of the word."""
    return [w[-1] for w in bad_words if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1 :] == w[:-1]]


def _penalised_tokens(seqs: list[Sequence], vocab: int) -> list[list[int]]:
    """Flat indices the penalties touch: banned, seen, generated, and each generated one's count."""
    banned, seen, generated, counts = [], [], [], []
    for row, seq in enumerate(seqs):
        p, base = seq.params, row * vocab
        if p.bad_words_token_ids:
            banned += [base + t for t in bad_word_bans(p.bad_words_token_ids, seq.output_token_ids)]
        if seq.num_output_tokens < p.min_tokens:
            eos = [] if p.ignore_eos else list(seq.eos_token_ids)
            banned += [base + t for t in p.stop_token_ids + eos]
        if p.repetition_penalty != 1.0:
            seen += [base + t for t in set(seq.token_ids)]
        if p.presence_penalty or p.frequency_penalty:
            for t, n in Counter(seq.output_token_ids).items():
                generated.append(base + t)
                counts.append(n)
    return [banned, seen, generated, counts]


def penalise(logits: torch.Tensor, s: BatchSettings) -> torch.Tensor:
    """vLLM's order: allowed_token_ids, bans (bad words, min_tokens), then repetition (x/r where
    x > 0, else x*r), then presence and frequency."""
    if not s.penalised:
        return logits
    x = logits.clone()
    flat, vocab = x.view(-1), x.shape[-1]
    if s.allowed.numel():
        keep = torch.zeros_like(flat, dtype=torch.bool).index_fill_(0, s.allowed, True).view_as(x)
        x.masked_fill_(~(keep | ~s.restricted[:, None]), NEG_INF)
    flat.index_fill_(0, s.banned, NEG_INF)
    if s.seen.numel():
        r, seen = s.repetition[s.seen // vocab], flat[s.seen]
        flat[s.seen] = torch.where(seen > 0, seen / r, seen * r)
    if s.generated.numel():
        row = s.generated // vocab
        flat[s.generated] -= s.frequency[row] * s.counts.float() + s.presence[row]
    if not s.any_constrained:
        return x
    # the bans may leave none of the tokens a grammar allows (min_tokens, its end): such a row goes unpenalised
    dead = s.constrained & torch.isneginf(x).all(-1)
    return torch.where(dead[:, None], logits, x)


def distribution(x: torch.Tensor, s: BatchSettings, top_p_head: int | None = None,
                 keep_nucleus: NucleusKernel | None = None) -> torch.Tensor:
    """What sampled rows draw from, in vLLM V1's order: temperature, min_p over the whole vocabulary,
    top_k, then top_p over what is left (so with min_p, top_p's mass is counted among the tokens
    min_p kept). Probabilities, left unnormalised where top_p drops tokens (the draw scales by each
    row's total). top_p's nucleus is found by `keep_nucleus` where the platform has one, else by
    sorting (see outside_nucleus)."""
    x = x / s.temperature[:, None]
    if s.any_min_p:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < s.min_p[:, None] * probs.amax(-1, keepdim=True), NEG_INF)
    if s.max_top_k:
        kth = x.topk(s.max_top_k, dim=-1).values.gather(1, (s.top_k.clamp(min=1) - 1)[:, None])
        kth = kth.masked_fill(s.top_k[:, None] == 0, NEG_INF)  # nothing is below -inf
        x = x.masked_fill(x < kth, NEG_INF)
    probs = x.softmax(-1)
    if s.any_top_p and keep_nucleus is not None:
        probs = keep_nucleus(probs, s.top_p)  # probs is softmax's own tensor: zeroed in place
    elif s.any_top_p:
        probs = probs.masked_fill(outside_nucleus(probs, s.top_p, top_p_head), 0.0)
    return probs


def outside_nucleus(probs: torch.Tensor, top_p: torch.Tensor, head: int | None) -> torch.Tensor:
    """Where top_p drops a token: past the smallest run of the row's likeliest tokens whose mass
    reaches top_p. With `head`, the run is looked for among each row's `head` likeliest tokens first,
    and rows whose run is longer are sorted whole: on the CPU sorting a 150k vocabulary takes tens of
    ms a row, while a trained model's nucleus at a usual top_p is a few hundred tokens. (Checking which
    rows fit waits on the device, so a GPU, which sorts a batch at once, sorts every row whole.)"""
    if head is None or head >= probs.shape[-1]:
        return _past_the_run(*probs.sort(-1, descending=True), top_p)
    likeliest, order = probs.topk(head, dim=-1)  # sorted
    before = likeliest.cumsum(-1) - likeliest
    dropped = torch.ones_like(probs, dtype=torch.bool).scatter_(1, order, before > top_p[:, None])
    longer = (before[:, -1] <= top_p).nonzero()[:, 0]  # rows that may keep tokens past the head
    if len(longer):
        dropped[longer] = _past_the_run(*probs[longer].sort(-1, descending=True), top_p[longer])
    return dropped


def _past_the_run(ordered: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    drop = (ordered.cumsum(-1) - ordered) > top_p[:, None]  # keep the smallest head reaching top_p
    return torch.zeros_like(drop).scatter_(1, order, drop)


class Sampler:
    def __init__(self, seed: int = 0, top_p_head: int | None = None, keep_nucleus: NucleusKernel | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """top_p_head and keep_nucleus: how top_p's nucleus is found (see distribution); argmax: a kernel
        for the greedy rows' argmax (None: torch's). The platform's choices."""
        self.seed = seed
        self.top_p_head = top_p_head
        self.keep_nucleus = keep_nucleus
        self.argmax = argmax or (lambda x: x.argmax(-1))
        self.shared_generator: torch.Generator | None = None  # made on the device of the first logits

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        if not seqs:
            return []
        logits = logits.float().contiguous()
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            apply_grammar_masks(logits, constrained, [seqs[i].grammar for i in constrained])
        settings = BatchSettings.of(seqs, logits.shape[-1], logits.device)
        x = penalise(logits, settings)
        tokens = None if settings.all_sampled else self.argmax(x)
        if settings.seeded or settings.unseeded:
            probs = distribution(x, settings, self.top_p_head, self.keep_nucleus)
            drawn = self._draw(probs, seqs, settings)
            tokens = drawn if tokens is None else torch.where(settings.greedy, tokens, drawn)
        tokens = torch.where(settings.forced >= 0, settings.forced, tokens)
        return _to_host(tokens, logits, [s.params.logprobs for s in seqs])

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence], s: BatchSettings) -> torch.Tensor:
        """A token per row of `probs`, where its CDF first passes one uniform draw: the shared
        generator's for unseeded rows, each seeded row's own (the same draw a batch of one makes, so
        a seeded row ignores its neighbours). One random number a row, where a race of exponentials
        takes one per vocabulary entry: on the CPU that took a third of a sampled decode step at batch
        16 of a 152k vocabulary. The CDF is summed in float64, so a token's share of [0, 1) is its
        probability to float32's precision, and a token of probability 0 owns none of it."""
        cdf = probs.double().cumsum(-1)  # (cumsum(dtype=float64) is several times slower on the CPU)
        u = torch.empty(len(seqs), 1, dtype=torch.float64, device=probs.device)
        if s.unseeded:
            u.uniform_(generator=self._shared(probs.device))
        for i in s.seeded:
            u[i] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=seqs[i].generator)
        total = cdf[:, -1:]
        point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # below the last step
        return torch.searchsorted(cdf, point, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)

    def _shared(self, device: torch.device) -> torch.Generator:
        if self.shared_generator is None or self.shared_generator.device != device:
            self.shared_generator = torch.Generator(device).manual_seed(self.seed)
        return self.shared_generator

    def _penalise(self, x: torch.Tensor, seq: Sequence) -> None:
        """One row's penalties, in place."""
        x.copy_(penalise(x[None], BatchSettings.of([seq], x.shape[-1], x.device))[0])


def _to_host(tokens: torch.Tensor, logits: torch.Tensor, ks: list[int | None]) -> list[tuple[int, TokenLogprob | None]]:
    """The tokens and the logprobs rows asked for, in one device-to-host copy."""
    if all(k is None for k in ks):
        return [(t, None) for t in tokens.tolist()]
    raw = torch.log_softmax(logits, dim=-1)
    most = max(k or 0 for k in ks)
    top = raw.topk(most, dim=-1)
    packed = torch.cat([tokens[:, None].double(), raw.gather(1, tokens[:, None]).double(),
                        top.indices.double(), top.values.double()], dim=1)
    results: list[tuple[int, TokenLogprob | None]] = []
    for row, k in zip(packed.tolist(), ks):
        token = int(row[0])
        ids, values = row[2 : 2 + most], row[2 + most :]
        lp = None if k is None else TokenLogprob(token, row[1], [(int(i), v) for i, v in zip(ids[:k], values[:k])])
        results.append((token, lp))
    return results
