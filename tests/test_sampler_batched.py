"""The batched sampler against references written out here, in float64 on the CPU.

A mixed batch gives each seeded, greedy or forced row what that row gives alone; greedy rows
take the argmax of the penalised reference logits; the filters keep exactly the reference's
tokens, in its proportions; logprobs are log_softmax's. Seeds are fixed, so every test is
deterministic: the statistical bounds only say how far a correct sampler may drift.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from sampling_refs import chi_square_p, min_p_keeping, top_p_keeping

from ladle.engine.request import Sequence
from ladle.engine.sampler import Sampler, token_logprob, top_logprobs
from ladle.engine.sampling_params import SamplingParams
from ladle.model import kernels

V = 40  # two bitmask words, the second one partly used
EOS, STOP = V - 1, 30
PROMPT = [3, 7, 7, 12, 20]
P_MIN = 1e-4  # chi-square p-value floor: a correct sampler fails it once in 10,000 seeds


# -- the reference -------------------------------------------------------------------


def reference_logits(z: torch.Tensor, params: SamplingParams, output: list[int],
                     allowed: list[int] | None = None) -> torch.Tensor:
    """vLLM's sampler in float64, after the grammar mask: only allowed_token_ids stay; a bad word's
    last token is banned where the output ends with the rest of the word; min_tokens bans the stop
    tokens and EOS; a token seen in the prompt or output is divided by repetition_penalty if
    positive, multiplied if not; a token generated c times loses c * frequency_penalty, and
    presence_penalty once. A constrained row the bans leave with nothing goes unpenalised."""
    masked = [float(v) if allowed is None or t in allowed else -math.inf for t, v in enumerate(z.tolist())]
    x = list(masked)
    if params.allowed_token_ids is not None:
        x = [v if t in params.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for word in params.bad_words_token_ids or []:
        if len(word) - 1 <= len(output) and (len(word) == 1 or output[-(len(word) - 1):] == word[:-1]):
            x[word[-1]] = -math.inf
    if len(output) < params.min_tokens:
        for t in params.stop_token_ids + ([] if params.ignore_eos else [EOS]):
            x[t] = -math.inf
    r = params.repetition_penalty
    for t in set(PROMPT) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    if allowed is not None and all(v == -math.inf for v in x):
        x = masked
    return torch.tensor(x, dtype=torch.float64)


def reference_probs(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """vLLM V1's sampling distribution in float64: temperature, min_p over the whole vocabulary,
    top_k, then the smallest head reaching top_p among what is left, renormalised."""
    x = z.double() / params.temperature
    probs = x.softmax(-1)
    kept = [t for t in range(len(x)) if probs[t] > 0 and probs[t] >= params.min_p * probs.max()]
    kept.sort(key=lambda t: -float(x[t]))
    if 0 < params.top_k < len(x):
        kept = kept[: params.top_k]
    if params.top_p < 1.0:
        head, mass = [], 0.0
        for t, m in zip(kept, x[kept].softmax(-1).tolist()):
            if mass >= params.top_p:
                break
            head.append(t)
            mass += m
        kept = head
    out = torch.zeros(len(x), dtype=torch.float64)
    out[kept] = x[kept].softmax(-1)
    return out


# -- sequences -----------------------------------------------------------------------


class AllowOnly:
    """A grammar that allows a fixed set of tokens (none at bit 31 of a word: int32's sign)."""

    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor(words, dtype=torch.int32)


@dataclass
class Row:
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    allowed: list[int] | None = None  # a grammar's tokens
    forced: int | None = None

    def seq(self, device: str = "cpu") -> Sequence:
        """A fresh sequence: a seeded one starts its own generator anew."""
        p = self.params
        gen = None if p.seed is None else torch.Generator(device).manual_seed(p.seed)
        seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=PROMPT + self.output,
                       num_prompt_tokens=len(PROMPT), params=p, arrival_time=0.0,
                       eos_token_ids=frozenset({EOS}), generator=gen)
        seq.grammar = None if self.allowed is None else AllowOnly(self.allowed)
        seq.reasoning = None if self.forced is None else SimpleNamespace(forced=[self.forced])
        return seq

    @property
    def batch_invariant(self) -> bool:
        """Seeded, greedy or forced: the same tokens whatever shares the batch."""
        return self.params.seed is not None or self.params.greedy or self.forced is not None


