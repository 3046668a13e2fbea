"""Convert a GGUF file, once, into a Hugging Face style model folder (float32 safetensors). Linear
weights held in Q8_0 / Q4_0 / Q4_1 blocks are also kept as they are (grouped int8, NAME.qweight,
.qscales, .qmins: ladle.model.gguf_blocks), so the engine can serve them quantised."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize
from safetensors.torch import save_file

from ladle.model import gguf_blocks
from ladle.model.gguf_file import GGUFFile, GGUFTensor, read_gguf
from ladle.model.loader import GROUPED_SUFFIXES

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SHARD_BYTES = 2 << 30  # float32 shards of about 2 GiB keep peak memory low on big models

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors HF models do not keep (rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute`, which interleaves the two rotary halves of each head."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def _f32(x: float) -> float:
    # GGUF stores float32; print it as the shortest decimal (1e-05, not 9.999999747378752e-06)
    return float(str(np.float32(x)))


def _llama3_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Recover Llama 3.x rope_scaling from llama.cpp's baked rope_freqs tensor, checking the usual params."""
    factor = float(freqs.max())
    cand = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expect = np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return cand if np.allclose(expect, freqs, rtol=1e-3) else None


def gguf_config(reader: GGUFFile) -> dict[str, Any]:
    """The HF config.json dict for a llama / qwen2 / qwen3 GGUF file."""
    arch = _meta(reader, "general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; ladle converts {', '.join(HF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}

    def a(key: str, default: Any = None) -> Any:
        return _meta(reader, f"{arch}.{key}", default)

    heads = int(a("attention.head_count"))
    kv_heads = a("attention.head_count_kv", heads)
    kv_heads = int(max(kv_heads) if isinstance(kv_heads, list) else kv_heads)
    hidden = int(a("embedding_length"))
    # shapes are authoritative: GGUF dims are [in, out]
    head_dim = int(tensors["blk.0.attn_q.weight"].shape[1]) // heads
    vocab = int(tensors["token_embd.weight"].shape[1])
    theta = _f32(a("rope.freq_base", 10000.0))

    rope_scaling = None
    kind = a("rope.scaling.type")
    if kind in ("linear", "yarn"):
        rope_scaling = {"rope_type": kind, "factor": _f32(a("rope.scaling.factor", 1.0))}
        if (orig := a("rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    elif kind not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {kind!r}")
    if "rope_freqs.weight" in tensors:
        freqs = dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        rope_scaling = _llama3_scaling(np.asarray(freqs, np.float64).reshape(-1), head_dim, theta)
        if rope_scaling is None:
            raise ValueError("GGUF rope_freqs tensor does not match Llama 3 rope scaling; cannot convert")

    eos = [_meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    cfg: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(a("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    return cfg


def _hf_tensor(t: GGUFTensor, cfg: dict[str, Any]) -> torch.Tensor:
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    w = w.reshape(_hf_shape(t))
    # a copy: F32 data is a read-only mmap view
    return torch.from_numpy(np.array(_unpermuted(w, t.name, cfg), dtype=np.float32, order="C"))


def _hf_shape(t: GGUFTensor) -> list[int]:
    return [int(d) for d in reversed(t.shape.tolist())]  # GGUF dims are reversed numpy dims


def _unpermuted(rows: np.ndarray, gguf_name: str, cfg: dict[str, Any]) -> np.ndarray:
    """llama.cpp's q/k row order undone (llama only); any per-row array (weights, scales)."""
    if cfg["model_type"] == "llama" and re.search(r"\.attn_[qk]\.", gguf_name):
        n_head = cfg["num_attention_heads"] if ".attn_q." in gguf_name else cfg["num_key_value_heads"]
        return unpermute_qk(rows, n_head)
    return rows


def _grouped_tensors(t: GGUFTensor, name: str, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A linear weight's quantised blocks as NAME.qweight / .qscales (/ .qmins), exactly
    (ladle.model.gguf_blocks); the loader turns them back into one grouped weight."""
    rows, cols = _hf_shape(t)
    parts = gguf_blocks.unpack(t.data, t.tensor_type, rows, cols)
    base = name.removesuffix(".weight")
    out = {}
    for suffix, a in zip(GROUPED_SUFFIXES, parts):  # values, scales, minimums
        if a is not None:
            out[base + suffix] = torch.from_numpy(np.ascontiguousarray(_unpermuted(a, t.name, cfg)))
    return out


def _is_linear(gguf_name: str) -> bool:
    return gguf_name == "output.weight" or (_LAYER_RE.match(gguf_name) is not None and "_norm" not in gguf_name
                                           and gguf_name.endswith(".weight"))


def _hf_tensors(t: GGUFTensor, name: str, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What the converted folder holds for one GGUF tensor: its float values (so the folder stays one
    transformers loads), and a linear weight's blocks as they are (a tied embedding's as the LM head's)."""
    out = {name: _hf_tensor(t, cfg)}
    if t.tensor_type in gguf_blocks.GROUPED_TYPES:
        if _is_linear(t.name):
            out.update(_grouped_tensors(t, name, cfg))
        elif t.name == "token_embd.weight" and cfg["tie_word_embeddings"]:
            out.update(_grouped_tensors(t, "lm_head.weight", cfg))
    return out


def _write_weights(reader: GGUFFile, cfg: dict[str, Any], out: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        if size > 0 and size + int(t.n_elements) * 4 > SHARD_BYTES:
            _flush_shard(shards, out)
            shards.append({})
            size = 0
        shards[-1].update(_hf_tensors(t, name, cfg))
        size += int(t.n_elements) * 5  # float32, and maybe a byte of blocks
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    _flush_shard(shards, out)
    n = len(shards)
    weight_map = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.rename(out / f"shard-{i}.safetensors", out / final)
        weight_map.update({k: final for k in names})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _flush_shard(shards: list[dict[str, torch.Tensor]], out: Path) -> None:
    # write the last shard and keep only its names, so its tensors can be freed
    i = len(shards) - 1
    save_file(shards[i], str(out / f"shard-{i}.safetensors"), metadata={"format": "pt"})
    shards[i] = dict.fromkeys(shards[i])  # type: ignore[arg-type]


def _write_tokenizer(gguf_path: Path, out: Path, model_type: str) -> None:
    # heavy import, only at conversion time
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    # the class AutoTokenizer picks for this model type, named here: given only the GGUF, AutoTokenizer
    # would first parse the whole file again (vocabulary included) for the config that names it
    tokenizer_class = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    tok = tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))


def _clean_stale_partials(out_dir: Path) -> None:
    for p in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        try:
            os.kill(int(p.name.rsplit("-", 1)[1]), 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass  # alive, owned by someone else


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write config.json, model.safetensors and the tokenizer files for `gguf_path` into `out_dir`.

    Work happens in a hidden sibling folder renamed into place at the end, so a killed conversion
    never leaves a half-written `out_dir`. Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_partials(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        reader = read_gguf(gguf_path)
        cfg = gguf_config(reader)
        _write_weights(reader, cfg, tmp)
        del reader
        _write_tokenizer(gguf_path, tmp, cfg["model_type"])
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        # config.json last: its presence marks a complete folder
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
