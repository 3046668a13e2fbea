"""Every script under benchmarks/ runs: each once with --quick (one tiny case), as a subprocess, its exit
status 0 and its figures printed, so that no figure in the README comes from a script that no longer
runs. Scripts that take a model get a tiny random Llama; scripts that compare against peer servers
(vLLM, llama-server) run ladle's side alone. Those over ~10 s here are marked slow; benchmarks/gpu.py
needs an NVIDIA GPU and is marked cuda (deselected without one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


@dataclass
class Script:
    args: list[str]  # after --quick; "{model}" is the tiny model's folder, "{tmp}" the test's own folder
    figures: list[str]  # regular expressions the output must match: the figures the script exists for
    timeout: int = 300
    marks: list = field(default_factory=list)


SLOW = [pytest.mark.slow]
SCRIPTS = {
    "block_formats": Script([], [rf"\| Q4_K \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER}x \|",
                                 rf"\| int8 per row \(dot\) \| {NUMBER} \| {NUMBER}"]),
    "canonical_rows": Script([], [rf"\| 8 \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER}x \|"]),
    "deterministic": Script(["--model", "{model}"],
                            [rf"batch-1 decode: {NUMBER} ms/token with --deterministic, {NUMBER} without",
                             rf"64-token prompt: {NUMBER} s with --deterministic"]),
    "decisions": Script(["--model", "{model}", "--save", "{tmp}/decisions.json"],
                        [rf"\[ 2 questions\] \d+ prompt tokens .* ladle {NUMBER} ms .* ratio {NUMBER}x"], marks=SLOW),
    "prefix_cache": Script(["--model", "{model}", "--save", "{tmp}/prefix.json"], [r"cache on: \d+ output tokens",
                                                                                 rf"= {NUMBER} tok/s"], marks=SLOW),
    "structured": Script(["--model", "{model}"], [rf"\| 2 \| {NUMBER} \| {NUMBER} \| {NUMBER}x \|",
                                                  r"\| JSON schema \| \d+/2"], marks=SLOW),
    "throughput": Script(["--model", "{model}", "--dtype", "float32", "--cases", "uniform,steps", "--save",
                          "{tmp}/throughput.json"], [rf"ladle {NUMBER} tok/s \| transformers {NUMBER} tok/s",
                                                     r"route by rows per call: 1 \w+, 2-4 \w+, 5-16 \w+, 17-64 \w+, 65\+",
                                                     rf"\| 16 \| native loop \({NUMBER}% of steps\) \| {NUMBER} \| "
                                                     rf"{NUMBER} \| {NUMBER} \| -?{NUMBER} \| -?{NUMBER}% \| {NUMBER}x \| "
                                                     rf"{NUMBER}x \|",
                                                     rf"\| 16 \| Python \| {NUMBER} \|",
                                                     rf"Python / loop\): 1 {NUMBER}x"],
                         marks=SLOW),
    "quantisation": Script(["--models", "{model}"], [rf"\| int8 per row \| float32 \| {NUMBER} \| [0-9,]+ \| "
                                                     rf"{NUMBER} \({NUMBER}%\)"], marks=SLOW),
    "lora": Script(["--png", "{tmp}/lora.png"], [rf"4 adapters, loop\s+{NUMBER}\s+{NUMBER}",
                                                rf"adapter load .* median {NUMBER} ms"], marks=SLOW),
    "speculative": Script(["--png", "{tmp}/speculative.png"], [rf"quote\s+1 ngram k=4\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}%"], marks=SLOW),
    "parallel": Script(["--out", "{tmp}/parallel.json"], [rf"tp2\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}",
                                                          rf"moe_ep2\s+{NUMBER}"], timeout=600, marks=SLOW),
    "startup": Script([], [rf"first start \(--quick: [^)]*\): kernel build {NUMBER} s, GGUF conversion {NUMBER} s",
                           rf"LLM\(\) {NUMBER} s, ladle serve to /health {NUMBER} s"], timeout=600, marks=SLOW),
    "serve_vs_peers": Script(["--servers", "ladle:float32,vllm:float32", "--model-dir", "{model}", "--result-dir",
                              "{tmp}", "--goodput"],
                             [r"left out the peers vllm:float32", rf"\| ladle:float32 \| {NUMBER} \|",
                              rf"\| ladle:float32 \| {NUMBER} \| {NUMBER} \| {NUMBER} \| {NUMBER} \|"],
                             marks=SLOW),
    "voice": Script(["--png", "{tmp}/voice.png"], [rf"End of speech -> first token p50 \(ms\)\s+{NUMBER}\s+{NUMBER}"],
                    marks=SLOW),
    "agents": Script(["--png", "{tmp}/agents.png", "--json", "{tmp}/agents.json"],
                     [rf"re-prefilled tokens, turns 1\+: recompute {NUMBER}, offload {NUMBER}",
                      rf"short TTFT\s+policy: p50\s+{NUMBER} ms"], timeout=600, marks=SLOW),
    "calibration": Script(["--out-dir", "{tmp}"], [rf"\| temperature\s+\|\s+{NUMBER} \|",
                                                   rf"\| head \(served\)\s+\|\s+{NUMBER} \|",
                                                   rf"serving: plain {NUMBER} questions/s"], timeout=600, marks=SLOW),
    "fleet": Script(["--png", "{tmp}/fleet.png"], [rf"cache_aware\s+{NUMBER}\s+{NUMBER}x",
                                                   rf"disaggregated\s+{NUMBER}"], timeout=600, marks=SLOW),
    "hybrid": Script([], [rf"\| qwen3\.5 \| full \d+ \| \d+ \| \d+ \| {NUMBER} \| {NUMBER} \| {NUMBER} ms \|",
                          rf"\| deepseek-v3 \| latent \d+ \| 0 \|",
                          rf"qwen3\.5 / qwen3 twin: {NUMBER}x fewer KV bytes per token"], marks=SLOW),
    "long_context": Script([], [rf"\| sliding \| \d+ \| {NUMBER} \| \d+ \| \d+ \| True \|",
                                rf"sliding / full: {NUMBER}x fewer blocks per sequence, {NUMBER}x the batch"],
                           marks=SLOW),
    "images": Script([], [rf"\| on \| 4 \| {NUMBER} \| \d+ \| \d+ \| {NUMBER} \|",
                          rf"\| off \| 64 \| {NUMBER} \|",
                          rf"caching on: 4 encoder runs for 4 distinct images; {NUMBER}x the decisions/s"], marks=SLOW),
    "worker_kill": Script([], [r"silent cuts: 0; errors not in OpenAI's shape: 0",
                               r"\| chat sdk \| (done|raised) \| \d+ \|"], marks=SLOW),
    # the GPU's profile script, run here on the CPU: the same engine hooks and profiler, the CPU's ops for kernels
    "gpu_profile": Script(["--model", "{model}", "--device", "cpu", "--out", "{tmp}"],
                          [rf"### batch 4: {NUMBER} ms a step; kernels -; host ms: schedule {NUMBER}, execute "
                           rf"{NUMBER}, sample {NUMBER}, rest -?{NUMBER}", r"\| `aten::\w+` \| "]),
    # needs a GPU and a Llama 3 tokenizer (benchmarks/gpu/fetch.sh; LADLE_GPU_TOKENIZER, as gpu_check.sh sets it)
    "gpu": Script(["--tokenizer", "{gpu_tokenizer}", "--out", "{tmp}", "--cases", "graphs"],
                  [rf"\| graphs, small model batch-1 \| eager {NUMBER} ms, graphs {NUMBER} ms"], timeout=600,
                  marks=[pytest.mark.cuda]),
}


def test_every_benchmark_script_has_a_smoke_run() -> None:
    helpers = {"common", "peer_goodput"}  # modules the scripts import, not scripts
    run_elsewhere = {"gate"}  # tests/test_gate.py runs it whole, a slowdown planted
    assert sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in helpers | run_elsewhere) == sorted(SCRIPTS)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("bench-model"), smollm2_dir)


@pytest.mark.parametrize("name", [pytest.param(name, marks=s.marks) for name, s in SCRIPTS.items()])
def test_benchmark_runs_quick_and_prints_its_figures(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    script = SCRIPTS[name]
    values = {"tmp": str(tmp_path)}
    if any("{model}" in a for a in script.args):
        values["model"] = str(request.getfixturevalue("tiny_model"))
    if name == "gpu":
        tokenizer = os.environ.get("LADLE_GPU_TOKENIZER")
        if not tokenizer:
            pytest.fail("LADLE_GPU_TOKENIZER names no Llama 3 tokenizer folder (benchmarks/gpu/fetch.sh fetches one)")
        values["gpu_tokenizer"] = tokenizer
    args = [a.format(**values) for a in script.args]
    # the scripts' own environment, as a user runs them; their files go to tmp_path, none under docs/
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=script.timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for figure in script.figures:
        assert re.search(figure, done.stdout), (figure, done.stdout[-4000:])
