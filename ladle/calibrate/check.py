"""`ladle calibrate check`: the replay and option-order tests, as one command, over HTTP.

Replay: the labelled set is scored once cold (the reference pass), then again warm, alone
(one request at a time), batched (all at once) and mixed (while streaming chat requests
decode in the background), `repeats` times; each pass is compared with the reference.
Order: a sample is scored under every cyclic order of the options, to show how far the
answers move with position alone and to estimate the position (letter) prior.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from ladle.calibrate import methods
from ladle.calibrate.client import Scored, option_names, read_labelled, score_all, score_permuted

CONDITIONS = ("warm", "alone", "batched", "mixed")
CHAT_STREAMS = 4
CHAT_MAX_TOKENS = 256
CHAT_PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a map.",
    "Explain, step by step and at length, how a bicycle gear works.",
    "Describe a busy market in a coastal town, stall by stall.",
    "Write a long letter from a gardener to her neighbour about the seasons.",
)


@dataclass
class Comparison:
    """One pass against the reference pass."""

    max_abs_dp: float
    max_abs_dlabel_mass: float | None  # None when the server reports no label mass
    choice_flips: int

    def to_json(self) -> dict[str, Any]:
        return {"max_abs_dp": self.max_abs_dp, "max_abs_dlabel_mass": self.max_abs_dlabel_mass,
                "choice_flips": self.choice_flips}


def compare(reference: Scored, other: Scored) -> Comparison:
    """Largest |Δp| over all examples and options, largest |Δ label_mass|, and how many examples
    choose another option (argmax) than in the reference."""
    if reference.probs.shape != other.probs.shape:
        raise ValueError(f"passes differ in shape: {reference.probs.shape} and {other.probs.shape}")
    dp = float(np.max(np.abs(other.probs - reference.probs), initial=0.0))
    dmass = np.abs(other.label_mass - reference.label_mass)
    flips = int(np.sum(other.probs.argmax(axis=1) != reference.probs.argmax(axis=1)))
    return Comparison(dp, float(np.nanmax(dmass)) if np.isfinite(dmass).any() else None, flips)


def summarise(passes: list[Comparison]) -> dict[str, Any]:
    """A condition's passes together: the worst deltas, and the flips of all passes added up."""
    masses = [c.max_abs_dlabel_mass for c in passes if c.max_abs_dlabel_mass is not None]
    return {
        "passes": len(passes),
        "max_abs_dp": max(c.max_abs_dp for c in passes),
        "max_abs_dlabel_mass": max(masses) if masses else None,
        "choice_flips": sum(c.choice_flips for c in passes),
        "per_pass": [c.to_json() for c in passes],
    }


def order_summary(permuted: list[np.ndarray], permutations: list[list[int]]) -> dict[str, Any]:
    """permuted: per example [n_perm, k] position probabilities, row r shown in order permutations[r]
    (position i shows option permutations[r][i]), as client.score_permuted returns them."""
    tv, changed, chosen_positions = [], 0, []
    for positions in permuted:
        original = np.empty_like(positions)
        for r, perm in enumerate(permutations):
            original[r, perm] = positions[r]
        # the worst pair of orders: half the L1 distance between their answers
        tv.append(float(0.5 * np.abs(original[:, None] - original[None]).sum(-1).max()))
        changed += len(set(original.argmax(axis=1).tolist())) > 1
        chosen_positions += positions.argmax(axis=1).tolist()
    k = len(permutations[0])
    return {
        "n_examples": len(permuted), "permutations": [list(p) for p in permutations],
        "tv_mean": float(np.mean(tv)), "tv_max": float(np.max(tv)),
        "choice_change_fraction": changed / len(permuted),
        "position_prior": [float(p) for p in methods.fit("pride", permuted, permutations).prior],
        "chosen_position_share": (np.bincount(chosen_positions, minlength=k) / len(chosen_positions)).tolist(),
    }


