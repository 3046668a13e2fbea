"""Output tokens/s: ladle against transformers `generate`, same model, dtype and threads.

  uniform  16 prompts x 256 tokens, 64 generated each (ignore_eos)
  mixed    48 seeded requests, prompts 16..768, outputs 8..256, at most 16 running;
           transformers runs them as padded batches of 16, each until its longest ends;
           and the mixed run's FLOPs against measured matmul FLOP/s
  prefill  8 prompts x 512 tokens, one output token: prompt tok/s against the GEMM roof
           (torch's matmul FLOP/s in that dtype over the model's FLOPs per token)
  decode   batch-1 ms/token against the memory-bandwidth bound for that dtype's weight bytes
  steps    a decode step at batch 1, 8 and 16 (greedy), and at 16 sampled at temperature 0.8 and
           top-p 0.95, split into matmul / attention / the rest, each step against the bandwidth
           bound (every weight byte read once per step), beside the matmul route per row bucket the
           start-up measurement chose; the decoder layers in the native loop and in Python, side by
           side, where the model takes the loop

Each dtype of --dtype runs all cases (transformers in the same dtype).

Usage: python benchmarks/throughput.py [--model PATH] [--dtype float32,bfloat16] [--cases ...] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_name, machine, matmul_gflops, random_prompt_ids, read_bandwidth_gbs  # noqa: E402

from ladle import LLM, SamplingParams  # noqa: E402
from ladle.model.layers import Linear  # noqa: E402

STEP_BATCHES = (1, 8, 16)


def uniform_workload(n: int = 16, prompt_len: int = 256, out_len: int = 64) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [(random_prompt_ids(rng, prompt_len), out_len) for _ in range(n)]


def mixed_workload(n: int = 48, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(random_prompt_ids(rng, rng.randint(16, 768)), rng.randint(8, 256)) for _ in range(n)]


def run_ladle(llm: LLM, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    t = time.perf_counter()
    results = llm.generate([p for p, _ in work], params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    return elapsed, sum(len(r.outputs[0].token_ids) for r in results)


def run_hf(model, work: list[tuple[list[int], int]], batch: int = 16) -> tuple[float, int]:
    """Padded static batches in arrival order; useful tokens are each request's own max."""
    t = time.perf_counter()
    useful = 0
    for start in range(0, len(work), batch):
        chunk = work[start : start + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):  # left padding, as decoder-only generation wants
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        longest = max(m for _, m in chunk)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
        useful += sum(m for _, m in chunk)
        print(f"    transformers batch {start // batch + 1}/{-(-len(work) // batch)} done", flush=True)
    return time.perf_counter() - t, useful


def weight_bytes_per_token(llm: LLM) -> int:
    m = llm.engine.runner.model
    return sum(lin.nbytes for layer in m.layers for lin in layer.linears) + m.lm_head.nbytes


def layer_params(llm: LLM) -> int:
    """The weights of the decoder layers' linear layers (the LM head not included)."""
    return sum(lin.out_features * lin.in_features for layer in llm.engine.runner.model.layers for lin in layer.linears)


def workload_flops(llm: LLM, work: list[tuple[list[int], int]]) -> float:
    """Matmul FLOPs of computing every prompt and output token once (linears + attention + lm_head)."""
    c = llm.engine.model_config
    linear_params = layer_params(llm)
    head = c.vocab_size * c.hidden_size
    attn_per_ctx = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim  # QK^T and PV, per key
    total = 0.0
    for prompt, out in work:
        tokens = len(prompt) + out
        total += 2 * linear_params * tokens + 2 * head * (out + 1)
        total += attn_per_ctx * tokens * (tokens + 1) / 2
    return total


def batch1_decode_ms(llm: LLM, n: int = 128) -> float:
    prompt = random_prompt_ids(random.Random(1), 32)
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True)
    llm.generate([prompt], short)  # warm up
    t0 = time.perf_counter()
    llm.generate([prompt], short)
    t1 = time.perf_counter()
    llm.generate([prompt], long)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / n * 1000


def linear_classes() -> list[type]:
    """Linear and every subclass that has a __call__ of its own (int8, fp8 layers)."""
    found, todo = [], [Linear]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "__call__" in vars(cls):
            found.append(cls)
    return found


