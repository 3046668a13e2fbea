"""Where a decode step's time goes on the GPU (issue 40's diagnosis): the Llama-3.1-8B-shaped model of
benchmarks/gpu.py, BATCH sequences decoding together after their prompts (1000 tokens each; 128 at
batch 1), each step's wall time split into the engine's host phases, and the GPU's kernel time by
kernel from torch's profiler. The wall time less the kernel time is what the GPU waited on the host.

  phases    schedule (the scheduler), execute (the runner on the host: inputs, metadata, the graph
            replay or the eager launches; it returns before the GPU is done), sample (the sampler,
            which waits for the step's logits), rest (tokens appended, stop checks, outputs)
  kernels   the GPU time of each kernel name over the profiled steps, the largest first

Writes gpu_profile.json to --out and prints a table per batch size.

Usage: python benchmarks/gpu_profile.py --tokenizer .gpu/llama3-tokenizer --out DIR [--batches 1,128,256] [--steps 8]
           [--enforce-eager] [--quick]
       python benchmarks/gpu_profile.py --model PATH --device cpu --out DIR ...   (the same code on the CPU)
On the device: STEPS=profile bash benchmarks/gpu_check.sh (in the one call a visit has).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import LLAMA31_8B, model_folder, random_prompts  # noqa: E402

PHASES = ("schedule", "execute", "sample")


class PhaseClock:
    """Host seconds spent in the engine's scheduler, runner and sampler, by wrapping them in place."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        for name, owner, attr in (("schedule", engine.scheduler, "schedule"), ("execute", engine.runner, "execute"),
                                  ("sample", engine, "sampler")):
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed


def start_decoding(engine, batch: int, prompt_len: int, max_tokens: int) -> list[str]:
    """`batch` requests added and stepped until every one has its first token (so the next steps decode)."""
    from ladle import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    prompts = random_prompts(batch, prompt_len, seed=batch, high=min(120000, engine.model_config.vocab_size - 1000))
    ids = [f"profile-{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step() if out.deltas)
    return ids


def kernel_times(prof, steps: int) -> list[dict]:
    """Per kernel name: ms and calls per step on the device (the CPU's ops where there is no device)."""
    rows = []
    for evt in prof.key_averages():
        us = evt.self_device_time_total if torch.cuda.is_available() else evt.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": evt.key[:100], "ms_per_step": us / 1e3 / steps, "calls_per_step": evt.count / steps})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def time_steps(engine, batch: int, steps: int) -> dict:
    """Wall time and host phases of `steps` decode steps at `batch` (the requests left running)."""
    for _ in range(2):  # warm: the graph of this size replayed once
        engine.step()
    clock = PhaseClock(engine)
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    phases = {name: clock.seconds[name] / steps * 1e3 for name in PHASES}
    phases["rest"] = sum(walls) / steps * 1e3 - sum(phases.values())
    return {"batch": batch, "wall_ms_per_step": statistics.median(walls) * 1e3, "host_ms_per_step": phases,
            "gpu_ms_per_step": None, "gpu_idle_ms_per_step": None, "kernels": []}


def add_kernel_times(result: dict, engine, steps: int) -> None:
    """The kernels of `steps` more decode steps under torch's profiler, into `result`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels = kernel_times(prof, steps)
    result["kernels"] = kernels[:15]
    if torch.cuda.is_available():
        result["gpu_ms_per_step"] = sum(k["ms_per_step"] for k in kernels)
        result["gpu_idle_ms_per_step"] = result["wall_ms_per_step"] - result["gpu_ms_per_step"]


def table(r: dict) -> str:
    phases = ", ".join(f"{name} {ms:.2f}" for name, ms in r["host_ms_per_step"].items())
    gpu = "-" if r["gpu_ms_per_step"] is None else (
        f"{r['gpu_ms_per_step']:.2f} ms, idle {r['gpu_idle_ms_per_step']:.2f} ms")
    lines = [f"### batch {r['batch']}: {r['wall_ms_per_step']:.2f} ms a step; kernels {gpu}; host ms: {phases}", "",
             "| kernel | ms per step | calls per step |", "| --- | --- | --- |"]
    lines += [f"| `{k['kernel']}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |" for k in r["kernels"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, help="a Llama 3 tokenizer folder, for the 8B-shaped model")
    p.add_argument("--model", type=Path, help="profile this model instead (real weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", default="1,128,256")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every kernel launched from Python")
    p.add_argument("--quick", action="store_true", help="batches 1 and 4, two steps each (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.batches, args.steps = "1,4", 2
    if (args.model is None) == (args.tokenizer is None):
        p.error("give --tokenizer (the 8B-shaped model) or --model")
    from ladle import LLM

    batches = [int(b) for b in args.batches.split(",")]
    engine = dict(device=args.device, max_num_seqs=max(batches), max_num_batched_tokens=8192, max_model_len=2048,
                  enable_prefix_caching=False, enforce_eager=args.enforce_eager)
    if args.model is None:
        folder = model_folder(Path("/tmp/ladle-gpu-bench"), "llama-3.1-8b-shape", LLAMA31_8B, args.tokenizer)
        engine.update(load_format="dummy", dtype="bfloat16")
    else:
        folder = args.model
    llm = LLM(str(folder), **engine)
    print(f"engine: {llm.engine.runtime_info()}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []

    def save() -> None:  # before the profiler too: a profiler that hangs under graphs keeps the timings
        (args.out / "gpu_profile.json").write_text(json.dumps(results, indent=1))

    for batch in batches:
        ids = start_decoding(llm.engine, batch, 128 if batch == 1 else 1000, max_tokens=3 * args.steps + 8)
        results.append(time_steps(llm.engine, batch, args.steps))
        save()
        add_kernel_times(results[-1], llm.engine, args.steps)
        save()
        for rid in ids:
            llm.engine.abort_request(rid)
        print(table(results[-1]), flush=True)


if __name__ == "__main__":
    main()
