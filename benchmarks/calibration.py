"""Trusting a decision: raw zero-shot, each calibration, TF-IDF + logistic regression, and a
learned head, on held-out labelled data (examples/decisions), side by side.

For each labelled set (tickets: a 4-way choice; reviews: yes/no) and its held-out part of
situations the fit never saw:
  raw           the decision's probabilities as served (zero-shot)
  <method>      `ladle calibrate fit --method <method>` (temperature, vector or platt, isotonic,
                contextual, pride), judged on the held-out part
  tfidf+lr      scikit-learn's TF-IDF (words and word pairs) + logistic regression on the input
                text, C chosen by 5-fold cross-validation on the fit part: the classic baseline
  head          `ladle heads fit`, then served with --decision-head and asked through /v1/decisions
Then the head's serving cost: the held-out inputs, each made unique (so nothing is cached),
asked one at a time as a plain decision and as a head decision, alternating; questions/s and
the latency ratio. Prints the tables, writes JSON and a reliability PNG of raw, the best
calibration and the head.

Usage: .venv/bin/python benchmarks/calibration.py [--sets tickets,reviews] [--out-dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, free_port, running_server  # noqa: E402

from ladle.calibrate.client import read_labelled  # noqa: E402
from ladle.calibrate.report import evaluate  # noqa: E402
from ladle.cli import main as ladle  # noqa: E402

DATA = Path(__file__).parents[1] / "examples" / "decisions"
LADLE = str(Path(sys.executable).with_name("ladle"))


def methods_for(question: dict) -> list[str]:
    if question["type"] == "yes_no":  # no option order to permute: no PriDe
        return ["temperature", "platt", "isotonic", "contextual"]
    return ["temperature", "vector", "isotonic", "contextual", "pride"]


def tfidf_baseline(fit_inputs: list, fit_labels: np.ndarray, held_inputs: list) -> tuple[np.ndarray, float]:
    """Held-out probabilities [n, k] and the fit time of TF-IDF + logistic regression."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.pipeline import make_pipeline

    start = time.perf_counter()
    text = [x if isinstance(x, str) else json.dumps(x) for x in fit_inputs]
    model = make_pipeline(TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True),
                          LogisticRegressionCV(Cs=[0.1, 1, 10, 100], cv=5, max_iter=5000))
    model.fit(text, fit_labels)
    seconds = time.perf_counter() - start
    held = [x if isinstance(x, str) else json.dumps(x) for x in held_inputs]
    return model.predict_proba(held), seconds


def fit_with_cli(args: list[str], report_dir: Path) -> tuple[dict, float]:
    start = time.perf_counter()
    if ladle(args + ["--report-dir", str(report_dir)]) != 0:
        raise RuntimeError(f"ladle {' '.join(args)} failed")
    return json.loads((report_dir / "report.json").read_text()), time.perf_counter() - start


def served_head_probs(url: str, question: dict, head: str, inputs: list, names: list[str]) -> np.ndarray:
    rows = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for text in inputs:
            r = client.post("/v1/decisions", json={"input": text, "questions": [{**question, "head": head}]})
            r.raise_for_status()
            answer = r.json()["answers"][question["id"]]
            assert answer["answered_by"] == "head"
            rows.append([answer["probabilities"][n] for n in names])
    return np.array(rows)


def serving_cost(url: str, question: dict, head: str, inputs: list) -> dict:
    """Plain and head decisions on the same never-seen inputs, alternating, one at a time."""
    times: dict[str, list[float]] = {"plain": [], "head": []}
    with httpx.Client(base_url=url, timeout=120) as client:
        for i, text in enumerate(inputs):
            for kind in ("plain", "head") if i % 2 else ("head", "plain"):
                q = {**question, "head": head} if kind == "head" else question
                unique = f"[ref {kind}-{i}-{time.time_ns()}] {text}"  # a new input: only the template is cached
                start = time.perf_counter()
                client.post("/v1/decisions", json={"input": unique, "questions": [q]}).raise_for_status()
                times[kind].append(time.perf_counter() - start)
    out = {k: {"questions_per_s": len(v) / sum(v), "median_ms": 1e3 * statistics.median(v)} for k, v in times.items()}
    out["latency_ratio"] = out["head"]["median_ms"] / out["plain"]["median_ms"]
    return out


