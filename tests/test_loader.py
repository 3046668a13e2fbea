"""GGUF conversion, model resolution, weight loading and the runtime tokenizer, checked against transformers."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize

from ladle.model.config import ModelConfig
from ladle.model.gguf import convert_gguf
from ladle.model.gguf_file import read_gguf
from ladle.model.loader import default_gguf_path, gguf_cache_path, load_weights, resolve_model_path
from ladle.model.quantization import GroupedWeight
from ladle.model.tokenizer import IncrementalDetokenizer, Tokenizer

PROMPT = "The capital of France is"


def test_default_model_resolves_and_converts(smollm2_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (smollm2_dir / name).is_file(), name
    cfg = ModelConfig.from_folder(smollm2_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim) == ("llama", 30, 576, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == [2]
    t = time.perf_counter()
    assert resolve_model_path(None) == smollm2_dir  # cached: no second conversion
    assert resolve_model_path(str(default_gguf_path())) == smollm2_dir
    assert resolve_model_path(str(smollm2_dir)) == smollm2_dir
    assert time.perf_counter() - t < 1.0
    assert not list(smollm2_dir.parent.glob(".*partial*"))


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError):
        resolve_model_path(str(tmp_path))  # folder without config.json
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError):
        resolve_model_path(str(tmp_path / "weights.bin"))


def floats(weights: dict) -> dict[str, torch.Tensor]:
    """load_weights' result with grouped (GGUF block) weights dequantised."""
    return {k: v.dequantize() if isinstance(v, GroupedWeight) else v for k, v in weights.items()}


def test_converted_weights_equal_transformers_gguf_load(smollm2_dir: Path, hf_smollm2) -> None:
    ours = load_weights(smollm2_dir)
    k_proj = ours["model.layers.0.self_attn.k_proj.weight"]  # Q4_1 blocks: int8 values, scale and min per 32
    assert isinstance(k_proj, GroupedWeight) and k_proj.shape == (192, 576) and k_proj.size == 32
    assert k_proj.mins is not None and k_proj.q.min() >= 0 and k_proj.q.max() <= 15
    lm_head = ours.pop("lm_head.weight")  # the tied embedding's Q8_0 blocks, for the LM head
    assert isinstance(lm_head, GroupedWeight) and lm_head.mins is None
    assert torch.equal(lm_head.dequantize(), ours["model.embed_tokens.weight"])
    ref = {k: v for k, v in hf_smollm2[0].state_dict().items() if k != "lm_head.weight"}
    assert ours.keys() == ref.keys()
    ours = floats(ours)
    assert all(t.dtype == torch.float32 for t in ours.values())
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


def test_converted_folder_logits_match_transformers_gguf(smollm2_dir: Path, hf_smollm2) -> None:
    from transformers import AutoModelForCausalLM

    ref, hf_tok = hf_smollm2
    ours = AutoModelForCausalLM.from_pretrained(str(smollm2_dir)).eval()
    ids = hf_tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)
        a = ours.generate(ids, max_new_tokens=12, do_sample=False)
        b = ref.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(a, b)


# --- a tiny random model written to GGUF the way llama.cpp's convert_hf_to_gguf does ---

TYPES = {"q_proj": Q.Q8_0, "k_proj": Q.F16, "v_proj": Q.Q4_1, "o_proj": Q.BF16,
         "gate_proj": Q.Q4_0, "up_proj": Q.Q8_0, "down_proj": Q.F32}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
              "down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name_and_type(hf: str) -> tuple[str, Q]:
    top = {"model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0), "model.norm.weight": ("output_norm.weight", Q.F32),
           "lm_head.weight": ("output.weight", Q.Q8_0)}
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.N.(self_attn|mlp).NAME.(weight|bias) or model.layers.N.NAME.weight
    kind = parts[-2]
    qtype = TYPES.get(kind, Q.F32) if parts[-1] == "weight" else Q.F32
    return f"blk.{parts[2]}.{GGUF_NAMES[kind]}.{parts[-1]}", qtype


