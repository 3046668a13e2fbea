"""`ladle heads fit`: a learned decision head from labelled examples, through a ladle server."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from ladle.calibrate.cli import add_server_and_data_arguments, split
from ladle.calibrate.client import read_labelled
from ladle.calibrate.report import evaluate, reliability_png
from ladle.heads.fit import fit_head


# Counted from the end (-1: the final normed output), so it suits any depth. On the embedded
# model, mean-pooled states of every layer from a third of the way up separate the ticket teams
# about equally well (held-out accuracy 0.88-0.94): one pass at two thirds is the default.
DEFAULT_LAYERS = "-8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="heads_command", metavar="{fit}", required=True)
    fit = sub.add_parser("fit", help="fit a head on the model's hidden states and report it on held-out examples")
    add_server_and_data_arguments(fit)  # --base-url: a ladle server (it needs /v1/embeddings)
    fit.add_argument("--out", type=Path, required=True, help="HEAD.safetensors (HEAD.json is written beside it)")
    fit.add_argument("--heldout", type=Path, default=None,
                     help="held-out JSONL (default: a seeded quarter of --data, never used for fitting)")
    fit.add_argument("--report-dir", type=Path, default=None, help="write report.json and reliability.png here")
    fit.add_argument("--layers", default=DEFAULT_LAYERS,
                     help="comma-separated layers to try, each one more pass over the data (transformers' "
                          f"numbering, negative from the end; default {DEFAULT_LAYERS})")
    fit.add_argument("--pooling", choices=("mean", "last"), default="mean",
                     help="mean: the states from where the input begins to the answer position; last: that "
                          "position alone (cheaper to serve when many questions share one cached input)")
    fit.add_argument("--C", dest="strengths", default="0.01,0.1,1",
                     help="inverse regularisation strengths to try (comma-separated)")
    fit.add_argument("--seed", type=int, default=0,
                     help="seeds the split that holds out a quarter of --data (without --heldout) and the "
                          "cross-validation folds")
    fit.add_argument("--concurrency", type=int, default=4, help="requests in flight")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_fit(args))


async def _fit(args: argparse.Namespace) -> int:
    question = json.loads(args.question.read_text())
    data = read_labelled(args.data, question)
    fit_set, held = (data, read_labelled(args.heldout, question)) if args.heldout else split(data, args.seed)
    layers = [int(x) for x in args.layers.split(",")]
    strengths = [float(x) for x in args.strengths.split(",")]
    print(f"{len(fit_set.inputs)} examples to fit, {len(held.inputs)} held out; options {data.options}; "
          f"layers {layers}, C {strengths}")
    result = await fit_head(args.base_url, args.model, question, fit_set, held, layers, strengths, args.pooling,
                            args.concurrency, args.seed)
    report = {"model": result.head.model, "question_id": question["id"], "options": data.options,
              "layer": result.head.layer, "pooling": result.head.pooling, "pool_from": result.head.pool_from,
              "seed": args.seed, "n_fit": len(fit_set.inputs),
              "n_heldout": len(held.inputs), "fit_seconds": result.seconds, "search": result.search,
              "before": evaluate(result.before, held.labels, data.options),
              "after": evaluate(result.after, held.labels, data.options)}
    result.head.report = {k: report[k] for k in ("n_fit", "n_heldout", "before", "after", "search")}
    result.head.save(args.out)
    if args.report_dir:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        (args.report_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        reliability_png(args.report_dir / "reliability.png", held.labels, result.before, result.after,
                        f"{question['id']}: zero-shot vs head (layer {result.head.layer})")
    print(f"layer {result.head.layer} chosen; fitted in {result.seconds:.1f} s")
    print(f"held out ({report['n_heldout']} examples)    accuracy    NLL   Brier    ECE")
    for name, label in (("before", "zero-shot decision"), ("after", "head")):
        r = report[name]
        print(f"  {label:24s} {r['accuracy']:8.3f} {r['nll']:7.3f} {r['brier']:7.3f} {r['ece']:6.3f}")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0