SP = SamplingParams
MIXED = [
    Row(SP(temperature=0.0)),
    Row(SP(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3, logprobs=3),
        output=[4, 4, 9]),
    Row(SP(temperature=0.8, top_k=5, seed=11)),
    Row(SP(temperature=1.2, top_p=0.8, seed=12, logprobs=2), output=[1]),
    Row(SP(min_p=0.1, repetition_penalty=0.8, seed=13), output=[5, 6]),
    Row(SP(top_k=3)),  # unseeded: draws from the sampler's shared generator
    Row(SP(temperature=0.0, min_tokens=4, stop_token_ids=[STOP]), output=[2]),  # STOP and EOS lead
    Row(SP(seed=14, logprobs=2, frequency_penalty=1.0), output=[5], allowed=[2, 5, 33]),
    Row(SP(seed=15, logprobs=1), forced=21),
    Row(SP(temperature=0.0, min_tokens=3), allowed=[EOS]),  # min_tokens bans the grammar's only token
    Row(SP(temperature=0.0, top_p=0.5, seed=16)),
    Row(SP(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05, presence_penalty=-1.0, seed=17, logprobs=0),
        output=[8, 8, 8]),
    Row(SP(temperature=0.0, allowed_token_ids=[5, 17, 33, 38], repetition_penalty=1.4, logprobs=2), output=[17]),
    Row(SP(seed=18, allowed_token_ids=[2, 9, 21, 30], logprobs=1), output=[9]),
    # bans 11 anywhere and 13 after 7 (the output's end), not 14 (after 8): the three lead the logits
    Row(SP(temperature=0.0, bad_words_token_ids=[[11], [7, 13], [8, 14]], logprobs=1), output=[2, 7]),
]
BAD_WORDS_ROW = 14


