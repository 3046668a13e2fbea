"""What each sampling field does, measured against an independent reference.

A tiny random Llama with a 64-token vocabulary gives many samples per token; transformers
computes its next-token logits in float64, and the reference below applies vLLM's V1
sampler to them, written out plainly. Seeds are fixed, so every test is deterministic;
the statistical bounds only say how far a correct sampler may drift from the reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from conftest import VOCAB, Tiny  # the tiny 64-token model (fixture `tiny`)
from sampling_refs import chi_square_p, min_p_keeping, top_p_keeping
from server_utils import MODEL, Server, own_server

from ladle import LLM, SamplingParams
from ladle.config import EngineConfig

PROMPT = [t for t in range(17, VOCAB) if t % 3]  # 31 distinct printable tokens: repetition penalty has much to act on
P_MIN = 1e-4  # chi-square p-value floor: a correct sampler fails it once in 10,000 seeds


@pytest.fixture(scope="module")
def llm(tiny: Tiny) -> LLM:
    return LLM(str(tiny[0]), dtype="float32", max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=1100)


@pytest.fixture(scope="module")
def tiny_server(tiny: Tiny) -> Iterator[Server]:
    with own_server(EngineConfig(model=str(tiny[0]), dtype="float32", max_num_seqs=256,
                                 max_num_batched_tokens=4096, num_kv_blocks=600)) as s:
        yield s


# -- the reference -----------------------------------------------------------------


def ref_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """float64 logits [len(ids), VOCAB]: row i predicts the token after ids[: i + 1]."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].double()


def vllm_probs(z: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0) -> torch.Tensor:
    """vLLM V1's sampling distribution: temperature, then min_p on the full distribution,
    then top_k, then top_p over what is left (renormalised)."""
    x = z / temperature
    if min_p > 0.0:
        p = x.softmax(-1)
        x = x.masked_fill(p < min_p * p.max(), float("-inf"))
    if top_k > 0:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        p, order = x.softmax(-1).sort(descending=True)
        x[order[p.cumsum(-1) - p >= top_p]] = float("-inf")  # keep the smallest head reaching top_p
    return x.softmax(-1)


def vllm_penalised(z: torch.Tensor, prompt: list[int], output: list[int], repetition_penalty: float = 1.0,
                   presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> torch.Tensor:
    """vLLM's penalties: a token seen in the prompt or the output has its logit divided by
    repetition_penalty if positive, multiplied if not; a token generated c times loses
    c * frequency_penalty, and presence_penalty once."""
    z = z.clone()
    seen = sorted(set(prompt) | set(output))
    z[seen] = torch.where(z[seen] > 0, z[seen] / repetition_penalty, z[seen] * repetition_penalty)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(z)).double()
    return z - frequency_penalty * counts - presence_penalty * (counts > 0)


def first_token_counts(llm: LLM, n: int, **params: float) -> torch.Tensor:
    """How often each token came first in n seeded samples of PROMPT's continuation."""
    res = llm.generate([PROMPT], SamplingParams(n=n, seed=1234, max_tokens=1, ignore_eos=True, **params))[0]
    return torch.bincount(torch.tensor([o.token_ids[0] for o in res.outputs]), minlength=VOCAB)


# -- temperature -------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_temperature_samples_softmax_of_scaled_logits(tiny: Tiny, llm: LLM, temperature: float) -> None:
    z = ref_logits(tiny[1], PROMPT)[-1]
    counts = first_token_counts(llm, 3000, temperature=temperature)
    assert chi_square_p(counts, torch.softmax(z / temperature, -1)) > P_MIN


# -- top_k, top_p, min_p -----------------------------------------------------------


HOT = 1.5  # filters are tested at a high temperature: mass spreads over many tokens


def filter_cases(z: torch.Tensor) -> dict[str, dict[str, float]]:
    probs = torch.softmax(z / HOT, -1)
    min_p = min_p_keeping(probs, 7)
    # min_p keeps 7, top_k 10: vLLM computes top_p over the 7 min_p left, and keeps 5 of them
    kept = vllm_probs(z, HOT, top_k=10, min_p=min_p)
    return {
        "top_k": dict(top_k=6),
        "top_p": dict(top_p=top_p_keeping(probs, 9)),
        "min_p": dict(min_p=min_p_keeping(probs, 11)),
        "all_three": dict(top_k=10, min_p=min_p, top_p=top_p_keeping(kept, 5)),
    }


