"""Decision scoring and deterministic generation on SmolLM2, against transformers on the same folder.

The other scoring tests compare ladle with itself (bit-identical cold, cached, batched); these
check the numbers themselves: the label log-probabilities ladle reads for a rendered decision
prompt, and the tokens `deterministic=True` greedy decoding produces, against one plain
float32 transformers forward (and `generate`) over the very same token ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ladle import LLM, SamplingParams
from ladle.config import EngineConfig
from ladle.decisions.pipeline import prepare
from ladle.decisions.question import Option, Question
from ladle.decisions.render import template_kwargs

pytestmark = pytest.mark.isa  # results depend on the instruction set: make test-avx2 runs these again

# Absolute, on full-vocabulary log-probabilities (the labels', and the greedy tokens'). Measured on a
# 2-core AVX-512 CPU: labels at most 3.2e-5 with the native kernels and 1.1e-5 without (their values run
# from -4.3 to -0.75); greedy tokens 4.2e-5 and 1.7e-5. 2e-4 leaves 5x for other CPUs and BLAS builds
# and still sits 30x under the smallest deliberate error tried (rope_theta 1% off: 6e-3; RMSNorm eps
# 10x: 1.8e-2; a decode position off by one: 0.14; a softmax over the labels only: 3.4).
LOGPROB_TOL = 2e-4
NEW_TOKENS = 16
# The reference computes in float32; ladle's dtype "auto" may pick bfloat16 on this CPU, so pin it.

TICKET = ("Our nightly integration with the partner warehouse keeps failing. Since the upgrade on Monday the "
          "sync job times out after about ten minutes and orders stay stuck in 'pending export'. Finance says "
          "two invoices were generated twice for the same shipment. ")
QUESTIONS = [
    Question("team", "questions[0]", "choice", "Which team should handle this ticket?",
             [Option("billing", "payments and invoices"), Option("technical", "bugs and outages"), Option("sales")]),
    Question("severity", "questions[1]", "score", "How severe is the problem?",
             [Option("cosmetic"), Option("degraded"), Option("blocking"), Option("data loss")]),
    Question("urgent", "questions[2]", "yes_no", "The customer needs an answer today.",
             [Option("yes", "they say it is urgent"), Option("no")]),
    Question("topic", "questions[3]", "choice", "What is the main topic?",
             [Option("integration"), Option("invoices"), Option("pricing"), Option("access"), Option("hardware")]),
]
INPUTS = [TICKET, "Hi, I was charged twice for my order #1234. Please refund one of the payments.", TICKET * 4]

GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. The crew was " * 3,
]


class Reference:
    """transformers on the converted folder ladle loads, float32; results kept per prompt."""

    def __init__(self, folder: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self._labels: dict[tuple, list[float]] = {}
        self._greedy: dict[tuple, list[int]] = {}

    def label_logprobs(self, prompt_ids: list[int], label_ids: list[int]) -> list[float]:
        """One forward over the prompt; the labels' full-vocabulary log-probabilities at its last position."""
        key = (tuple(prompt_ids), tuple(label_ids))
        if key not in self._labels:
            with torch.no_grad():
                logits = self.model(torch.tensor([prompt_ids])).logits[0, -1]
            self._labels[key] = torch.log_softmax(logits.double(), dim=-1)[label_ids].tolist()
        return self._labels[key]

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V]: row i, the log-probabilities of the token after ids[: i + 1]."""
        with torch.no_grad():
            return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].double(), dim=-1)

    def greedy(self, prompt_ids: list[int]) -> list[int]:
        key = tuple(prompt_ids)
        if key not in self._greedy:
            ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
            self._greedy[key] = out[0, ids.shape[1]:].tolist()
        return self._greedy[key]


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> Reference:
    return Reference(smollm2_dir)


@pytest.fixture(scope="module")
def decision_prompts(smollm2_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, label ids) of every question over every input, rendered by ladle's decisions code."""
    from ladle.model.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(smollm2_dir)
    prompts = [(p.prompt_ids, p.label_ids) for text in INPUTS
               for p in prepare(tok, 8192, text, QUESTIONS, template_kwargs(None))]
    assert len({tuple(ids) for ids, _ in prompts}) == len(INPUTS) * len(QUESTIONS)
    assert all(len(labels) >= 2 for _, labels in prompts)
    return prompts


def label_gaps(llm: LLM, reference: Reference, prompts: list[tuple[list[int], list[int]]]) -> list[float]:
    """Score `prompts` through ladle in one batch; per prompt, the largest gap to transformers."""
    params = [SamplingParams(label_token_ids=labels) for _, labels in prompts]
    results = llm.generate([ids for ids, _ in prompts], params)
    gaps = []
    for (ids, labels), res in zip(prompts, results, strict=True):
        ours = res.outputs[0].label_logprobs
        assert res.prompt_token_ids == ids and len(ours) == len(labels)
        gaps.append(max(abs(a - b) for a, b in zip(ours, reference.label_logprobs(ids, labels), strict=True)))
    return gaps


def test_label_logprobs_match_transformers(smollm2_dir: Path, reference: Reference, decision_prompts,
                                           kernels: str) -> None:
    """The questions one at a time through one engine: after the first, its prefix cache serves the
    template head and the input they share; a 200-token budget splits the long
    prompts' prefill into chunks."""
    llm = LLM(str(smollm2_dir), kv_cache_memory_gib=0.5, max_num_batched_tokens=200, dtype="float32")
    assert max(len(ids) for ids, _ in decision_prompts) > 200
    gaps = [g for prompt in decision_prompts for g in label_gaps(llm, reference, [prompt])]
    assert llm.engine.kv.stats.hits > 0
    assert max(gaps) < LOGPROB_TOL, gaps


# 200: a sequence starting mid-block (shared in flight) may find less budget left than reaches
# the next block boundary; it then waits a step (a negative chunk once crashed the step here)
@pytest.mark.parametrize("budget", [512, 200])
def test_label_logprobs_batched_match_transformers(smollm2_dir: Path, reference: Reference, decision_prompts,
                                                   kernels: str, budget: int) -> None:
    """All questions over all inputs submitted at once: each input's questions share its prefix in flight."""
    llm = LLM(str(smollm2_dir), kv_cache_memory_gib=0.5, max_num_batched_tokens=budget, dtype="float32")
    gaps = label_gaps(llm, reference, decision_prompts)
    assert max(gaps) < LOGPROB_TOL, gaps


def test_deterministic_greedy_matches_transformers_generate(smollm2_dir: Path, reference: Reference,
                                                            kernels: str) -> None:
    """The prompts decode as one batch; tokens equal to `generate`'s, and each token's log-probability
    equal to a transformers forward over prompt and output (token equality alone shrugs off small errors)."""
    llm = LLM(str(smollm2_dir), deterministic=True, kv_cache_memory_gib=0.5, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    for prompt, res in zip(GREEDY_PROMPTS, llm.generate(GREEDY_PROMPTS, params), strict=True):
        out = res.outputs[0]
        assert out.token_ids == reference.greedy(res.prompt_token_ids), prompt
        ref = reference.logprobs(res.prompt_token_ids + out.token_ids)[len(res.prompt_token_ids) - 1 :]
        gaps = [abs(lp.logprob - float(row[lp.token_id])) for lp, row in zip(out.logprobs, ref)]
        assert len(gaps) == NEW_TOKENS and max(gaps) < LOGPROB_TOL, (prompt, gaps)


def test_a_budget_below_one_block_is_refused() -> None:
    """Scoring chunks end on block boundaries, so such a budget would never schedule them."""
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=8, block_size=16)