def quick_data(name: str, work: Path) -> Path:
    """--quick: every 8th example to fit and every 6th held out (18 and 10 of the reviews, both answers
    among each, at least 5 of each to fit: the heads' 5-fold cross-validation), in their own folder."""
    folder = work / "quick-data"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.question.json").write_text((DATA / f"{name}.question.json").read_text())
    for part, step in (("fit", 8), ("heldout", 6)):
        lines = (DATA / f"{name}.{part}.jsonl").read_text().splitlines()
        (folder / f"{name}.{part}.jsonl").write_text("\n".join(lines[::step]) + "\n")
    return folder


def run_set(name: str, url_of_plain: str, work: Path, quick: bool = False) -> dict:
    data = quick_data(name, work) if quick else DATA
    question_file = data / f"{name}.question.json"
    question = json.loads(question_file.read_text())
    fit = read_labelled(data / f"{name}.fit.jsonl", question)
    held = read_labelled(data / f"{name}.heldout.jsonl", question)
    common = ["--base-url", url_of_plain, "--data", str(data / f"{name}.fit.jsonl"),
              "--heldout", str(data / f"{name}.heldout.jsonl"), "--question", str(question_file)]
    rows: dict[str, dict] = {}
    for method in methods_for(question)[:1] if quick else methods_for(question):
        print(f"\n[{name}] calibrate fit --method {method}", flush=True)
        report, seconds = fit_with_cli(["calibrate", "fit", *common, "--method", method, "--concurrency", "8",
                                        "--out", str(work / f"{name}-{method}.json")], work / f"{name}-{method}")
        rows.setdefault("raw", {**report["before"], "fit_s": 0.0})
        rows[method] = {**report["after"], "fit_s": seconds}
    print(f"\n[{name}] TF-IDF + logistic regression", flush=True)
    probs, seconds = tfidf_baseline(fit.inputs, fit.labels, held.inputs)
    rows["tfidf+lr"] = {**evaluate(probs, held.labels, fit.options), "fit_s": seconds}
    print(f"\n[{name}] heads fit", flush=True)
    head_path = work / f"{name}-head.safetensors"
    report, seconds = fit_with_cli(["heads", "fit", *common, "--out", str(head_path)], work / f"{name}-head")
    rows["head (fit report)"] = {**report["after"], "fit_s": seconds, "layer": report["layer"]}
    return {"question": question, "fit": fit, "held": held, "rows": rows, "head_path": head_path}


def serve_heads(results: dict, port: int, work: Path, cost_inputs: int = 24) -> None:
    """Serve every fitted head; ask the held-out sets through /v1/decisions; measure the cost."""
    cmd = [LADLE, "serve", "--port", str(port), "--uvicorn-log-level", "warning"]
    for name, r in results.items():
        cmd += ["--decision-head", f"{name}={r['head_path']}"]
    with running_server(cmd, dict(os.environ), port, work / "serve-heads.log", timeout_s=180) as url:
        for name, r in results.items():
            print(f"\n[{name}] the head served through /v1/decisions", flush=True)
            probs = served_head_probs(url, r["question"], name, r["held"].inputs, r["fit"].options)
            r["rows"]["head (served)"] = {**evaluate(probs, r["held"].labels, r["fit"].options),
                                          "fit_s": r["rows"]["head (fit report)"]["fit_s"]}
            r["served_probs"] = probs
            r["cost"] = serving_cost(url, r["question"], name, r["held"].inputs[:cost_inputs])