@functools.cache
def _tokenizer_fields() -> dict[str, tuple]:
    """The default model's tokenizer metadata (slow to parse: read once), reused so transformers can read ours."""
    src = GGUFReader(default_gguf_path())
    return {k: (f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
            for k, f in src.fields.items() if k.startswith("tokenizer.")}


def _write_tiny_gguf(path: Path, arch: str) -> tuple[dict[str, torch.Tensor], object]:
    """Random tiny model of `arch` written as GGUF; returns the expected (dequantised) HF tensors."""
    import transformers

    cls_cfg, cls_model = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[arch]
    cfg = getattr(transformers, cls_cfg)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32 if arch == "qwen3" else 16, rms_norm_eps=1e-5, rope_theta=50000.0,
        max_position_embeddings=512, tie_word_embeddings=(arch == "qwen2"), bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = getattr(transformers, cls_model)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))

    w = GGUFWriter(str(path), arch)
    w.add_block_count(2), w.add_context_length(512), w.add_embedding_length(64), w.add_feed_forward_length(128)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(50000.0)
    w.add_rope_dimension_count(cfg.head_dim), w.add_key_length(cfg.head_dim), w.add_value_length(cfg.head_dim)
    for key, (value, vtype, sub_type) in _tokenizer_fields().items():
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    expected = {}
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, qtype = _gguf_name_and_type(hf)
        arr = t.numpy().astype(np.float32)
        # row-wise block quantisation commutes with the row permutation, so this is the exact expectation
        expected[hf] = torch.from_numpy(np.asarray(dequantize(quantize(arr, qtype), qtype), np.float32).reshape(arr.shape))
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            arr = _llama_cpp_permute(arr, 4 if "attn_q" in name else 2)
        data = quantize(arr, qtype)
        w.add_tensor(name, data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return expected, model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import ladle.model.gguf as g
    from transformers import AutoModelForCausalLM

    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    expected, model = _write_tiny_gguf(gguf_path, arch)
    if arch == "qwen3":
        monkeypatch.setattr(g, "SHARD_BYTES", 1 << 20)  # exercise the sharded output
    folder = convert_gguf(gguf_path, tmp_path / "converted")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 if arch == "qwen3" else shards == ["model.safetensors"]
    ours = load_weights(folder)
    tied = model.config.tie_word_embeddings
    in_blocks = {k for k in expected if _gguf_name_and_type(k)[1] in (Q.Q8_0, Q.Q4_0, Q.Q4_1) and "embed" not in k}
    if tied:
        in_blocks.add("lm_head.weight")
    assert {k for k, v in ours.items() if isinstance(v, GroupedWeight)} == in_blocks  # linears served from blocks
    if tied:  # the tied Q8_0 embedding's blocks serve as the LM head
        assert torch.equal(ours.pop("lm_head.weight").dequantize(), expected["model.embed_tokens.weight"])
    assert ours.keys() == expected.keys()
    for name, tensor in floats(ours).items():
        assert torch.equal(tensor, expected[name]), name
    cfg, ref_cfg = ModelConfig.from_folder(folder), model.config
    assert (cfg.model_type, cfg.head_dim, cfg.num_key_value_heads) == (arch, ref_cfg.head_dim, 2)
    assert cfg.tie_word_embeddings == ref_cfg.tie_word_embeddings and cfg.rope_theta == 50000.0
    assert cfg.attention_bias == (arch == "qwen2") and cfg.rms_norm_eps == 1e-5
    if arch != "qwen3":  # its tokenizer class is qwen2's
        _assert_tokenizer_is_transformers_own(gguf_path, folder, tmp_path / "reference-tokenizer")
    # the converted folder runs in transformers like the original model given the dequantised weights
    model.load_state_dict(expected, strict=False)
    converted = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = torch.tensor([[1, 400, 3000, 17, 9000, 42]])
    with torch.no_grad():
        assert torch.allclose(converted(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def _assert_tokenizer_is_transformers_own(gguf_path: Path, folder: Path, out: Path) -> None:
    """The converted tokenizer files are the ones AutoTokenizer writes for the GGUF itself."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (out / name).read_bytes(), name


def assert_read_as_gguf_py_reads(path: Path) -> None:
    """ladle's GGUF reader against gguf-py's GGUFReader: every key's value (type included) and every
    tensor's name, type, dims and data."""
    theirs, ours = GGUFReader(path), read_gguf(path)
    assert list(ours.metadata) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, value in ours.metadata.items():
        expected = theirs.fields[key].contents()
        assert value == expected and type(value) is type(expected), key
        if isinstance(value, list) and value:
            assert type(value[0]) is type(expected[0]), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, their in zip(ours.tensors, theirs.tensors):
        assert (mine.tensor_type, mine.shape.tolist(), mine.n_elements) == \
            (their.tensor_type, their.shape.tolist(), their.n_elements), mine.name
        assert mine.data.dtype == their.data.dtype and mine.data.shape == their.data.shape, mine.name
        assert np.array_equal(mine.data, their.data, equal_nan=True), mine.name


def test_the_gguf_reader_reads_what_gguf_py_reads(tmp_path: Path) -> None:
    assert_read_as_gguf_py_reads(default_gguf_path())  # Q4_1 and Q8_0 blocks, F32 norms, a 49k vocabulary
    path = tmp_path / "every-kind.gguf"
    w = GGUFWriter(str(path), "llama")
    for i, (kind, value) in enumerate([(GGUFValueType.UINT8, 7), (GGUFValueType.INT8, -7), (GGUFValueType.UINT16, 700),
                                       (GGUFValueType.INT16, -700), (GGUFValueType.UINT32, 7 << 20),
                                       (GGUFValueType.INT32, -7 << 20), (GGUFValueType.FLOAT32, 0.1),
                                       (GGUFValueType.BOOL, True), (GGUFValueType.STRING, "héllo"),
                                       (GGUFValueType.UINT64, 7 << 40), (GGUFValueType.INT64, -7 << 40),
                                       (GGUFValueType.FLOAT64, 0.1)]):
        w.add_key_value(f"test.scalar.{i}", value, kind)
    w.add_key_value("test.floats", [0.5, -1.25, 3.0], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    w.add_key_value("test.ints", [1, -2, 3], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    w.add_key_value("test.strings", ["a", "", "ünï"], GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    w.add_tensor("i32", rng.integers(-9, 9, (7,), dtype=np.int32))
    blocks = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", quantize(blocks, Q.Q8_0), raw_shape=quant_shape_to_byte_shape(blocks.shape, Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert_read_as_gguf_py_reads(path)


def test_conversion_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ladle.model.gguf as g

    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf_path, "llama")
    monkeypatch.setattr(g, "_write_tokenizer", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_cache_folder_follows_the_content_not_the_file_time(tmp_path: Path) -> None:
    """A reinstall (a fresh venv) copies the same GGUF with a new mtime: it reuses the converted
    folder instead of converting again into a new one; a changed file gets its own."""
    original = tmp_path / "tiny.gguf"
    _write_tiny_gguf(original, "llama")
    copy = tmp_path / "copy" / "tiny.gguf"
    copy.parent.mkdir()
    copy.write_bytes(original.read_bytes())
    os.utime(copy, ns=(10**18, 10**18))
    assert gguf_cache_path(copy) == gguf_cache_path(original)
    changed = bytearray(original.read_bytes())
    changed[-1] ^= 1
    copy.write_bytes(bytes(changed))
    assert gguf_cache_path(copy) != gguf_cache_path(original)


# --- runtime tokenizer ---

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Tell me a joke"}, {"role": "assistant", "content": "No."},
     {"role": "user", "content": "Please 🙏 café 世界"}],
]
TEXTS = ["Hello world", " leading space", "Héllo 世界! 🎉👍🏽 naïve café — ok\n\tdone", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


def test_tokenizer_basics_match_transformers(tok: Tokenizer, hf_smollm2) -> None:
    hf = hf_smollm2[1]
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    assert tok.token_to_id("<|im_end|>") == 2 and tok.id_to_token(2) == "<|im_end|>"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_smollm2, add_generation_prompt: bool) -> None:
    hf = hf_smollm2[1]
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_features_match_transformers(tok: Tokenizer, hf_smollm2) -> None:
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
        "{% generation %}[{{ m.role }}]{{ m.content | tojson }}{% endgeneration %}\n{% endfor %}"
        "{{ ns.n }} {{ tools | tojson }} {{ strftime_now('%Y') }} {{ eos_token }}{{ extra }}"
    )
    messages = [{"role": "user", "content": "<b>\"é\"</b>"}, {"role": "assistant", "content": "ok", "tool_calls": None}]
    ours = Tokenizer(tok.backend, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, template)
    expected = hf_smollm2[1].apply_chat_template(messages, chat_template=template, tokenize=False, extra="!")
    assert ours.apply_chat_template(messages, add_generation_prompt=False, extra="!") == expected
    with pytest.raises(Exception, match="bad role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_tokenizer_file_is_parsed_once_per_version(smollm2_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    first, again = Tokenizer.from_folder(tmp_path), Tokenizer.from_folder(tmp_path)
    assert again.backend is first.backend  # engines of one process share the parsed file
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": first.vocab_size, "content": "<|brand_new|>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    changed = Tokenizer.from_folder(tmp_path)  # a new version of the file is read again
    assert changed.vocab_size == first.vocab_size + 1 and changed.token_to_id("<|brand_new|>") == first.vocab_size


def test_chatml_fallback(tok: Tokenizer) -> None:
    plain = Tokenizer(tok.backend, {}, None)
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_incremental_detokenizer_multibyte(tok: Tokenizer) -> None:
    text = "Héllo 世界! 🎉👍🏽 naïve café — ok. Ελληνικά, 日本語、😀 done"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text and detok.text == text
    assert detok.flush() == ""
    assert any(p == "" for p in pieces)  # some tokens only carry part of a character


def test_incremental_detokenizer_seeded_and_special(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>assistant\nSure:")
    gen = tok.encode(" 世界 🎉 yes<|im_end|>")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out = "".join(detok.step(i) for i in gen)
    assert out == " 世界 🎉 yes"
    pending = IncrementalDetokenizer(tok)
    assert pending.step(tok.encode("🎉")[0]) == "" and "\ufffd" in pending.flush()


def test_incremental_detokenizer_seeding_keeps_sentencepiece_space() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2}, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp = Tokenizer(backend, {})
    assert IncrementalDetokenizer(sp).step(2) == "world"
    assert IncrementalDetokenizer(sp, prompt_ids=[1]).step(2) == " world"
