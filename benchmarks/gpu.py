"""ladle on an NVIDIA GPU (issue 40's device check), on a model shaped like Llama-3.1-8B: random bf16
weights made on the device (--load-format dummy), a real Llama 3 tokenizer (benchmarks/gpu/fetch.sh).

Cases (--cases, default all, in this order):
  ceilings  the device's own roofs: device-to-device copy bandwidth (bytes read + written) and the
            bf16 matmul rate of an 8192^3 product
  decode    batch-1 decode ms/token, end to end through the engine and the captured step alone, against
            the HBM bound: the bytes a decode step reads (every weight but the embedding) / copy bandwidth
  prefill   one 8192-token prompt: time to its first token, as MFU against the measured matmul rate
  offline   512 requests of 1000 prompt tokens and 200 output tokens (ignore_eos, greedy): ladle's
            output tok/s against transformers `generate` (static batches, sdpa, --hf-batch per batch)
  serve     `ladle serve --device cuda` driven by `ladle bench serve` at concurrency 1, 32, 128, 256:
            TTFT and TPOT p50/p99, output tok/s, and goodput at MLPerf's interactive SLO for
            Llama-3.1-8B (TTFT p99 <= 500 ms, TPOT p99 <= 30 ms)
  graphs    batch-1 decode of a small model (SmolLM2-135M's shape) with and without CUDA graphs

Issue 45's cases, run only when named (--cases invariant,fp8,fp8_kv):
  invariant decode tok/s at batch 64 and 256 with every request canonical (--deterministic: the
            fixed-tile Triton matmul and the extend kernel) against the normal mode: the guarantee's cost
  fp8       --quantization fp8 against bf16: batch-1 decode ms/token and offline output tok/s
  fp8_kv    the most 1200-token sequences the pool holds with --kv-cache-dtype fp8 against bf16 KV

Writes gpu.json (every figure, the GPU, driver and torch named) and gpu.md (the table) to --out.

Usage: python benchmarks/gpu.py --tokenizer .gpu/llama3-tokenizer --out DIR [--cases ...] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port, running_server  # noqa: E402

CASES = ("ceilings", "decode", "prefill", "offline", "serve", "graphs")
NAMED_CASES = ("invariant", "fp8", "fp8_kv")  # issue 45's: only when --cases names them
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}
SMALL = {**LLAMA31_8B, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
         "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True,
         "max_position_embeddings": 8192, "rope_scaling": None, "rope_theta": 100000.0}
SLO = {"ttft": 500.0, "tpot": 30.0}  # MLPerf Inference's interactive Llama-3.1-8B scenario, p99, ms
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16


def log(msg: str) -> None:
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_folder(root: Path, name: str, config: dict, tokenizer: Path) -> Path:
    """A folder with config.json and the tokenizer: all --load-format dummy needs."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


def random_prompts(n: int, length: int, seed: int = 0, high: int = 120000) -> list[list[int]]:
    """n prompts of random ids in [1000, high): below Llama 3's special tokens by default."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, high) for _ in range(length)] for _ in range(n)]


def cuda_ms(fn, repeats: int) -> float:
    """Median milliseconds of fn() timed with CUDA events, after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# -- cases --------------------------------------------------------------------------------------------