@dataclass
class StepParts:
    """Wall time of the decode steps (every row one generated token) run while a block runs, and the
    time spent inside them in matmuls (every linear layer's call, of any kind, lm_head included) and in
    attention (the KV write and the attention itself)."""
    steps: int = 0
    step_s: float = 0.0
    matmul_s: float = 0.0
    attention_s: float = 0.0
    looped: int = 0  # steps the native layer loop ran

    def per_step_ms(self) -> dict[str, float]:
        step, matmul, attention = (x / self.steps * 1000 for x in (self.step_s, self.matmul_s, self.attention_s))
        return {"step_ms": step, "matmul_ms": matmul, "attention_ms": attention,
                "rest_ms": step - matmul - attention}


def is_decode_step(batch: list) -> bool:
    return all(item.num_new_tokens == 1 and item.seq.num_computed_tokens >= item.seq.num_prompt_tokens
               for item in batch)


@contextlib.contextmanager
def timed_decode_steps(llm: LLM):
    """Times each engine step, and the matmuls and attention inside it, and keeps the sums for decode steps
    only. The timers wrap the calls, so the split is the one the model runs, not a replay of its shapes. A
    call inside a timed call (a quantised layer falling back on its float one) counts once. Each part is
    timed inside the step it belongs to, so no part is a difference of two runs that noise can make
    negative."""
    total, this_step = StepParts(), {"matmul": 0.0, "attention": 0.0, "decode": False}
    depth = {"matmul": 0, "attention": 0}
    engine, runner = llm.engine, llm.engine.runner
    backend = runner.model.attention
    loop = getattr(runner.model, "decode_loop", None)  # the native layer loop times its own matmuls and attention
    if loop is not None:
        loop.seconds = torch.zeros(2, dtype=torch.float64)

    def timed(part: str, fn):
        def call(*a, **k):
            depth[part] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                depth[part] -= 1
                if depth[part] == 0:
                    this_step[part] += time.perf_counter() - t
        return call

    def execute(batch):
        this_step["decode"] = is_decode_step(batch)
        return run_batch(batch)

    def step():
        this_step.update(matmul=0.0, attention=0.0, decode=False)
        if loop is not None:
            loop.seconds.zero_()
        looped = loop.steps if loop is not None else 0
        t = time.perf_counter()
        out = engine_step()
        if this_step["decode"]:
            inside = loop.seconds.tolist() if loop is not None else (0.0, 0.0)
            total.steps += 1
            total.step_s += time.perf_counter() - t
            total.matmul_s += this_step["matmul"] + inside[0]
            total.attention_s += this_step["attention"] + inside[1]
            total.looped += (loop.steps if loop is not None else 0) - looped
        return out

    calls = {cls: vars(cls)["__call__"] for cls in linear_classes()}
    for cls, fn in calls.items():
        cls.__call__ = timed("matmul", fn)
    backend.attend, backend.write_kv = timed("attention", backend.attend), timed("attention", backend.write_kv)
    engine_step, run_batch = engine.step, runner.execute
    engine.step, runner.execute = step, execute
    try:
        yield total
    finally:
        for cls, fn in calls.items():
            cls.__call__ = fn
        # the instance attributes go; the class's methods show again
        del backend.attend, backend.write_kv, engine.step, runner.execute
        if loop is not None:
            loop.seconds = None


SAMPLED = dict(temperature=0.8, top_p=0.95)  # a chat client's settings, beside greedy


def decode_step_split(llm: LLM, batch: int, steps: int, sampled: bool = False,
                      layer_loop: bool = True) -> dict[str, float]:
    """ms per decode step at `batch` running sequences, split into matmul, attention and the rest (the
    engine's scheduling, sampling and the model's other ops); greedy, or sampled with SAMPLED. layer_loop:
    the decoder layers in the native loop (ladle.model.decode_loop) where the model has one, else in Python."""
    rng = random.Random(3 + batch)
    prompts = [random_prompt_ids(rng, 32) for _ in range(batch)]
    how = dict(SAMPLED, seed=0) if sampled else dict(temperature=0.0)
    model = llm.engine.runner.model
    loop = getattr(model, "decode_loop", None)
    if not layer_loop:
        model.decode_loop = None
    try:
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, **how))  # warm-up
        with timed_decode_steps(llm) as parts:
            llm.generate(prompts, SamplingParams(max_tokens=steps + 1, ignore_eos=True, **how))
    finally:
        model.decode_loop = loop
    if parts.steps < steps:
        raise RuntimeError(f"expected {steps} decode steps at batch {batch}, timed {parts.steps}")
    # the loop leaves to Python the steps it cannot take exactly as Python would (a matmul routed to torch)
    return {**parts.per_step_ms(), "loop_pct": 100 * parts.looped / parts.steps}


