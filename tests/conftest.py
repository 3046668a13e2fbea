"""Shared, slow-to-build fixtures: the converted default model, transformers' own GGUF load of it,
one ladle server for the whole session, one for the labelled-set CLI tests, and a pool of offline
engines."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Under pytest-xdist (`make test` runs one worker per core), each worker computes on its share of the
# cores: one thread each, not every worker spreading over all of them (set before torch is imported).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))
# Triton's interpreter computes tl.dot with np.matmul. OpenBLAS's Haswell sgemm kernel (what numpy picks
# on AVX2-only CPUs) rounds an element differently by where its row or column sits in the tile, which a
# GPU's MMA never does, so the kernels' bit-for-bit batch invariance would fail there for numpy's sake.
# The Sandybridge kernel sums every element the same way wherever it sits, on any AVX CPU (read when
# numpy loads OpenBLAS: before torch is imported).
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import openai
import pytest
import torch
from xdist.scheduler import LoadFileScheduling
from server_utils import (
    LABELLED_KV_BLOCKS, MODEL, NUM_KV_BLOCKS, Server, ServerThread, every_nth_example, own_server,
)
from tiny_models import build_tiny_model

from ladle import LLM
from ladle.config import EngineConfig
from ladle.engine.async_engine import AsyncEngine
from ladle.engine.engine import LLMEngine
from ladle.model.kernels import loader
from ladle.model.kernels.native import NativeKernels
from ladle.model.loader import GROUPED_SUFFIXES, cache_dir, default_gguf_path, gguf_cache_path, resolve_model_path
from ladle.server.app import create_app

# References are float32 (transformers, float64): the suite computes in float32 whatever `auto`
# would pick on this CPU; tests of other dtypes ask for them by name.
os.environ.setdefault("LADLE_DTYPE", "float32")
# Without a GPU, Triton kernels run on the CPU under Triton's interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import skip_repeated_patching

    skip_repeated_patching()


# The labelled-set CLI modules share one labelled server (and its prefix cache): one worker runs them all.
LABELLED_MODULES = ("tests/test_calibrate_check.py", "tests/test_calibrate_cli.py", "tests/test_heads_cli.py")
TEST_SECONDS = "ladle/test_seconds"  # each test's time in its last run (setup, call, teardown), in pytest's cache
TEST_CPU_SECONDS = "ladle/test_cpu_seconds"  # and the CPU it took: see cpu_seconds
test_seconds: dict[str, float] = {}
test_cpu_seconds: dict[str, float] = {}


def scope_of(nodeid: str) -> str:
    """What one worker runs whole: the test's module, or the labelled-set modules together."""
    module = nodeid.split("::", 1)[0]
    return LABELLED_MODULES[0] if module in LABELLED_MODULES else module


class ModuleScheduling(LoadFileScheduling):
    """pytest-xdist's --dist loadfile (each module on one worker, so its fixtures are built once), with
    the labelled-set modules as one scope, handed out in the collection's order: the longest first (see
    `order_longest_scopes_first`), not xdist's order by number of tests, which left a long module to end
    the run on one worker while the other idled."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> ModuleScheduling:
    return ModuleScheduling(config, log)


def order_longest_scopes_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest processing time first: a scope's cost is its collected tests' times in their last run
    (pytest's cache), so a run of a few tests leaves the others' times as they were; where none is
    timed yet (a fresh clone), scopes with `slow` tests (processes, end-to-end fits) go first."""
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    last_run = cache.get(TEST_SECONDS, {}) if cache else {}
    seconds: dict[str, float] = {}
    slow: set[str] = set()
    for item in items:
        scope = scope_of(item.nodeid)
        seconds[scope] = seconds.get(scope, 0.0) + last_run.get(item.nodeid, 0.0)
        if "slow" in item.keywords:
            slow.add(scope)

    def cost(item: pytest.Item) -> tuple[float, bool]:
        scope = scope_of(item.nodeid)
        return seconds[scope], scope in slow

    items.sort(key=cost, reverse=True)  # stable: a module's tests keep their order


def cpu_seconds() -> float:
    """CPU this process and its finished child processes (servers, benchmark scripts, ranks) have used.
    On 2 cores the suite is CPU-bound (its workers share them), so a test's CPU, not its time, is what
    it adds to the run's length."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Each phase's report (setup, call, teardown) carries the CPU used since the last one ended."""
    outcome = yield
    now = cpu_seconds()
    outcome.get_result().user_properties.append(("cpu_seconds", now - getattr(item, "_cpu_mark", now)))
    item._cpu_mark = now