@dataclass
class ChatTraffic:
    """Streaming chat completions kept in flight in the background, so that decisions share the
    server's batches with decode steps; a stream that ends is replaced until the block ends."""

    base_url: str
    model: str | None
    streams: int = CHAT_STREAMS
    max_tokens: int = CHAT_MAX_TOKENS
    chunks: int = 0  # streamed chunks received so far
    _decoding: int = 0
    _all_decoding: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> ChatTraffic:
        """Returns once every stream has sent its first token, i.e. is decoding."""
        self._client = httpx.AsyncClient(base_url=self.base_url.rstrip("/").removesuffix("/v1"), timeout=300)
        self._tasks = [asyncio.create_task(self._stream(i)) for i in range(self.streams)]
        waiter = asyncio.create_task(self._all_decoding.wait())
        await asyncio.wait([waiter, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if any(task.done() for task in self._tasks):  # a stream only ends by failing
            await self.__aexit__()  # raises its error
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
        for r in results:
            if isinstance(r, Exception):
                raise RuntimeError(f"background chat traffic failed: {r}") from r

    async def _stream(self, i: int) -> None:
        first = True
        while True:
            body = {"messages": [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
                    "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True,
                    **({"model": self.model} if self.model else {})}
            async with self._client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"/v1/chat/completions answered {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        self.chunks += 1
                        if first:
                            first = False
                            self._decoding += 1
                            if self._decoding == self.streams:
                                self._all_decoding.set()


async def replay(base_url: str, model: str | None, question: dict[str, Any], inputs: list[Any],
                 repeats: int, concurrency: int) -> tuple[Scored, dict[str, Any]]:
    """The reference (cold) pass and, per condition, its passes compared with it."""
    in_flight = {"warm": concurrency, "alone": 1, "batched": len(inputs), "mixed": concurrency}
    reference = await score_all(base_url, model, question, inputs, concurrency, "cold (reference)")
    passes: dict[str, list[Comparison]] = {c: [] for c in CONDITIONS}
    chat_chunks = []
    for r in range(1, repeats + 1):
        for condition in CONDITIONS:
            n, desc = in_flight[condition], f"{condition} {r}/{repeats}"
            if condition == "mixed":
                async with ChatTraffic(base_url, model) as traffic:
                    seen = traffic.chunks
                    scored = await score_all(base_url, model, question, inputs, n, desc)
                    chat_chunks.append(traffic.chunks - seen)
            else:
                scored = await score_all(base_url, model, question, inputs, n, desc)
            passes[condition].append(compare(reference, scored))
    conditions = {c: {**summarise(p), "concurrency": in_flight[c]} for c, p in passes.items()}
    conditions["mixed"].update(chat_streams=CHAT_STREAMS, chat_max_tokens=CHAT_MAX_TOKENS,
                               chat_chunks_while_scoring=chat_chunks)
    return reference, conditions


async def check(base_url: str, model: str | None, question: dict[str, Any], inputs: list[Any], repeats: int = 2,
                concurrency: int = 8, order_sample: int = 24) -> dict[str, Any]:
    """The whole check as a JSON-ready report (no verdict: see failures())."""
    if not inputs or repeats < 1 or concurrency < 1:
        raise ValueError("check needs at least one example, one repeat and a concurrency of at least 1")
    reference, conditions = await replay(base_url, model, question, inputs, repeats, concurrency)
    order = None
    if question["type"] != "yes_no" and order_sample > 0:  # a yes/no question has no option order to change
        perms = methods.cyclic_permutations(len(option_names(question)))
        sample = inputs[:order_sample]
        order = order_summary(await score_permuted(base_url, model, question, sample, perms, concurrency), perms)
    return {"model": reference.model, "question_id": question["id"], "options": option_names(question),
            "prompt_format_version": reference.prompt_format_version, "n_examples": len(inputs),
            "repeats": repeats, "reference": "cold", "replay": conditions, "order": order}


def failures(report: dict[str, Any], max_delta: float = 0.0) -> list[str]:
    """Why the replay part fails: any choice flip, or a |Δp| above max_delta."""
    out = []
    for name, c in report["replay"].items():
        if c["choice_flips"]:
            out.append(f"{name}: {c['choice_flips']} choice flips")
        if c["max_abs_dp"] > max_delta:
            out.append(f"{name}: max |Δp| {c['max_abs_dp']:.3g} > {max_delta:g}")
    return out


def run(args: argparse.Namespace) -> int:
    question = json.loads(args.question.read_text())
    data = read_labelled(args.data, question)
    inputs = data.inputs[: args.limit] if args.limit is not None else data.inputs
    print(f"{len(inputs)} examples; options {data.options}")
    report = asyncio.run(check(args.base_url, args.model, question, inputs, args.repeats, args.concurrency,
                               args.order_sample))
    report["max_delta"] = args.max_delta
    report["failures"] = failures(report, args.max_delta)
    if args.report_dir:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "check.json").write_text(json.dumps(report, indent=2) + "\n")
    _print(report, question["type"])
    return 1 if report["failures"] else 0


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _print(report: dict[str, Any], kind: str) -> None:
    print(f"replay: {report['n_examples']} examples, each pass against the cold one, {report['repeats']} repeats")
    print("  condition  passes  concurrency   max |Δp|  max |Δ label_mass|  choice flips")
    for name, c in report["replay"].items():
        print(f"  {name:9s} {c['passes']:7d} {c['concurrency']:12d} {_num(c['max_abs_dp']):>10s} "
              f"{_num(c['max_abs_dlabel_mass']):>19s} {c['choice_flips']:13d}")
    mixed = report["replay"]["mixed"]
    print(f"  (mixed: {mixed['chat_streams']} chat streams of {mixed['chat_max_tokens']} tokens; chunks streamed "
          f"while scoring, per pass: {mixed['chat_chunks_while_scoring']})")
    order = report["order"]
    if order is None:
        why = "a yes/no question has no option order" if kind == "yes_no" else "--order-sample 0"
        print(f"order: skipped ({why})")
    else:
        k = len(order["position_prior"])
        names = [chr(ord("A") + i) if kind == "choice" and k <= 26 else str(i + 1) for i in range(k)]
        print(f"order: {order['n_examples']} examples under {len(order['permutations'])} cyclic option orders")
        print(f"  total variation between orders (worst pair): mean {order['tv_mean']:.3f}, max {order['tv_max']:.3f}")
        print(f"  choice changes with the order: {order['choice_change_fraction']:.3f} of examples")
        for title, key in (("estimated position prior", "position_prior"),
                           ("chosen position share", "chosen_position_share")):
            print(f"  {title + ':':26s} " + "  ".join(f"{n} {p:.3f}" for n, p in zip(names, order[key])))
    if report["failures"]:
        print("replay FAILED: " + "; ".join(report["failures"]))
    else:
        print(f"replay OK (max |Δp| within {report['max_delta']:g}, no choice flips)")
