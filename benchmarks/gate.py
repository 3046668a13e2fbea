"""The performance gate CI runs: short, and immune to how fast the machine is, because it compares
ratios measured side by side in the same run, never absolute times.

  inprocess  ladle's offline LLM against transformers `generate` on the embedded model, both on its
             float32 weights, the same threads: 8 prompts of 64 tokens, 64 generated each; output tok/s,
             ladle / transformers
  server     `ladle serve` loaded by `ladle bench serve` (64 requests at concurrency 8, 2 warm-ups),
             against the offline LLM on requests of the same lengths at the same batch: output tok/s,
             server / offline

Each ratio must stay at or above its floor in benchmarks/gate_floors.json; the script exits 1 when one
falls below. A floor is the lowest ratio of 5 runs on the slowest machine measured, less the spread
(max - min) of those runs: noise as large again as any seen does not fail CI, a real slowdown does
(the file keeps the runs and says how). `--measure N` runs the gate N times and prints those figures.

Usage: python benchmarks/gate.py [--cases inprocess,server] [--measure 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port, machine, random_prompt_ids, running_server  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.model.loader import cache_dir, default_gguf_path, gguf_cache_path  # noqa: E402

FLOORS = Path(__file__).with_name("gate_floors.json")
CASES = ("inprocess", "server")
BATCH = 8


def workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt_ids(rng, prompt_len) for _ in range(n)]


def ladle_tok_s(llm: LLM, prompts: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    return sum(len(r.outputs[0].token_ids) for r in results) / (time.perf_counter() - t)


def transformers_tok_s(model_dir: Path, prompts: list[list[int]], out_len: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    return len(prompts) * out_len / (time.perf_counter() - t)


def dense_llm() -> LLM:
    """ladle on the embedded GGUF dequantised at load: the float32 weights transformers runs."""
    return LLM(str(default_gguf_path()), dtype="float32", quantization="none", max_num_seqs=BATCH)


def inprocess_ratio(llm: LLM, model_dir: Path, quick: bool) -> dict:
    prompts, out_len = workload(BATCH, 32 if quick else 64), 16 if quick else 64
    print("  inprocess: ladle ...", flush=True)
    ladle = ladle_tok_s(llm, prompts, out_len)
    print("  inprocess: transformers ...", flush=True)
    hf = transformers_tok_s(model_dir, prompts, out_len)
    return {"ladle_tok_s": ladle, "transformers_tok_s": hf, "ratio": ladle / hf}


def server_ratio(llm: LLM, quick: bool) -> dict:
    """The server's output tok/s under `ladle bench serve` against the offline LLM on the same requests."""
    port, out_len, prompt_len = free_port(), 16, 64
    num_prompts = 16 if quick else 64
    cmd = [sys.executable, "-m", "ladle.cli", "serve", str(default_gguf_path()), "--port", str(port),
           "--dtype", "float32", "--quantization", "none", "--max-num-seqs", str(BATCH)]
    with tempfile.TemporaryDirectory() as tmp:
        with running_server(cmd, None, port, Path(tmp) / "server.log", timeout_s=300) as base:
            print(f"  server: ladle bench serve, {num_prompts} requests at concurrency {BATCH} ...", flush=True)
            subprocess.run([sys.executable, "-m", "ladle.cli", "bench", "serve", "--base-url", base,
                            "--num-prompts", str(num_prompts), "--random-input-len", str(prompt_len),
                            "--random-output-len", str(out_len), "--max-concurrency", str(BATCH),
                            "--num-warmups", "2", "--disable-tqdm", "--save-result", "--result-dir", tmp,
                            "--result-filename", "serve.json"], check=True, capture_output=True, timeout=600)
            served = json.loads((Path(tmp) / "serve.json").read_text())
    print("  server: the offline LLM on the same batch ...", flush=True)
    offline = ladle_tok_s(llm, workload(num_prompts, prompt_len, seed=1), out_len)
    return {"server_tok_s": served["output_throughput"], "offline_tok_s": offline,
            "ratio": served["output_throughput"] / offline}


def float32_model() -> Path:
    """The embedded model as float32 safetensors, both sides loading the same weights: transformers'
    own dequantisation of the GGUF, kept once per machine (the folder tests/conftest.py keeps too)."""
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    folder = cache_dir() / f"{gguf_cache_path(gguf).name}-transformers-{transformers.__version__}"
    if (folder / "config.json").is_file():
        return folder
    print("  dequantising the embedded GGUF once for this machine ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    partial = folder.with_name(f"{folder.name}.partial-gate")
    model.config.save_pretrained(partial)
    config = json.loads((partial / "config.json").read_text())
    del config["quantization_config"]  # the GGUF's, not these float32 tensors'
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(partial)
    save_model(model, str(partial / "model.safetensors"))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(partial)
    partial.rename(folder)
    return folder


def run_once(cases: list[str], quick: bool) -> dict:
    model_dir = float32_model()
    llm = dense_llm()
    out = {}
    try:
        if "inprocess" in cases:
            out["inprocess"] = inprocess_ratio(llm, model_dir, quick)
        if "server" in cases:
            out["server"] = server_ratio(llm, quick)
    finally:
        llm.engine.close()
    return out


def check(figures: dict, floors: dict) -> list[str]:
    """The cases whose ratio fell below its floor, each as a line saying by how much."""
    failures = []
    for case, fig in figures.items():
        floor = floors["floors"][case]
        verdict = "ok" if fig["ratio"] >= floor else "BELOW THE FLOOR"
        print(f"gate {case}: ratio {fig['ratio']:.3f} (floor {floor:.3f}) {verdict}", flush=True)
        if fig["ratio"] < floor:
            failures.append(f"{case}: {fig['ratio']:.3f} < {floor:.3f}")
    return failures


def measure(n: int, cases: list[str]) -> None:
    """Run the gate n times; print each case's ratios, median, spread and the floor they give."""
    runs = []
    for i in range(n):
        print(f"[{i + 1}/{n}]", flush=True)
        runs.append(run_once(cases, quick=False))
    for case in cases:
        ratios = [r[case]["ratio"] for r in runs]
        spread = max(ratios) - min(ratios)
        print(f"{case}: ratios {', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}, "
              f"spread {spread:.3f}, floor (lowest - spread) {min(ratios) - spread:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of inprocess and server")
    ap.add_argument("--measure", type=int, default=0, metavar="N", help="run N times and print the floors' figures")
    ap.add_argument("--quick", action="store_true", help="smoke run: shorter prompts and outputs")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := set(cases) - set(CASES):
        ap.error(f"unknown cases {sorted(unknown)}; choose of {', '.join(CASES)}")
    print(f"machine: {machine()}", flush=True)
    if args.measure:
        measure(args.measure, cases)
        return
    started = time.perf_counter()
    figures = run_once(cases, args.quick)
    if args.quick:  # shorter runs than the floors were measured on: figures only, no verdict
        for case, fig in figures.items():
            print(f"gate {case} (quick): ratio {fig['ratio']:.3f}", flush=True)
        return
    failures = check(figures, json.loads(FLOORS.read_text()))
    print(f"gate: {time.perf_counter() - started:.0f} s", flush=True)
    if failures:
        print("gate FAILED: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