@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "all_three"])
def test_filters_keep_exactly_the_allowed_tokens(tiny: Tiny, llm: LLM, case: str) -> None:
    z = ref_logits(tiny[1], PROMPT)[-1]
    params = filter_cases(z)[case]
    ref = vllm_probs(z, HOT, **params)
    allowed = set(ref.nonzero().flatten().tolist())
    assert 5 <= len(allowed) <= 11 and ref[list(allowed)].min() > 0.03  # each expected 45+ times in 1500
    counts = first_token_counts(llm, 1500, temperature=HOT, **params)
    sampled = set(counts.nonzero().flatten().tolist())
    assert sampled - allowed == set(), f"filtered-out tokens sampled: {sampled - allowed}"
    assert allowed - sampled == set(), f"allowed tokens never sampled: {allowed - sampled}"
    assert chi_square_p(counts, ref) > P_MIN  # and in the reference's proportions


# -- penalties, through the server ---------------------------------------------------
#
# ladle's logprobs are the raw model's, before penalties and temperature (vLLM's default
# logprobs_mode, raw_logprobs), so they cannot show a penalty. What is checked instead is
# what gets sampled: the distribution of the first token, and every greedy choice along a
# generation, against the penalised float64 reference logits.


def complete(server: Server, **body: Any) -> dict:
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def token_ids(tiny: Tiny) -> dict[str, int]:
    """Token name (as logprobs show it) -> id; the 64 names are distinct."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny[0] / "tokenizer.json"))
    names = {tok.decode([i], skip_special_tokens=False): i for i in range(VOCAB)}
    assert len(names) == VOCAB
    return names


def tokens_of(choice: dict, token_ids: dict[str, int]) -> list[int]:
    return [token_ids[name] for name in choice["logprobs"]["tokens"]]


def test_repetition_penalty_reshapes_the_distribution(tiny: Tiny, tiny_server: Server,
                                                      token_ids: dict[str, int]) -> None:
    """r = 3 at temperature 2: seen tokens with positive logits lose mass (divided), those with
    negative logits lose it too (multiplied): dropping either branch, or the penalty, fails."""
    r, temperature = 3.0, 2.0
    z = ref_logits(tiny[1], PROMPT)[-1]
    assert (z[PROMPT] > 0).sum() >= 8 and (z[PROMPT] < 0).sum() >= 8
    body = dict(max_tokens=1, n=128, temperature=temperature, repetition_penalty=r, logprobs=0)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda i: complete(tiny_server, seed=128 * i, **body), range(16)))
    choices = [c for resp in responses for c in resp["choices"]]
    tokens = torch.tensor([tokens_of(c, token_ids)[0] for c in choices])
    expected = torch.softmax(vllm_penalised(z, PROMPT, [], repetition_penalty=r) / temperature, -1)
    assert chi_square_p(torch.bincount(tokens, minlength=VOCAB), expected) > P_MIN
    # the reported logprobs are the raw model's: the penalty does not show in them
    raw = torch.log_softmax(z, -1)
    reported = torch.tensor([c["logprobs"]["token_logprobs"][0] for c in choices], dtype=torch.float64)
    assert torch.allclose(reported, raw[tokens], atol=1e-4)


@pytest.mark.parametrize("penalty", [
    dict(repetition_penalty=1.5), dict(repetition_penalty=0.7),
    dict(presence_penalty=1.0), dict(presence_penalty=-1.0),
    dict(frequency_penalty=0.5), dict(frequency_penalty=-0.5),
    dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
], ids=lambda p: ",".join(f"{k.split('_')[0]}={v}" for k, v in p.items()))
def test_penalised_greedy_choices_follow_the_formula(tiny: Tiny, tiny_server: Server, token_ids: dict[str, int],
                                                     penalty: dict[str, float]) -> None:
    """Every greedy choice is the argmax of the reference logits, given what came before,
    penalised by vLLM's formula; and the penalty changed several choices."""
    choice = complete(tiny_server, max_tokens=24, temperature=0.0, logprobs=0, **penalty)["choices"][0]
    out = tokens_of(choice, token_ids)
    assert len(out) == 24
    z = ref_logits(tiny[1], PROMPT + out)[len(PROMPT) - 1 :]
    changed = 0
    for k, token in enumerate(out):
        scores = vllm_penalised(z[k], PROMPT, out[:k], **penalty)
        assert scores[token] >= scores.max() - 1e-4, f"step {k}: chose {token}, formula says {int(scores.argmax())}"
        changed += int(scores.argmax() != z[k].argmax())
    assert changed >= 2
