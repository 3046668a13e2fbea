"""Benchmark workloads: each dataset turns a DatasetSpec into a list of SampleRequest.

Token lengths are steered with the tokens-per-word figure of words.py (measured
on the target through /tokenize when it can); the prompt tokens that count in the
results are the ones the server reports.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ladle.bench.words import DEFAULT_TOKENS_PER_WORD, WORDS, estimate_tokens, random_text

DATASETS = ("random", "sharegpt", "prefix", "agent", "decisions", "trace")
AGENT_TOOLS = ("read_file", "run_tests", "search", "list_dir", "shell")


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # estimated tokens; the server's usage figure replaces it in the results
    output_len: int  # max_tokens (0 for a decision: it generates nothing)
    endpoint: str | None = None  # None: the run's endpoint
    body: dict[str, Any] | None = None  # a whole JSON body (decisions) instead of a prompt
    session_id: int | None = None  # turns of one agent session are sent in order, one at a time
    turn: int | None = None  # its index within the session
    think_time: float = 0.0  # seconds after the session's previous answer before it is sent (the tool's run)
    arrival: float | None = None  # seconds after the start, from a trace (None: the load's schedule)


@dataclass
class DatasetSpec:
    """Every dataset's knobs in one place; flag names follow `vllm bench serve` where it has them."""

    name: str = "random"
    path: str | None = None  # sharegpt JSON file, or a trace's JSONL
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    prefix_len: int = 512
    prefix_suffix_len: int = 128
    prefix_num_prefixes: int = 1
    prefix_output_len: int = 128
    agent_turns: int = 6
    agent_system_len: int = 1024
    agent_burst_len: int = 256
    agent_output_len: int = 64
    agent_think_time: float = 0.0  # mean seconds a tool call runs between turns (exponential, seeded)
    decisions_input_len: int = 256
    decisions_questions: int = 3
    decisions_options: int = 4
    trace_speedup: float = 1.0
    trace_block_len: int = 512  # tokens a trace's hash id stands for


def sample_requests(spec: DatasetSpec, n: int, seed: int,
                    tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> list[SampleRequest]:
    """`n` requests of dataset `spec.name`, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    tpw = tokens_per_word
    if spec.name == "random":
        return random_dataset(rng, n, spec.random_input_len, spec.random_output_len,
                              spec.random_range_ratio, spec.random_prefix_len, tpw)
    if spec.name == "sharegpt":
        if not spec.path:
            raise ValueError("the sharegpt dataset needs --dataset-path (a ShareGPT JSON file)")
        return sharegpt_dataset(rng, n, load_sharegpt(spec.path), spec.sharegpt_output_len)
    if spec.name == "prefix":
        return prefix_dataset(rng, n, spec.prefix_len, spec.prefix_suffix_len, spec.prefix_num_prefixes,
                              spec.prefix_output_len, tpw)
    if spec.name == "agent":
        return agent_dataset(rng, n, spec.agent_turns, spec.agent_system_len, spec.agent_burst_len,
                             spec.agent_output_len, tpw, spec.agent_think_time)
    if spec.name == "decisions":
        return decisions_dataset(rng, n, spec.decisions_input_len, spec.decisions_questions,
                                 spec.decisions_options, tpw)
    if spec.name == "trace":
        from ladle.bench.trace import trace_dataset

        if not spec.path:
            raise ValueError("the trace dataset needs --dataset-path (a JSONL trace)")
        return trace_dataset(rng, spec.path, n, spec.trace_speedup, spec.trace_block_len, tpw)
    raise ValueError(f"unknown dataset {spec.name!r}; choose one of {', '.join(DATASETS)}")


def _uniform_lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> np.ndarray:
    # as vLLM's random dataset: uniform integers in [mean*(1-ratio), mean*(1+ratio)]
    if not 0.0 <= ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    low, high = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return rng.integers(max(low, 1), max(high, 1) + 1, size=n)


def random_dataset(rng: np.random.Generator, n: int, input_len: int, output_len: int, range_ratio: float,
                   prefix_len: int, tokens_per_word: float) -> list[SampleRequest]:
    """Random-word prompts of controlled token length, optionally behind one shared random prefix."""
    prefix = random_text(rng, prefix_len, tokens_per_word)
    in_lens = _uniform_lengths(rng, n, input_len, range_ratio)
    out_lens = _uniform_lengths(rng, n, output_len, range_ratio)
    out = []
    for in_len, out_len in zip(in_lens, out_lens):
        body = random_text(rng, int(in_len), tokens_per_word)
        prompt = f"{prefix} {body}" if prefix else body
        out.append(SampleRequest(prompt=prompt, prompt_len=prefix_len + int(in_len), output_len=int(out_len)))
    return out


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with at least two turns."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of ShareGPT entries")
    pairs = []
    for entry in data:
        turns = (entry.get("conversations") or entry.get("conversation")) if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        texts = [t.get("value", t.get("content")) if isinstance(t, dict) else None for t in turns[:2]]
        if all(isinstance(t, str) for t in texts):
            pairs.append((texts[0], texts[1]))
    return pairs


def sharegpt_dataset(rng: np.random.Generator, n: int, pairs: list[tuple[str, str]],
                     output_len: int | None = None) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffle, keep 4 <= prompt <= 1024 tokens and prompt + reply <= 2048,
    the reply's length as max_tokens (unless `output_len`); repeat entries when the file is short."""
    out = []
    for i in rng.permutation(len(pairs)):
        if len(out) == n:
            break
        prompt, reply = pairs[i]
        prompt_len = estimate_tokens(prompt)
        out_len = output_len if output_len is not None else estimate_tokens(reply)
        if prompt_len < 4 or (output_len is None and out_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        out.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, output_len=out_len))
    if not out:
        raise ValueError("no usable ShareGPT conversation (need two turns, 4..1024 prompt tokens)")
    while len(out) < n:
        out.append(out[int(rng.integers(len(out)))])
    return out