def ceilings(quick: bool) -> dict:
    n = (1 if quick else 4) * 2**30 // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = cuda_ms(lambda: dst.copy_(src), 10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = cuda_ms(lambda: a @ b, 10)
    out = {"copy_bandwidth_gbs": 2 * src.numel() * 2 / copy_ms / 1e6, "bf16_matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}
    log(f"ceilings: copy {out['copy_bandwidth_gbs']:.0f} GB/s, bf16 matmul {out['bf16_matmul_tflops']:.0f} TFLOP/s")
    return out


def weight_bytes(llm) -> int:
    """Bytes a decode step reads: every linear layer (the LM head included) and the norms."""
    model = llm.engine.runner.model
    norms = [model.norm] + [t for layer in model.layers for t in (layer.input_norm, layer.post_attn_norm)]
    return sum(lin.nbytes for lin in model.linears) + sum(t.numel() * t.element_size() for t in norms)


def linear_params(llm) -> int:
    """Parameters a prompt token multiplies through, the LM head excluded (computed for one row only)."""
    model = llm.engine.runner.model
    return sum(lin.weight.numel() for lin in model.linears) - model.lm_head.weight.numel()


def decode_case(llm, roofs: dict, quick: bool) -> dict:
    from ladle import SamplingParams

    prompt = random_prompts(1, 128, seed=1)[0]
    n = 65 if quick else 257
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    [r] = llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    engine_ms = (r.timings.last_token - r.timings.first_token) / (n - 1) * 1e3
    graphs = llm.engine.runner.graphs
    step_ms = cuda_ms(graphs.steps[1][0], 50) if graphs is not None else None
    nbytes = weight_bytes(llm)
    bound_ms = nbytes / (roofs["copy_bandwidth_gbs"] * 1e6)
    out = {"weight_bytes": nbytes, "hbm_bound_ms": bound_ms, "engine_ms_per_token": engine_ms,
           "graph_step_ms": step_ms, "engine_fraction_of_bound": bound_ms / engine_ms,
           "graph_step_fraction_of_bound": None if step_ms is None else bound_ms / step_ms}
    log(f"decode: {engine_ms:.2f} ms/token end to end, {step_ms} ms the captured step alone; HBM bound "
        f"{bound_ms:.2f} ms ({out['engine_fraction_of_bound']:.0%} of it end to end)")
    return out


def prefill_case(llm, roofs: dict, quick: bool) -> dict:
    from ladle import SamplingParams

    length = 2048 if quick else 8192
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    llm.generate(random_prompts(1, length, seed=2)[0], one)  # warm-up: the kernels for these shapes
    times = []
    for seed in (3, 4, 5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(random_prompts(1, length, seed=seed)[0], one)
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[1]
    cfg = llm.engine.model_config
    flops = 2 * linear_params(llm) * length + 2 * cfg.hidden_size * cfg.vocab_size  # the LM head on one row
    flops += 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * length * (length + 1) / 2
    out = {"tokens": length, "seconds": seconds, "tflops": flops / seconds / 1e12,
           "mfu_vs_measured_matmul": flops / seconds / 1e12 / roofs["bf16_matmul_tflops"],
           "mfu_vs_datasheet": flops / seconds / 1e12 / DATASHEET_BF16_TFLOPS}
    log(f"prefill {length}: {seconds * 1e3:.0f} ms, {out['tflops']:.0f} TFLOP/s = {out['mfu_vs_measured_matmul']:.0%} "
        f"of the measured matmul rate ({out['mfu_vs_datasheet']:.0%} of the datasheet's)")
    return out


def offline_ladle(llm, prompts: list[list[int]], out_len: int) -> dict:
    from ladle import SamplingParams

    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    out = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
           "total_tok_s": (tokens + sum(map(len, prompts))) / seconds}
    log(f"offline ladle: {len(prompts)} requests in {seconds:.1f} s, {out['output_tok_s']:.0f} output tok/s")
    return out


def offline_transformers(folder: Path, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        warm = torch.tensor(prompts[:2], device="cuda")
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                 min_new_tokens=out_len, **kwargs)
            tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
            log(f"  transformers: {i + len(ids)}/{len(prompts)} requests, {time.perf_counter() - start:.1f} s")
        seconds = time.perf_counter() - start
    del model
    out = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds, "batch": batch,
           "total_tok_s": (tokens + sum(map(len, prompts))) / seconds}
    log(f"offline transformers: {seconds:.1f} s, {out['output_tok_s']:.0f} output tok/s (batches of {batch})")
    return out