def print_table(name: str, r: dict) -> None:
    print(f"\n{name}: {len(r['fit'].inputs)} to fit, {len(r['held'].inputs)} held out (unseen situations), "
          f"options {r['fit'].options}")
    print(f"| {'method':20s} | accuracy |   NLL  |  ECE  | fit s |")
    print(f"| {'-' * 20} | -------- | ------ | ----- | ----- |")
    for method, row in r["rows"].items():
        print(f"| {method:20s} | {row['accuracy']:8.3f} | {row['nll']:6.3f} | {row['ece']:.3f} | {row['fit_s']:5.1f} |")
    c = r["cost"]
    print(f"serving: plain {c['plain']['questions_per_s']:.2f} questions/s (median {c['plain']['median_ms']:.0f} ms), "
          f"head {c['head']['questions_per_s']:.2f} questions/s (median {c['head']['median_ms']:.0f} ms): "
          f"latency ratio {c['latency_ratio']:.2f}x")


def reliability_png(path: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 5), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
        curves = {"raw": r["raw_probs"], f"{r['best']} (best calibration)": r["best_probs"],
                  "head (served)": r["served_probs"]}
        for label, probs in curves.items():
            conf, correct = probs.max(axis=1), probs.argmax(axis=1) == r["held"].labels
            groups = np.array_split(np.argsort(conf, kind="stable"), 8)
            ax.plot([conf[g].mean() for g in groups], [correct[g].mean() for g in groups], marker="o",
                    label=f"{label}: acc {correct.mean():.2f}")
        ax.set(xlabel="confidence (top option)", ylabel="accuracy (8 equal-count groups)", xlim=(0, 1), ylim=(0, 1),
               title=f"{name}, {len(r['held'].inputs)} held out")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_raw_and_best_probs(r: dict, url: str, work: Path, name: str) -> None:
    """Held-out raw probabilities, and the best calibration's (its saved file applied to them)."""
    from ladle.calibrate import methods
    from ladle.calibrate.client import score_all

    r["raw_probs"] = asyncio.run(score_all(url, None, r["question"], r["held"].inputs, 8, "held out, raw")).probs
    calibrations = [m for m in r["rows"] if m not in ("raw", "tfidf+lr") and not m.startswith("head")]
    r["best"] = min(calibrations, key=lambda m: r["rows"][m]["ece"])
    calibrator = methods.load(json.loads((work / f"{name}-{r['best']}.json").read_text()))
    r["best_probs"] = calibrator.apply(r["raw_probs"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="tickets,reviews")
    ap.add_argument("--out-dir", type=Path, default=Path.home() / ".cache" / "ladle" / "calibration-bench")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the reviews set alone, an eighth of it to fit and a sixth held out, one "
                         "calibration method (temperature), the serving cost over 4 inputs")
    args = ap.parse_args()
    if args.quick:
        args.sets = "reviews"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} CPUs; model: the embedded SmolLM2-135M-Instruct", flush=True)
    work = Path(tempfile.mkdtemp(prefix="ladle-calibration-bench-"))
    port = free_port()
    results = {}
    cmd = [LADLE, "serve", "--port", str(port), "--uvicorn-log-level", "warning"]
    with running_server(cmd, dict(os.environ), port, work / "serve.log", timeout_s=180) as url:
        for name in args.sets.split(","):
            results[name] = run_set(name, url, work, args.quick)
            add_raw_and_best_probs(results[name], url, work, name)
    serve_heads(results, free_port(), work, 4 if args.quick else 24)
    for name, r in results.items():
        print_table(name, r)
    summary = {name: {"rows": r["rows"], "cost": r["cost"], "best_calibration": r["best"]}
               for name, r in results.items()}
    (args.out_dir / "calibration.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    reliability_png(args.out_dir / "calibration-reliability.png", results)
    print(f"\nsaved {args.out_dir / 'calibration.json'} and {args.out_dir / 'calibration-reliability.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
