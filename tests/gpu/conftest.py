"""GPU tests: tiny random models built by transformers, served by ladle on CUDA and compared with
transformers on the same GPU in bf16. Every module here is marked `cuda` (deselected without a GPU).

The tokenizer comes from LADLE_GPU_TOKENIZER (the device machine has no network and no embedded
SmolLM2 package: benchmarks/gpu/fetch.sh makes a Llama 3 tokenizer folder that travels with the
check), else from the embedded default model.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from tiny_models import build_tiny_model

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    env = os.environ.get("LADLE_GPU_TOKENIZER")
    return Path(env) if env else request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="session")
def vocab_size(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, vocab_size: int) -> dict[str, Path]:
    """One tiny random checkpoint per architecture, in a vocabulary the tokenizer covers."""
    root = tmp_path_factory.mktemp("gpu-tiny")
    return {arch: build_tiny_model(arch, root / arch, tokenizer_dir, vocab_size=vocab_size) for arch in ARCHS}


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """Engines hold KV pools on the GPU: drop each test's before the next."""
    yield
    gc.collect()
    torch.cuda.empty_cache()