def pytest_runtest_setup(item: pytest.Item) -> None:
    item._cpu_mark = cpu_seconds()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    test_seconds[report.nodeid] = test_seconds.get(report.nodeid, 0.0) + report.duration
    cpu = dict(report.user_properties).get("cpu_seconds", 0.0)
    test_cpu_seconds[report.nodeid] = test_cpu_seconds.get(report.nodeid, 0.0) + cpu


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controller (or a run without workers) keeps each test's time for the next run's order, and
    its CPU for `pytest_terminal_summary`."""
    cache = getattr(session.config, "cache", None)
    if cache is None or hasattr(session.config, "workerinput") or not test_seconds:
        return
    cache.set(TEST_SECONDS, cache.get(TEST_SECONDS, {}) | test_seconds)
    cache.set(TEST_CPU_SECONDS, cache.get(TEST_CPU_SECONDS, {}) | test_cpu_seconds)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The modules that took the most CPU: where to look when `make test` nears its 15 minutes."""
    if hasattr(config, "workerinput") or not test_cpu_seconds:
        return
    modules: dict[str, float] = {}
    for nodeid, cpu in test_cpu_seconds.items():
        module = nodeid.split("::", 1)[0]
        modules[module] = modules.get(module, 0.0) + cpu
    top = sorted(modules.items(), key=lambda m: -m[1])[:8]
    terminalreporter.write_line(f"CPU seconds (tests and the processes they started): {sum(modules.values()):.0f}; "
                                + ", ".join(f"{Path(m).stem} {cpu:.0f}" for m, cpu in top))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need an NVIDIA GPU: deselected where torch sees none (CI has none; they run on
    the device machine through benchmarks/gpu_check.sh). Tests marked `gate` time the performance gate
    and want the machine to themselves: they run only when asked for (`-m gate`, as .ci/run does after
    the suite). The rest run longest first."""
    left_out = []
    if not torch.cuda.is_available():
        left_out.append("cuda")
    if "gate" not in (config.getoption("markexpr") or ""):
        left_out.append("gate")
    for marker in left_out:
        dropped = [item for item in items if marker in item.keywords]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if marker not in item.keywords]
    order_longest_scopes_first(config, items)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, converted once per machine into the ladle cache (LADLE_CACHE_DIR, else
    ~/.cache/ladle), as a user's first start converts it; the kernels are built there once per machine
    too. The cache is keyed by the GGUF's content and the converter's version, the kernels by their
    sources and flags, so neither goes stale; tests/test_loader.py and tests/test_kernels.py convert and
    build into fresh folders of their own."""
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def smollm2_float_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted default model with only its float weights (no GGUF blocks): a float checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("smollm2-float")
    for f in smollm2_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).symlink_to(f)
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(GROUPED_SUFFIXES)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both kernel paths: the native kernels (canonical matmul, row-invariant attention), and
    torch without them (fixed-shape matmul calls, block-aligned attention tiles)."""
    if request.param == "torch":
        monkeypatch.setenv("LADLE_NATIVE_KERNELS", "0")
    loader.reset()
    yield request.param
    monkeypatch.undo()
    loader.reset()


@pytest.fixture(params=loader.supported_isas())
def isa_kernels(request, monkeypatch: pytest.MonkeyPatch) -> Iterator[NativeKernels]:
    """The native kernels built for each instruction set this CPU runs (LADLE_ISA forces each)."""
    if not loader.enabled():
        pytest.skip("LADLE_NATIVE_KERNELS=0 in the environment")
    monkeypatch.setenv("LADLE_ISA", request.param)
    loader.reset()
    k = loader.native_kernels()
    assert k is not None and k.isa == request.param
    yield k
    monkeypatch.undo()
    loader.reset()


def kept_reference(name: str, inputs: list[Path | str], compute: Callable[[], Any]) -> Any:
    """A reference result computed once per machine: compute()'s JSON kept in the ladle cache, keyed by
    `inputs` (files by their bytes, strings as they are), the versions of the libraries references
    come from and torch's CPU capability, so a changed input, library or capability computes it afresh."""
    import peft
    import transformers

    # torch's kernels for this CPU capability (make test-avx2 forces AVX2) round the reference their way
    key = hashlib.sha256(f"{name} torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()} "
                         f"transformers {transformers.__version__} peft {peft.__version__}".encode())
    for item in inputs:
        key.update(item.read_bytes() if isinstance(item, Path) else item.encode())
        key.update(b"\0")
    kept = cache_dir() / "test-references" / f"{name}-{key.hexdigest()[:16]}.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    result = compute()
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_name(f"{kept.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps(result))
    partial.replace(kept)  # whole or absent
    return result


def hf_reference_folder(gguf: Path) -> Path:
    """Where transformers' own load of `gguf` is kept once per machine: keyed like ladle's conversion
    (the GGUF's size and content) and by the transformers version that read it."""
    import transformers

    return cache_dir() / f"{gguf_cache_path(gguf).name}-transformers-{transformers.__version__}"


@pytest.fixture(scope="session")
def hf_smollm2():
    """(model, tokenizer) as transformers loads the default GGUF directly: the reference. Reading and
    dequantising the GGUF takes transformers ~17 s, so its result is saved (float32 safetensors: the same
    numbers, the same tokenizer and chat template) and later sessions load that in under a second."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    saved = hf_reference_folder(gguf)
    if not (saved / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        partial = saved.with_name(f"{saved.name}.partial-{os.getpid()}")
        # save_pretrained refuses a model transformers loaded from a GGUF: its weights are plain
        # float32 tensors all the same
        model.config.save_pretrained(partial)
        config = json.loads((partial / "config.json").read_text())
        del config["quantization_config"]  # {"quant_method": "gguf", "dequantize": false}: the GGUF's, not these
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(partial)
        save_model(model, str(partial / "model.safetensors"))
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(saved)  # whole or absent: another session never reads half a folder
        except OSError:  # another session saved it first
            shutil.rmtree(partial)
    # every session, the first included, takes the reference from the saved folder: one path for all
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(saved)


# what picks an engine's kernels and dtype besides its arguments
ENGINE_ENVIRONMENT = ("LADLE_", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


class EnginePool:
    """LLMs kept across tests, keyed by model, arguments and the environment that picks their kernels:
    tests that build the same engine share one. `get` hands it over idle, with an empty prefix cache.
    Its counters (stats, prefix-cache queries and hits) run on from user to user, to be read as
    differences, and so does its random stream for unseeded sampling: users send greedy, seeded or
    scoring requests. Same arguments, same instance: a test wanting two such engines at once builds the
    second itself. Once `size` are kept, the least recently used goes."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.llms: OrderedDict[str, LLM] = OrderedDict()

    def get(self, model: Path | str, **engine_args: Any) -> LLM:
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENGINE_ENVIRONMENT))
        key = repr((str(model), sorted(engine_args.items()), env))
        llm = self.llms.pop(key, None)
        if llm is not None and llm.engine.has_unfinished_requests():  # left mid-request by a failed test
            llm.engine.close()
            llm = None
        if llm is None:
            llm = LLM(str(model), **engine_args)
        self.llms[key] = llm
        while len(self.llms) > self.size:
            self.llms.popitem(last=False)[1].engine.close()
        assert llm.engine.reset_prefix_cache()
        return llm

    def close(self) -> None:
        while self.llms:
            self.llms.popitem()[1].engine.close()


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[EnginePool]:
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def async_engine() -> Iterator[AsyncEngine]:
    """The default model with a small KV pool, shared by every server test."""
    engine = AsyncEngine(LLMEngine(EngineConfig(num_kv_blocks=NUM_KV_BLOCKS)))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server(async_engine: AsyncEngine) -> Iterator[Server]:
    thread = ServerThread(create_app(async_engine, MODEL)).start()
    yield Server(thread.url, async_engine)
    thread.stop()