def mixed_logits() -> torch.Tensor:
    z = torch.randn(len(MIXED), V, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    z[6, STOP], z[6, EOS] = z[6].max() + 2, z[6].max() + 1
    top = z[BAD_WORDS_ROW].max()
    z[BAD_WORDS_ROW, 11], z[BAD_WORDS_ROW, 13], z[BAD_WORDS_ROW, 14] = top + 3, top + 2, top + 1
    return z.float()


def sample(rows: list[Row], z: torch.Tensor, steps: int = 1, device: str = "cpu", sampler: Sampler | None = None):
    """Each step's results for `rows` sampled together, `steps` times with the same sequences."""
    sampler = sampler or Sampler(0)
    seqs = [row.seq(device) for row in rows]
    return [sampler(z.to(device), seqs) for _ in range(steps)]


# -- the tests -----------------------------------------------------------------------


def test_each_row_of_a_mixed_batch_gives_what_it_gives_alone() -> None:
    z = mixed_logits()
    together = sample(MIXED, z, steps=3)
    for i, row in enumerate(MIXED):
        if row.batch_invariant:
            alone = sample([row], z[i : i + 1], steps=3)
            assert [step[i] for step in together] == [step[0] for step in alone], f"row {i}"


# how top_p's nucleus is found: every row sorted whole; looked for among each row's 4 or 16 likeliest
# tokens first (rows whose nucleus is longer sorted whole); or the CPU's native kernel (no sort)
NUCLEUS = ["sorted", "head-4", "head-16", "native"]


def nucleus_sampler(how: str) -> Sampler:
    if how == "native":
        native = kernels.native_kernels()
        if native is None:
            pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
        return Sampler(0, keep_nucleus=native.keep_nucleus, argmax=native.argmax)
    return Sampler(0, None if how == "sorted" else int(how.split("-")[1]))


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: a row's tokens by descending probability (ties by token id) in float64, each kept
    while the mass before it is at most top_p."""
    p = probs.double()
    ordered, order = (-p).sort(stable=True)  # likeliest first; a stable sort keeps tied tokens in id order
    before = (-ordered).cumsum(0) + ordered
    return torch.zeros_like(p, dtype=torch.bool).scatter_(0, order, before <= top_p)


@pytest.mark.parametrize("nucleus", NUCLEUS)
def test_a_mixed_batch_follows_the_reference(nucleus: str) -> None:
    z = mixed_logits()
    for i, (row, (token, lp)) in enumerate(zip(MIXED, sample(MIXED, z, sampler=nucleus_sampler(nucleus))[0])):
        ref = reference_logits(z[i], row.params, row.output, row.allowed)
        if row.forced is not None:
            assert token == row.forced
        elif row.params.greedy:
            assert token == int(ref.argmax()), f"row {i}"
        else:
            assert reference_probs(ref, row.params)[token] > 0, f"row {i}: {token} is filtered out"
        if row.params.logprobs is None:
            assert lp is None
            continue
        raw = reference_logits(z[i], SP(), [], row.allowed).log_softmax(-1)  # before penalties, after the mask
        top = raw.topk(row.params.logprobs)
        assert lp.token_id == token and lp.logprob == pytest.approx(float(raw[token]), abs=1e-5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert sample(MIXED, z)[0][6][0] not in (STOP, EOS) and sample(MIXED, z)[0][9][0] == EOS
    assert sample(MIXED, z)[0][BAD_WORDS_ROW][0] == 14


@pytest.mark.parametrize("argmax", ["torch", "native"])
def test_greedy_is_the_argmax_of_the_penalised_logits(argmax: str) -> None:
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(64, V, generator=gen) * 3
    rows = []
    for i in range(len(z)):
        pick = torch.rand(5, generator=gen).tolist()
        best = int(z[i].argmax())  # banned by min_tokens, or generated (penalised) in some rows
        output = torch.randint(0, V, (int(pick[4] * 12),), generator=gen).tolist() + [best] * (pick[4] > 0.5)
        rows.append(Row(SP(temperature=0.0, repetition_penalty=0.5 + 1.5 * pick[0], presence_penalty=pick[1] - 0.5,
                           frequency_penalty=pick[2] - 0.5, min_tokens=20 if pick[3] < 0.3 else 0,
                           stop_token_ids=[best]), output=output))
    tokens = [t for t, _ in sample(rows, z, sampler=Sampler(0) if argmax == "torch" else nucleus_sampler("native"))[0]]
    assert tokens == [int(reference_logits(z[i], r.params, r.output).argmax()) for i, r in enumerate(rows)]
    assert sum(t != int(z[i].argmax()) for i, t in enumerate(tokens)) >= 16  # the penalties changed many


def filter_logits() -> torch.Tensor:
    """Distinct logits, not in token order: each of the ten most likely tokens has 3% or more."""
    order = torch.randperm(V, generator=torch.Generator().manual_seed(2))
    return torch.linspace(3.0, -4.0, V)[order]


def filter_cases() -> dict[str, SamplingParams]:
    z = filter_logits().double()
    probs = z.softmax(-1)
    min_p = min_p_keeping(probs, 10)
    # min_p keeps 10, top_k 7 of them; top_p counts its mass among those 7, and keeps 4
    left = reference_probs(z, SP(min_p=min_p, top_k=7))
    # without top_k, top_p counts its mass among the 10 min_p kept, and keeps 5
    after_min_p = reference_probs(z, SP(min_p=min_p))
    return {"top_k": SP(top_k=6), "top_p": SP(top_p=top_p_keeping(probs, 8)),
            "min_p": SP(min_p=min_p_keeping(probs, 9)),
            "min_p_then_top_p": SP(min_p=min_p, top_p=top_p_keeping(after_min_p, 5)),
            "all_three": SP(min_p=min_p, top_k=7, top_p=top_p_keeping(left, 4)),
            "hot_all_three": SP(temperature=1.6, min_p=0.2, top_k=12, top_p=0.7)}


@pytest.mark.parametrize("nucleus", NUCLEUS)
@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "min_p_then_top_p", "all_three", "hot_all_three"])
def test_filters_keep_exactly_the_reference_tokens(case: str, nucleus: str) -> None:
    """Unseeded rows, one shared draw: the sampled tokens are the reference's, in its proportions."""
    params, z = filter_cases()[case], filter_logits()
    ref = reference_probs(z, params)
    allowed = set(ref.nonzero().flatten().tolist())
    assert 4 <= len(allowed) <= 12 and ref[list(allowed)].min() > 0.02
    n = 3000
    tokens = [t for t, _ in sample([Row(params)] * n, z.expand(n, V), sampler=nucleus_sampler(nucleus))[0]]
    counts = torch.bincount(torch.tensor(tokens), minlength=V)
    assert set(tokens) == allowed
    assert chi_square_p(counts, ref) > P_MIN


def test_the_nucleus_kernel_keeps_what_a_float64_sort_keeps() -> None:
    """Rows of a 150k vocabulary (flat, peaked, with ties, zeros and a min_p-style cut), each at its
    own top_p, against the sort written out above; the kernel sorts no row, and a row's result is
    the same alone."""
    native = kernels.native_kernels()
    if native is None:
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    gen = torch.Generator().manual_seed(5)
    vocab = 151_936
    logits = [torch.randn(vocab, generator=gen) * scale for scale in (0.5, 2.0, 4.0, 8.0)]
    tied = torch.randn(vocab, generator=gen).mul(4).round()  # many tokens share each value
    cut = torch.randn(vocab, generator=gen) * 3
    cut[cut < 2.0] = -math.inf  # zeros, as min_p or top_k leave
    probs = torch.stack([z.softmax(-1) for z in logits + [tied, cut]])
    top_p = torch.tensor([0.95, 0.9, 0.5, 0.99, 0.7, 0.8])
    kept = native.keep_nucleus(probs.clone(), top_p) > 0
    for row in range(len(probs)):
        want = sorted_nucleus(probs[row], float(top_p[row]))
        assert torch.equal(kept[row], want & (probs[row] > 0)), f"row {row}: {kept[row].sum()} vs {want.sum()}"
        alone = native.keep_nucleus(probs[row : row + 1].clone(), top_p[row : row + 1])
        assert torch.equal(alone[0] > 0, kept[row])
    assert 1 < int(kept[4].sum()) < int((probs[4] >= probs[4][kept[4]].min()).sum())  # the edge splits a tie
    exact = native.keep_nucleus(torch.tensor([[0.125, 0.5, 0.125, 0.25]]), torch.tensor([0.75]))
    assert exact.tolist() == [[0.125, 0.5, 0.0, 0.25]]  # mass before exactly top_p: kept; the tie by id
    off = native.keep_nucleus(probs.clone(), torch.tensor([1.0, math.inf] * 3))
    assert torch.equal(off, probs)  # top_p 1 (or off) keeps every token


def test_the_argmax_kernel_is_torchs() -> None:
    """The first of equal maxima, the first NaN before any number, index 0 for a row of -inf, rows of
    every length around the 8-lane vector and a 150k vocabulary, strided rows."""
    native = kernels.native_kernels()
    if native is None:
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    gen = torch.Generator().manual_seed(6)
    for vocab in (1, 7, 8, 9, 16, 17, 151_936):
        x = torch.randn(8, vocab, generator=gen)
        x[1] = -math.inf
        x[2] = 0.5  # all equal
        x[3, vocab // 3], x[3, -1] = 9.0, 9.0  # a tie at the top
        x[4, vocab // 2], x[4, -1] = math.nan, math.nan
        x[5, -1] = math.inf
        assert torch.equal(native.argmax(x), x.argmax(-1)), vocab
    wide = torch.randn(5, 300, generator=gen)
    assert torch.equal(native.argmax(wide[:, :257]), wide[:, :257].argmax(-1))  # rows 300 apart


def test_the_cpu_samples_on_its_kernels_and_a_gpu_on_torch() -> None:
    from ladle.platform.cpu import CpuPlatform
    from ladle.platform.cuda import CudaPlatform

    native = kernels.native_kernels()
    assert CpuPlatform().nucleus_kernel == (native.keep_nucleus if native is not None else None)
    assert CpuPlatform().argmax_kernel == (native.argmax if native is not None else None)
    assert CudaPlatform.nucleus_kernel.fget(None) is None and CudaPlatform.top_p_head is None
    assert CudaPlatform.argmax_kernel.fget(None) is None


def test_seeded_rows_draw_the_reference_distribution() -> None:
    """40 seeded rows with penalties and filters beside an unseeded neighbour, drawn 50 times each."""
    params = [SP(temperature=0.9, top_k=9, repetition_penalty=1.3, presence_penalty=0.4, seed=s) for s in range(40)]
    rows, output = [Row(p, output=[0, 0, 1]) for p in params], [0, 0, 1]
    z = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5
    ref = reference_probs(reference_logits(z, params[0], output), params[0])
    steps = sample(rows + [Row(SP())], torch.stack([z] * len(rows) + [z.flip(0)]), steps=50)
    tokens = torch.tensor([[step[i][0] for step in steps] for i in range(len(rows))])
    assert chi_square_p(torch.bincount(tokens.flatten(), minlength=V), ref) > P_MIN
    alone = sample([rows[7]], z[None], steps=50)
    assert [step[0][0] for step in alone] == tokens[7].tolist()  # the seed alone decides


def test_module_functions_match_log_softmax() -> None:
    z = torch.randn(V, generator=torch.Generator().manual_seed(4))
    logprobs, ref = torch.log_softmax(z, -1), torch.log_softmax(z.double(), -1)
    lp = token_logprob(logprobs, 17, 4)
    assert lp.token_id == 17 and lp.logprob == pytest.approx(float(ref[17]), abs=1e-6)
    assert [t for t, _ in lp.top] == ref.topk(4).indices.tolist() and top_logprobs(logprobs, 4) == lp.top
    assert top_logprobs(logprobs, 0) == []


def test_an_empty_batch_samples_nothing() -> None:
    assert Sampler()(torch.empty(0, V), []) == []


@pytest.mark.cuda
def test_cuda_batch_waits_on_the_device_once() -> None:
    """On CUDA logits: one synchronizing operation per call (the results' copy); greedy and forced
    rows as on the CPU; a seeded row reproducible on its own generator whatever shares the batch."""
    z = mixed_logits()
    on_gpu = z.cuda()
    sampler = Sampler(0)
    sample(MIXED, on_gpu, device="cuda", sampler=sampler)  # warm up (the shared generator, the allocator)
    seqs = [row.seq("cuda") for row in MIXED]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            results = sampler(on_gpu, seqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, syncs
    cpu = sample(MIXED, z)[0]
    for i, row in enumerate(MIXED):
        if row.params.greedy or row.forced is not None:
            assert results[i][0] == cpu[i][0], f"row {i}"
        if row.params.logprobs is not None:
            raw = reference_logits(z[i], SP(), [], row.allowed).log_softmax(-1)
            assert results[i][1].logprob == pytest.approx(float(raw[results[i][0]]), abs=1e-5)
        if row.batch_invariant:
            alone = sample([row], on_gpu[i : i + 1], steps=3, device="cuda")
            together = sample(MIXED, on_gpu, steps=3, device="cuda")
            assert [s[0] for s in alone] == [s[i] for s in together], f"row {i}"