def prefix_dataset(rng: np.random.Generator, n: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                   output_len: int, tokens_per_word: float) -> list[SampleRequest]:
    """A few shared system prompts, each request one of them plus its own tail (prefix-cache workload)."""
    prefixes = [f"System: {random_text(rng, prefix_len, tokens_per_word)}" for _ in range(max(num_prefixes, 1))]
    out = []
    for i in range(n):
        tail = random_text(rng, suffix_len, tokens_per_word)
        prompt = f"{prefixes[i % len(prefixes)]}\n\nUser: {tail}\n\nAssistant:"
        out.append(SampleRequest(prompt=prompt, prompt_len=prefix_len + suffix_len + 10, output_len=output_len))
    return [out[i] for i in rng.permutation(n)]


def agent_dataset(rng: np.random.Generator, n: int, turns: int, system_len: int, burst_len: int,
                  output_len: int, tokens_per_word: float, think_time: float = 0.0) -> list[SampleRequest]:
    """Multi-turn agent sessions: one shared system prompt, then each turn appends a tool call and a
    burst of 1..k tool results (lognormal sizes around `burst_len` tokens) to the previous turn's prompt.

    The assistant's own replies are stood in for by the tool-call text, so a turn's prompt extends the
    previous prompt exactly (what a prefix cache can reuse), whatever the server generated. Sessions are
    interleaved turn by turn; the runner sends a session's turns one after another, each its own
    `think_time` after the last answer: the tool calls' run times, exponentially distributed around the
    mean `think_time` (0: none) and drawn from `rng`, so a seed gives the same waits every run.
    """
    if think_time < 0:
        raise ValueError("--agent-think-time must be at least 0")
    turns = max(turns, 1)
    system = f"You are a coding agent. Tools: {', '.join(AGENT_TOOLS)}.\n{random_text(rng, system_len, tokens_per_word)}"
    system_tokens = system_len + 20
    sessions = []
    for s in range(math.ceil(n / turns)):
        task = random_text(rng, 48, tokens_per_word)
        prompt, tokens = f"{system}\n\nUser: {task}\n\nAssistant:", system_tokens + 48 + 8
        session = [SampleRequest(prompt=prompt, prompt_len=tokens, output_len=output_len, session_id=s, turn=0)]
        for turn in range(1, turns):
            for _call in range(1 + int(rng.poisson(0.5))):
                tool = AGENT_TOOLS[int(rng.integers(len(AGENT_TOOLS)))]
                arg = WORDS[int(rng.integers(len(WORDS)))]
                size = int(np.clip(rng.lognormal(math.log(max(burst_len, 1)), 0.8), 16, 8 * max(burst_len, 2)))
                call = f' <tool_call>{{"name": "{tool}", "arguments": {{"target": "{arg}"}}}}</tool_call>\n'
                result = f"<tool_result>\n{random_text(rng, size, tokens_per_word)}\n</tool_result>\n"
                prompt += call + result
                tokens += estimate_tokens(call) + size + 10
            prompt += "\nAssistant:"
            tokens += 3
            wait = float(rng.exponential(think_time)) if think_time > 0 else 0.0
            session.append(SampleRequest(prompt=prompt, prompt_len=tokens, output_len=output_len, session_id=s,
                                         turn=turn, think_time=wait))
        sessions.append(session)
    interleaved = [sess[t] for t in range(turns) for sess in sessions if t < len(sess)]
    return interleaved[:n]


def decisions_dataset(rng: np.random.Generator, n: int, input_len: int, num_questions: int, num_options: int,
                      tokens_per_word: float) -> list[SampleRequest]:
    """Typed-decision requests for POST /v1/decisions (choice, yes/no and score questions in turn)."""
    num_options = min(max(num_options, 2), 26)
    out = []
    for _ in range(n):
        text = random_text(rng, input_len, tokens_per_word)
        questions: list[dict[str, Any]] = []
        for q in range(max(num_questions, 1)):
            kind = ("choice", "yes_no", "score")[q % 3]
            if kind == "choice":
                names = rng.choice(len(WORDS), size=num_options, replace=False)
                questions.append({"id": f"q{q}", "type": "choice", "question": "Which word best sums up the text?",
                                  "options": [{"name": WORDS[int(i)]} for i in names]})
            elif kind == "yes_no":
                word = WORDS[int(rng.integers(len(WORDS)))]
                questions.append({"id": f"q{q}", "type": "yes_no", "question": f"The text mentions a {word}."})
            else:
                questions.append({"id": f"q{q}", "type": "score", "question": "How repetitive is the text?",
                                  "levels": ["not at all", "slightly", "quite", "very"]})
        body = {"input": text, "questions": questions}
        # each question repeats the input in its own rendered prompt
        prompt_len = len(questions) * (input_len + 40)
        out.append(SampleRequest(prompt=text, prompt_len=prompt_len, output_len=0, endpoint="/v1/decisions",
                                 body=body))
    return out