def serve_case(folder: Path, out_dir: Path, levels: list[tuple[int, int]], engine_flags: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "ladle.cli", "serve", str(folder), "--port", str(port), *engine_flags,
           "--served-model-name", "llama-3.1-8b-shape", "--uvicorn-log-level", "warning", "--no-webui"]
    runs = {}
    with running_server(cmd, None, port, out_dir / "serve.log", timeout_s=300) as base:
        for concurrency, prompts in levels:
            name = f"serve-c{concurrency}.json"
            bench = [sys.executable, "-m", "ladle.cli", "bench", "serve", "--base-url", base, "--dataset", "random",
                     "--input-len", "1000", "--output-len", "200", "--num-prompts", str(prompts),
                     "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
                     "--goodput", f"ttft:{SLO['ttft']:.0f}", f"tpot:{SLO['tpot']:.0f}", "--percentiles", "50,99",
                     "--disable-tqdm", "--save-result", "--result-dir", str(out_dir / "serve"),
                     "--result-filename", name]
            log(f"serve: concurrency {concurrency}, {prompts} requests")
            done = subprocess.run(bench, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"ladle bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            r = json.loads((out_dir / "serve" / name).read_text())
            runs[concurrency] = {k: r.get(k) for k in (
                "completed", "failed", "duration", "output_throughput", "request_goodput", "good_completed",
                "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "mean_tpot_ms")}
            runs[concurrency]["meets_slo_p99"] = (r["p99_ttft_ms"] <= SLO["ttft"] and r["p99_tpot_ms"] <= SLO["tpot"])
            log(f"  c={concurrency}: TTFT p50/p99 {r['p50_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms, TPOT p50/p99 "
                f"{r['p50_tpot_ms']:.1f}/{r['p99_tpot_ms']:.1f} ms, {r['output_throughput']:.0f} output tok/s, "
                f"goodput {r['request_goodput']:.2f} req/s")
    return runs


def graphs_case(folder: Path, quick: bool) -> dict:
    from ladle import LLM, SamplingParams

    n = 65 if quick else 129
    prompt = random_prompts(1, 64, seed=7)[0]
    out = {}
    for eager in (True, False):
        llm = LLM(str(folder), load_format="dummy", device="cuda", dtype="bfloat16", enforce_eager=eager,
                  max_num_seqs=8, kv_cache_memory_gib=1.0)
        llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        [r] = llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
        out["eager_ms" if eager else "graphs_ms"] = (r.timings.last_token - r.timings.first_token) / (n - 1) * 1e3
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    out["speedup"] = out["eager_ms"] / out["graphs_ms"]
    log(f"graphs: batch-1 decode {out['eager_ms']:.2f} ms/token eager, {out['graphs_ms']:.2f} with CUDA graphs "
        f"({out['speedup']:.1f}x)")
    return out


# -- driver -------------------------------------------------------------------------------------------


def decode_tok_s(llm, batch: int, steps: int) -> float:
    """Output tok/s of `batch` sequences decoding together: the same prompts run for one token and for
    steps + 1, the difference being `steps` decode steps."""
    from ladle import SamplingParams

    prompts = random_prompts(batch, 128, seed=batch)
    first, more = (SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (1, steps + 1))
    llm.generate(prompts, first)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, first)
    t1 = time.perf_counter()
    llm.generate(prompts, more)
    t2 = time.perf_counter()
    return batch * steps / ((t2 - t1) - (t1 - t0))


def with_engine(folder: Path, engine: dict, fn):
    """fn(llm) on a fresh engine, freed after."""
    from ladle import LLM

    llm = LLM(str(folder), **engine)
    try:
        return fn(llm)
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def invariant_case(folder: Path, engine: dict, quick: bool) -> dict:
    steps = 16 if quick else 64
    out = {}
    for mode, flags in (("normal", {}), ("invariant", {"deterministic": True})):
        out[mode] = with_engine(folder, {**engine, **flags},
                                lambda llm: {b: decode_tok_s(llm, b, steps) for b in (64, 256)})
    out["kept"] = {b: out["invariant"][b] / out["normal"][b] for b in (64, 256)}
    log(f"invariant mode keeps {out['kept'][64]:.0%} of decode tok/s at batch 64, {out['kept'][256]:.0%} at 256")
    return out


def fp8_case(folder: Path, engine: dict, roofs: dict, prompts: list[list[int]], quick: bool) -> dict:
    out = {}
    for name, flags in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        out[name] = with_engine(folder, {**engine, **flags}, lambda llm: {
            "decode": decode_case(llm, roofs, quick), "offline": offline_ladle(llm, prompts, 200)})
    out["decode_speedup"] = out["bf16"]["decode"]["engine_ms_per_token"] / out["fp8"]["decode"]["engine_ms_per_token"]
    out["offline_speedup"] = out["fp8"]["offline"]["output_tok_s"] / out["bf16"]["offline"]["output_tok_s"]
    log(f"fp8 weights: batch-1 decode {out['decode_speedup']:.2f}x, offline {out['offline_speedup']:.2f}x bf16's")
    return out


def fp8_kv_case(folder: Path, engine: dict) -> dict:
    per_seq_tokens = 1200  # 1000 prompt + 200 output, the offline case's requests
    out = {}
    for name in ("bfloat16", "fp8"):
        info = with_engine(folder, {**engine, "kv_cache_dtype": name}, lambda llm: llm.engine.cache_config_info())
        blocks, size = int(info["num_gpu_blocks"]), int(info["block_size"])
        out[name] = {"blocks": blocks, "block_size": size, "max_sequences": blocks // -(-per_seq_tokens // size)}
    out["ratio"] = out["fp8"]["max_sequences"] / out["bfloat16"]["max_sequences"]
    log(f"fp8 KV: {out['fp8']['max_sequences']} sequences of {per_seq_tokens} tokens against bf16's "
        f"{out['bfloat16']['max_sequences']} ({out['ratio']:.2f}x)")
    return out


def device_facts() -> dict:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    import triton

    return {"gpu": torch.cuda.get_device_name(0), "nvidia_smi": smi.stdout.strip(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_case(results: dict, name: str, fn, save=None) -> None:
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # one case failing must not lose the others' figures
        traceback.print_exc()
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    log(f"{name} took {time.perf_counter() - start:.0f} s")
    if save is not None:
        save()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True, help="a Llama 3 tokenizer folder (tokenizer.json, ...)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", default=",".join(CASES), help=f"of {CASES + NAMED_CASES}")
    p.add_argument("--quick", action="store_true", help="smaller runs of each case (a smoke test)")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--hf-batch", type=int, default=256, help="transformers' static batch (the largest that fits)")
    p.add_argument("--serve-levels", default="1:8,32:96,128:256,256:512",
                   help="CONCURRENCY:REQUESTS runs of ladle bench serve")
    args = p.parse_args()
    cases = args.cases.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/ladle-gpu-bench")
    big = model_folder(work, "llama-3.1-8b-shape", LLAMA31_8B, args.tokenizer)
    small = model_folder(work, "smollm2-135m-shape", SMALL, args.tokenizer)
    results: dict = {"device": device_facts(), "quick": args.quick}

    def save() -> None:  # after every case: a run cut short keeps what it measured
        (args.out / "gpu.json").write_text(json.dumps(results, indent=1, default=str))

    log(f"on {results['device']['gpu']} ({results['device']['nvidia_smi']}), torch {torch.__version__}")
    roofs = {"copy_bandwidth_gbs": 4300.0, "bf16_matmul_tflops": 790.0}  # KINDS.md's readings, until measured
    if "ceilings" in cases:
        run_case(results, "ceilings", lambda: ceilings(args.quick), save)
        roofs = results["ceilings"] if "error" not in results["ceilings"] else roofs
    engine = dict(load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=256,
                  max_num_batched_tokens=8192, max_model_len=10240, enable_prefix_caching=False)
    requests = min(64, args.requests) if args.quick else args.requests
    prompts = random_prompts(requests, 1000, seed=9)
    if {"decode", "prefill", "offline"} & set(cases):
        from ladle import LLM

        start = time.perf_counter()
        llm = LLM(str(big), **engine)
        results["engine_start_s"] = time.perf_counter() - start
        results["kv_cache"] = llm.engine.cache_config_info()
        log(f"engine up in {results['engine_start_s']:.0f} s: {llm.engine.runtime_info()}; {results['kv_cache']}")
        for name, fn in (("decode", lambda: decode_case(llm, roofs, args.quick)),
                         ("prefill", lambda: prefill_case(llm, roofs, args.quick)),
                         ("offline", lambda: {"ladle": offline_ladle(llm, prompts, 200)})):
            if name in cases:
                run_case(results, name, fn, save)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if "offline" in cases and "error" not in results.get("offline", {}):
        run_case(results["offline"], "transformers",
                 lambda: offline_transformers(big, prompts, 200, min(args.hf_batch, requests)), save)
        off = results["offline"]
        if "error" not in off["transformers"]:
            off["speedup"] = off["ladle"]["output_tok_s"] / off["transformers"]["output_tok_s"]
        gc.collect()
        torch.cuda.empty_cache()
    if "serve" in cases:
        flags = ["--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16", "--max-num-seqs", "256",
                 "--max-num-batched-tokens", "8192", "--max-model-len", "10240"]
        levels = [tuple(int(x) for x in level.split(":")) for level in args.serve_levels.split(",")]
        run_case(results, "serve", lambda: serve_case(big, args.out, levels, flags), save)
    if "graphs" in cases:
        run_case(results, "graphs", lambda: graphs_case(small, args.quick), save)
    if "invariant" in cases:
        run_case(results, "invariant", lambda: invariant_case(big, engine, args.quick), save)
    if "fp8" in cases:
        run_case(results, "fp8", lambda: fp8_case(big, engine, roofs, prompts, args.quick), save)
    if "fp8_kv" in cases:
        run_case(results, "fp8_kv", lambda: fp8_kv_case(big, engine), save)
    save()
    table = summary(results)
    (args.out / "gpu.md").write_text(table)
    print(table, flush=True)


def summary(r: dict) -> str:
    def get(*keys, fmt="{:.2f}"):
        v = r
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return "-" if v is None else fmt.format(v) if not isinstance(v, str) else v

    lines = [f"## ladle on {r['device']['gpu']} ({r['device']['nvidia_smi']}; torch {r['device']['torch']}, "
             f"triton {r['device']['triton']})", "", "| case | figure | target |", "|---|---|---|",
             f"| roofs | copy {get('ceilings', 'copy_bandwidth_gbs', fmt='{:.0f}')} GB/s, bf16 matmul "
             f"{get('ceilings', 'bf16_matmul_tflops', fmt='{:.0f}')} TFLOP/s | |",
             f"| batch-1 decode | {get('decode', 'engine_ms_per_token')} ms/token end to end "
             f"({get('decode', 'engine_fraction_of_bound', fmt='{:.0%}')} of the HBM bound "
             f"{get('decode', 'hbm_bound_ms')} ms); captured step {get('decode', 'graph_step_ms')} ms "
             f"({get('decode', 'graph_step_fraction_of_bound', fmt='{:.0%}')}) | >= 80% |",
             f"| offline 512 x (1000 in, 200 out) | ladle {get('offline', 'ladle', 'output_tok_s', fmt='{:.0f}')} "
             f"output tok/s, transformers {get('offline', 'transformers', 'output_tok_s', fmt='{:.0f}')}: "
             f"{get('offline', 'speedup', fmt='{:.1f}')}x | >= 5x |",
             f"| prefill {get('prefill', 'tokens', fmt='{}')} tokens | {get('prefill', 'seconds', fmt='{:.3f}')} s, "
             f"{get('prefill', 'tflops', fmt='{:.0f}')} TFLOP/s: MFU {get('prefill', 'mfu_vs_measured_matmul', fmt='{:.0%}')}"
             f" of measured ({get('prefill', 'mfu_vs_datasheet', fmt='{:.0%}')} of datasheet) | >= 50% |",
             f"| graphs, small model batch-1 | eager {get('graphs', 'eager_ms')} ms, graphs {get('graphs', 'graphs_ms')}"
             f" ms: {get('graphs', 'speedup', fmt='{:.1f}')}x | >= 2x |"]
    for c, run in (r.get("serve") or {}).items():
        if isinstance(run, dict) and "p99_ttft_ms" in run:
            lines.append(f"| serve c={c} | TTFT p50/p99 {run['p50_ttft_ms']:.0f}/{run['p99_ttft_ms']:.0f} ms, TPOT "
                         f"p50/p99 {run['p50_tpot_ms']:.1f}/{run['p99_tpot_ms']:.1f} ms, "
                         f"{run['output_throughput']:.0f} tok/s, goodput {run['request_goodput']:.2f} req/s | "
                         f"p99 SLO {'met' if run['meets_slo_p99'] else 'missed'} |")
    if "kept" in (r.get("invariant") or {}):
        lines.append(f"| invariant mode (every request canonical) | {r['invariant']['kept'][64]:.0%} of normal decode "
                     f"tok/s at batch 64, {r['invariant']['kept'][256]:.0%} at 256 | >= 80% at 64 |")
    if "decode_speedup" in (r.get("fp8") or {}):
        lines.append(f"| fp8 weights | batch-1 decode {r['fp8']['decode_speedup']:.2f}x bf16, offline "
                     f"{r['fp8']['offline_speedup']:.2f}x | |")
    if "ratio" in (r.get("fp8_kv") or {}):
        lines.append(f"| fp8 KV | {r['fp8_kv']['fp8']['max_sequences']} sequences of 1200 tokens against bf16's "
                     f"{r['fp8_kv']['bfloat16']['max_sequences']} ({r['fp8_kv']['ratio']:.2f}x) | |")
    errors = [f"- {name}: {v['error']}" for name, v in r.items() if isinstance(v, dict) and "error" in v]
    return "\n".join(lines + ([""] + errors if errors else [])) + "\n"


if __name__ == "__main__":
    main()
