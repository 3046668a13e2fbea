"""`ladle calibrate fit`: fit a calibration of a decision question's probabilities on labelled
examples, through any server's /v1/decisions, and report it on examples the fit never saw.
`ladle calibrate check`: the replay and option-order tests (check.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np

from ladle.calibrate import check, methods
from ladle.calibrate.client import Labelled, read_labelled, score_all, score_permuted
from ladle.calibrate.report import evaluate, label_mass_summary, reliability_png

METHODS = ("temperature", "platt", "vector", "isotonic", "contextual", "pride")
FORMAT = 1  # version of the calibration file's layout


def add_server_and_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every labelled-data command shares (calibrate fit and check, heads fit)."""
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's own)")
    parser.add_argument("--data", type=Path, required=True, help='JSONL, one {"input": ..., "label": ...} a line')
    parser.add_argument("--question", type=Path, required=True,
                        help="one question in the /v1/decisions shape (JSON)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="calibrate_command", metavar="{fit,check}", required=True)
    fit = sub.add_parser("fit", help="fit a calibration and report it on held-out examples")
    add_server_and_data_arguments(fit)
    fit.add_argument("--method", choices=METHODS, default="temperature",
                     help="temperature: one T, never changes the choice; platt: yes/no questions; vector: a "
                          "weight and a bias per option; isotonic: a monotone map per option; contextual: a "
                          "content-free input's probabilities divided out; pride: the option-position prior, "
                          "estimated under every cyclic option order, divided out")
    fit.add_argument("--out", type=Path, required=True, help="the calibration file to write (JSON)")
    fit.add_argument("--heldout", type=Path, default=None,
                     help="held-out JSONL (default: a seeded quarter of --data, never used for fitting)")
    fit.add_argument("--report-dir", type=Path, default=None, help="write report.json and reliability.png here")
    fit.add_argument("--seed", type=int, default=0,
                     help="seeds the split that holds out a quarter of --data (unused with --heldout)")
    fit.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    fit.add_argument("--content-free", default="N/A", help="the content-free input of --method contextual")
    fit.add_argument("--prior-sample", type=int, default=16,
                     help="examples scored under every cyclic option order for --method pride")

    chk = sub.add_parser("check", help="replay the labelled set (cold, warm, alone, batched, mixed with chat) "
                         "and shuffle the option order; exit 1 on any choice flip or |Δp| above --max-delta")
    add_server_and_data_arguments(chk)
    chk.add_argument("--limit", type=int, default=None, help="use only the first N examples")
    chk.add_argument("--repeats", type=int, default=2, help="passes per replay condition")
    chk.add_argument("--concurrency", type=int, default=8, help="requests in flight (cold, warm and mixed passes)")
    chk.add_argument("--order-sample", type=int, default=24,
                     help="examples scored under every cyclic option order (0: no order test)")
    chk.add_argument("--max-delta", type=float, default=0.0, help="largest |Δp| against the cold pass tolerated")
    chk.add_argument("--report-dir", type=Path, default=None, help="write check.json here")


def run(args: argparse.Namespace) -> int:
    if args.calibrate_command == "check":
        return check.run(args)
    return asyncio.run(_fit(args))


def split(data: Labelled, seed: int, heldout_fraction: float = 0.25) -> tuple[Labelled, Labelled]:
    order = np.random.default_rng(seed).permutation(len(data.inputs))
    cut = int(round(len(order) * heldout_fraction))
    parts = [order[cut:], order[:cut]]
    return tuple(Labelled(data.question, data.options, [data.inputs[i] for i in p], data.labels[p]) for p in parts)


async def _fit(args: argparse.Namespace) -> int:
    question = json.loads(args.question.read_text())
    data = read_labelled(args.data, question)
    fit_set, held = (data, read_labelled(args.heldout, question)) if args.heldout else split(data, args.seed)
    if args.method == "platt" and len(data.options) != 2:
        raise SystemExit("--method platt needs a two-option question (yes_no); use vector for more options")
    if args.method == "pride" and question.get("type") == "yes_no":
        raise SystemExit("--method pride permutes the options, and a yes_no question has no option order; "
                         "use platt or temperature")
    print(f"{len(fit_set.inputs)} examples to fit, {len(held.inputs)} held out; options {data.options}")
    scored_held = await score_all(args.base_url, args.model, question, held.inputs, args.concurrency, "held out")
    calibrator = await _calibrator(args, question, fit_set)
    after = calibrator.apply(scored_held.probs)
    report = {
        "method": args.method, "model": scored_held.model, "question_id": question["id"], "options": data.options,
        "seed": args.seed, "n_fit": len(fit_set.inputs), "n_heldout": len(held.inputs),
        "before": evaluate(scored_held.probs, held.labels, data.options),
        "after": evaluate(after, held.labels, data.options),
        "label_mass": {k: float(v) for k, v in label_mass_summary(scored_held.label_mass).items()},
    }
    args.out.write_text(json.dumps({
        "ladle_calibration": FORMAT, **calibrator.to_json(), "model": scored_held.model,
        "question_id": question["id"], "labels": data.options,
        "prompt_format_version": scored_held.prompt_format_version, "n_fit": len(fit_set.inputs)}, indent=2) + "\n")
    if args.report_dir:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        reliability_png(args.report_dir / "reliability.png", held.labels, scored_held.probs, after,
                        f"{question['id']}: {args.method}, {len(held.inputs)} held out")
    _print(report, args.out)
    return 0


async def _calibrator(args: argparse.Namespace, question: dict[str, Any], fit_set: Labelled) -> methods.Calibrator:
    """The fit; contextual and PriDe score their own inputs, so only the other methods score the fit set."""
    if args.method == "contextual":
        free = await score_all(args.base_url, args.model, question, [args.content_free], 1, "content-free")
        return methods.fit("contextual", free.probs)
    if args.method == "pride":
        perms = methods.cyclic_permutations(len(fit_set.options))
        sample = fit_set.inputs[: args.prior_sample]
        return methods.fit("pride", await score_permuted(args.base_url, args.model, question, sample, perms,
                                                         args.concurrency), perms)
    scored = await score_all(args.base_url, args.model, question, fit_set.inputs, args.concurrency, "fit set")
    return methods.fit(args.method, scored.probs, fit_set.labels)


def _print(report: dict[str, Any], out: Path) -> None:
    print(f"held out ({report['n_heldout']} examples)    accuracy    NLL   Brier    ECE  ECE (equal mass)")
    for name in ("before", "after"):
        r = report[name]
        print(f"  {name:24s} {r['accuracy']:8.3f} {r['nll']:7.3f} {r['brier']:7.3f} {r['ece']:6.3f} "
              f"{r['ece_equal_mass']:8.3f}")
    m = report["label_mass"]
    print(f"label mass: median {m['median']:.3f}, 5th percentile {m['p5']:.3f} (suggested floor)")
    print(f"wrote {out}")