def print_step_split(rows: dict[str, dict[str, float]], bound_ms: float) -> None:
    print("| batch | layers | step ms | matmul ms | attention ms | rest ms | non-matmul share "
          "| step / bandwidth bound | step / roofline |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, r in rows.items():
        batch, layers = label.split(", ")
        if layers != "Python":
            layers += f" ({r['loop_pct']:.0f}% of steps)"
        print(f"| {batch} | {layers} | {r['step_ms']:.1f} | {r['matmul_ms']:.1f} | {r['attention_ms']:.1f} "
              f"| {r['rest_ms']:.1f} | {r['non_matmul_pct']:.0f}% | {r['step_ms'] / bound_ms:.2f}x "
              f"| {r['roofline_ratio']:.2f}x |")


def step_flops(llm: LLM, batch: int) -> float:
    """A decode step's matmul FLOPs at `batch` rows (the linear layers and the LM head; attention's are few)."""
    c = llm.engine.model_config
    return 2 * (layer_params(llm) + c.vocab_size * c.hidden_size) * batch


def prefill_tok_s(llm: LLM, n: int = 8, prompt_len: int = 512) -> float:
    rng = random.Random(2)
    work = [random_prompt_ids(rng, prompt_len) for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(work[:1], params)  # warm up (caches differ: these prompts share nothing)
    t = time.perf_counter()
    llm.generate(work[1:], params)
    return (n - 1) * prompt_len / (time.perf_counter() - t)


def run_dtype(dtype: str, args: argparse.Namespace, cases: list[str]) -> dict:
    llm = LLM(args.model, max_num_seqs=max(16, *STEP_BATCHES), max_num_batched_tokens=args.max_num_batched_tokens,
              dtype=dtype)
    torch_dtype = llm.engine.dtype.dtype
    report: dict = llm.engine.runtime_info()  # dtype, why, KV dtype, kernels, matmul route
    print(f"\n=== --dtype {dtype}: {llm.engine.dtype.name} ({llm.engine.dtype.reason}); "
          f"kernels {llm.engine.isa}")
    hf = None
    if "uniform" in cases or "mixed" in cases:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch_dtype).eval()
    scale = 4 if args.quick else 1
    workloads = {"uniform": uniform_workload(16 // scale, 256, 64 // scale), "mixed": mixed_workload(48 // scale)}
    gflops = matmul_gflops(dtype=torch_dtype)
    for name in ("uniform", "mixed"):
        if name not in cases:
            continue
        work = workloads[name]
        print(f"\n[{name}] {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, "
              f"{sum(m for _, m in work)} output tokens")
        lt, ln = run_ladle(llm, work)
        ht, hn = run_hf(hf, work)
        row = {"ladle_tok_s": ln / lt, "hf_tok_s": hn / ht, "ratio": (ln / lt) / (hn / ht),
               "ladle_s": lt, "hf_s": ht}
        if name == "mixed":
            achieved = workload_flops(llm, work) / lt / 1e9
            row.update(achieved_gflops=achieved, matmul_gflops=gflops, flops_pct=100 * achieved / gflops)
        report[name] = row
        print(f"  ladle {row['ladle_tok_s']:.1f} tok/s | transformers {row['hf_tok_s']:.1f} tok/s | "
              f"ratio {row['ratio']:.2f}x")
        if name == "mixed":
            print(f"  mixed FLOPs: {row['achieved_gflops']:.1f} GFLOP/s of {row['matmul_gflops']:.1f} measured "
                  f"{llm.engine.dtype.name} matmul GFLOP/s = {row['flops_pct']:.0f}%")
    if "prefill" in cases:
        tok_s = prefill_tok_s(llm, 3 if args.quick else 8)
        roof = gflops * 1e9 / (workload_flops(llm, [([0] * 512, 0)]) / 512)
        report["prefill"] = {"tok_s": tok_s, "roof_tok_s": roof, "matmul_gflops": gflops, "pct_of_roof": 100 * tok_s / roof}
        print(f"\n[prefill] {tok_s:.0f} prompt tok/s; GEMM roof {gflops:.0f} GFLOP/s -> {roof:.0f} tok/s "
              f"-> {100 * tok_s / roof:.0f}% of the roof")
    if "decode" in cases:
        ms = batch1_decode_ms(llm, 32 if args.quick else 128)
        bw = read_bandwidth_gbs()
        wb = weight_bytes_per_token(llm)
        bound_ms = wb / (bw * 1e9) * 1000
        report["decode"] = {"ms_per_token": ms, "bound_ms": bound_ms, "read_gbs": bw, "weight_mb": wb / 1e6,
                            "pct_of_bound": 100 * bound_ms / ms}
        print(f"\n[decode] batch-1 {ms:.1f} ms/token; bound {wb / 1e6:.0f} MB / {bw:.1f} GB/s = {bound_ms:.1f} ms "
              f"-> {100 * bound_ms / ms:.0f}% of the bandwidth bound")
    if "steps" in cases:
        routing = llm.engine.runner.model.routing
        print(f"\n[steps] matmul route by rows per call: {routing.table()}\n  measured: {routing.measured}")
        bw = read_bandwidth_gbs()
        wb = weight_bytes_per_token(llm)
        bound_ms = wb / (bw * 1e9) * 1000
        # the kernels widen bf16 and int8 weights to float32 FMAs, so float32's rate bounds every dtype too
        gemm_rate = max(gflops, matmul_gflops(dtype=torch.float32)) if torch_dtype != torch.float32 else gflops
        compute_ms = {b: step_flops(llm, b) / (gemm_rate * 1e9) * 1000 for b in STEP_BATCHES}
        rows = {}
        paths = ["native loop", "Python"] if getattr(llm.engine.runner.model, "decode_loop", None) else ["Python"]
        for batch, sampled in [(b, False) for b in STEP_BATCHES] + [(STEP_BATCHES[-1], True)]:
            for path in paths:
                r = decode_step_split(llm, batch, 4 if args.quick else 64, sampled, layer_loop=path != "Python")
                r["non_matmul_pct"] = 100 * (r["step_ms"] - r["matmul_ms"]) / r["step_ms"]
                r["bound_ratio"] = r["step_ms"] / bound_ms
                r["roofline_ratio"] = r["step_ms"] / max(bound_ms, compute_ms[batch])
                label = f"{batch} sampled, {path}" if sampled else f"{batch}, {path}"
                rows[label] = r
                print(f"  batch {label}: {r['step_ms']:.1f} ms/step", flush=True)
        print(f"  bandwidth bound: {wb / 1e6:.0f} MB of weights / {bw:.1f} GB/s = {bound_ms:.1f} ms per step")
        print(f"  compute bound (matmul FLOPs at torch's best GEMM rate, {gemm_rate:.0f} GFLOP/s): "
              + ", ".join(f"batch {b} {ms:.1f} ms" for b, ms in compute_ms.items())
              + "; the roofline is the larger of the two bounds\n")
        print_step_split(rows, bound_ms)
        if len(paths) == 2:
            loop_ms = {label.split(", ")[0]: r["step_ms"] for label, r in rows.items() if label.endswith("loop")}
            ratios = [f"{label.split(', ')[0]} {r['step_ms'] / loop_ms[label.split(', ')[0]]:.2f}x"
                      for label, r in rows.items() if label.endswith(", Python")]
            print(f"\nnative layer loop against the Python layers (step time, Python / loop): {', '.join(ratios)}")
        report["steps"] = {"route": routing.table(), "measured": routing.measured, "bound_ms": bound_ms,
                           "compute_bound_ms": compute_ms, "gemm_gflops": gemm_rate,
                           "read_gbs": bw, "weight_mb": wb / 1e6, "by_batch": rows}
    del llm, hf
    gc.collect()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated --dtype values, each run in turn")
    ap.add_argument("--cases", default="uniform,mixed,prefill,decode,steps")
    ap.add_argument("--quick", action="store_true", help="smaller workloads, for a smoke run")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--save", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    cases = args.cases.split(",")
    print(f"machine: {machine()}; CPU: {cpu_name()}")
    report: dict = {"machine": machine(), "cpu": cpu_name(), "model": args.model or "SmolLM2-135M-Instruct"}
    for dtype in args.dtype.split(","):
        report[dtype] = run_dtype(dtype, args, cases)
    if args.save:
        Path(args.save).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