@pytest.fixture(scope="session")
def labelled_server() -> Iterator[Server]:
    """One server for the labelled-set CLI tests (calibrate check, calibrate fit, heads fit), its pool
    large enough to keep every example's rendered decision cached: after the first of them, the others
    find the tickets' prompts in the prefix cache (bit for bit what computing them gives: decisions are
    canonical). A test that needs a cold cache resets it (POST /reset_prefix_cache)."""
    with own_server(EngineConfig(num_kv_blocks=LABELLED_KV_BLOCKS)) as s:
        yield s


@pytest.fixture(scope="session")
def labelled_examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tickets labelled set, every other example of each split (112 to fit, 48 held out), for the
    end-to-end calibration fit on the labelled server (test_calibrate_cli)."""
    return every_nth_example(tmp_path_factory.mktemp("labelled"), 2)


@pytest.fixture(scope="session")
def labelled_quarter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every fourth example of each split (56 to fit, 24 held out) for the head fit (test_heads_cli),
    which reads each prompt's hidden states twice more (fit, then served): a subset of
    labelled_examples, so its decisions are found in the labelled server's prefix cache."""
    return every_nth_example(tmp_path_factory.mktemp("labelled-quarter"), 4)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    """The `openai` SDK against the shared server."""
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    yield c
    c.close()


VOCAB = 64  # the SmolLM2 tokenizer's first 64 ids: 17 special tokens, then "!" .. "O"
Tiny = tuple[Path, Any]  # the checkpoint folder, and transformers' float64 load of it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Tiny:
    """A tiny random Llama with a 64-token vocabulary: many samples per token (sampling tests)."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny_model("llama", tmp_path_factory.mktemp("tiny64"), smollm2_dir, vocab_size=VOCAB)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


@pytest.fixture(scope="session")
def lora_adapters(hf_smollm2, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random LoRA adapters over the default model, saved by peft (tests/lora_adapters.py), by name."""
    from lora_adapters import ADAPTERS, build_adapter

    base, _ = hf_smollm2
    root = tmp_path_factory.mktemp("adapters")
    return {name: build_adapter(base, root / name, seed, **args) for seed, (name, args) in enumerate(ADAPTERS.items())}
