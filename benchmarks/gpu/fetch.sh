#!/usr/bin/env bash
# Fills .gpu/ (git-ignored) with what the GPU machine, which has no network, needs beyond its image:
#   .gpu/wheels/           the wheels named in benchmarks/gpu/wheels.txt (cp312 manylinux x86_64 or pure
#                          Python; --no-deps, so the list names every dependency the image lacks)
#   .gpu/llama3-tokenizer/ a real Llama 3 tokenizer (128256 tokens) in Hugging Face form, made from the
#                          vocab-only GGUF that llama.cpp ships inside the llama-cpp-python sdist
# Run where PyPI is reachable, from the repo root:   bash benchmarks/gpu/fetch.sh
# Needs: python3 with pip (downloads), and this repo's .venv (transformers and gguf, to convert the vocab).
# On the GPU machine (the run tool's carry must name .gpu, an ignored path):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .gpu/wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PIP_PY=${PIP_PY:-python3}                 # any python with pip; it only downloads
VENV_PY=${VENV_PY:-$PWD/.venv/bin/python} # transformers + gguf + tokenizers, for the tokenizer
LLAMA_CPP_PYTHON=0.3.36                   # whose sdist vendors llama.cpp/models/ggml-vocab-llama-bpe.gguf
GGUF_NAME=ggml-vocab-llama-bpe.gguf
OUT=.gpu
WHEELS=$OUT/wheels
TOKENIZER=$OUT/llama3-tokenizer

# ---------------------------------------------------------------- wheels
mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' benchmarks/gpu/wheels.txt | grep -v '^$')
echo "== ${#PINS[@]} wheels into $WHEELS"
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
"$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$WHEELS" "${PINS[@]}"
# exactly one wheel per pin, each cp312 or pure Python, for x86_64 or any platform
n=$(find "$WHEELS" -name '*.whl' | wc -l)
if [ "$n" -ne "${#PINS[@]}" ]; then
    echo "fetch.sh: expected ${#PINS[@]} wheels, got $n" >&2
    exit 1
fi
for w in "$WHEELS"/*.whl; do
    case "$(basename "$w")" in
        *-py3-none-any.whl | *-py2.py3-none-any.whl | *-cp312-cp312-manylinux*x86_64.whl | *-cp312-abi3-manylinux*x86_64.whl) ;;
        *) echo "fetch.sh: not a cp312/py3 x86_64 wheel: $w" >&2; exit 1 ;;
    esac
done
ls -l "$WHEELS" | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
echo "wheels: $(du -sh "$WHEELS" | cut -f1)"

# ---------------------------------------------------------------- Llama 3 tokenizer
if [ ! -x "$VENV_PY" ]; then
    echo "fetch.sh: $VENV_PY not found (make the repo's venv, or set VENV_PY)" >&2
    exit 1
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
echo "== llama-cpp-python==$LLAMA_CPP_PYTHON sdist, for $GGUF_NAME"
"$PIP_PY" -m pip download -q --no-deps --no-binary :all: -d "$TMP" "llama-cpp-python==$LLAMA_CPP_PYTHON"
SDIST=$(find "$TMP" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n 1)
# the vocab plus llama.cpp's test vectors for it (.inp texts, .out token ids from the Hugging Face tokenizer)
tar -xzf "$SDIST" -C "$TMP" --wildcards --no-anchored "vendor/llama.cpp/models/$GGUF_NAME*"
SRC=$(dirname "$(find "$TMP" -path "*/vendor/llama.cpp/models/$GGUF_NAME")")
echo "== $TOKENIZER from $GGUF_NAME ($(du -h "$SRC/$GGUF_NAME" | cut -f1))"
rm -rf "$TOKENIZER"
mkdir -p "$TOKENIZER"

# Convert with transformers' GGUF reader, then make it what meta-llama's Llama 3 tokenizer is: the
# vocabulary the file gives (transformers' converter appends an extra <|endoftext|>; dropped), BPE with
# ignore_merges, a post-processor that puts <|begin_of_text|> first (add_bos_token), and, as the file has
# no chat template, the Llama 3 / 3.1 chat format. Compact JSON keeps tokenizer.json about half its pretty size.
"$VENV_PY" - "$SRC/$GGUF_NAME" "$TOKENIZER" <<'PY'
import json
import sys
from pathlib import Path

from gguf import GGUFReader
from transformers import AutoTokenizer

src, out = Path(sys.argv[1]), Path(sys.argv[2])

# Llama 3's format (the template of Llama 3 / 3.1 Instruct without 3.1's tool and date preamble): every
# message as <|start_header_id|>role<|end_header_id|>\n\n content <|eot_id|>, after <|begin_of_text|>;
# content may be a string or OpenAI text parts; role "tool" is Llama 3.1's "ipython".
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- elif message['content'] is defined %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}\n"
    "    {{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + content | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

reader = GGUFReader(str(src))
n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
file_template = None
if "tokenizer.chat_template" in reader.fields:
    file_template = reader.fields["tokenizer.chat_template"].contents()

tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
tmp = out / "_hf"
tok.save_pretrained(str(tmp))

spec = json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8"))
dropped = [t["content"] for t in spec["added_tokens"] if t["id"] >= n_vocab]
spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < n_vocab]
bos, eos = tok.bos_token, tok.eos_token
bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == bos)
# meta-llama's Llama 3 tokenizer.json: a pre-token that is itself in the vocabulary is one token, whatever
# the merges would make of it (ignore_merges; without it " Việt" splits in three), and <|begin_of_text|> first
spec["model"]["ignore_merges"] = True
spec["post_processor"] = {
    "type": "Sequence",
    "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}},
    ],
}
(out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")

config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": bos,
    "eos_token": eos,
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,  # decode as the tokenizers library (ladle) does
    "model_input_names": ["input_ids", "attention_mask"],
    "model_max_length": 131072,
    "chat_template": file_template or tok.chat_template or LLAMA3_CHAT_TEMPLATE,
}
(out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
smap = tmp / "special_tokens_map.json"
if smap.is_file():
    smap.replace(out / smap.name)
for f in tmp.iterdir():
    f.unlink()
tmp.rmdir()
print(f"  vocabulary {n_vocab} (dropped from added tokens: {dropped}); bos {bos!r}, eos {eos!r}; chat template "
      f"{'from the file' if file_template or tok.chat_template else 'Llama 3 (written here)'}")
PY

# ---------------------------------------------------------------- checks
echo "== checks"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$VENV_PY" - "$TOKENIZER" "$SRC/$GGUF_NAME" <<'PY'
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer as Backend

folder, gguf_file = Path(sys.argv[1]), Path(sys.argv[2])

# the tokenizers library alone
t = Backend.from_file(str(folder / "tokenizer.json"))
n = t.get_vocab_size(with_added_tokens=True)
assert n == 128256, n
ids = {s: t.token_to_id(s) for s in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                                     "<|start_header_id|>", "<|end_header_id|>")}
assert ids == {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eot_id|>": 128009,
               "<|start_header_id|>": 128006, "<|end_header_id|>": 128007}, ids
text = "The quick brown fox jumps over the lazy dog: 12345, naïve café, 日本語 🦙!"
enc = t.encode(text)
assert enc.ids[0] == 128000 and enc.ids[1] != 128000, enc.ids[:3]
assert t.decode(enc.ids, skip_special_tokens=True) == text
assert t.decode(t.encode(text, add_special_tokens=False).ids) == text
print(f"  tokenizers: {n} tokens, special ids ok, round trip ok ({len(enc.ids)} ids with <|begin_of_text|>)")

# llama.cpp's test vectors for this vocabulary (token ids from the Hugging Face Llama 3 tokenizer)
inp = Path(str(gguf_file) + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
exp = Path(str(gguf_file) + ".out").read_text(encoding="utf-8").split("\n")[: len(inp)]
vectors = [(s, [int(x) for x in e.split()]) for s, e in zip(inp, exp)]
bad = [s for s, e in vectors if t.encode(s, add_special_tokens=False).ids != e]
assert len(inp) == len(exp) and len(inp) > 0 and not bad, bad[:3]
print(f"  llama.cpp's test vectors: {len(inp)}/{len(inp)} match")

# transformers
from transformers import AutoTokenizer

hf = AutoTokenizer.from_pretrained(str(folder))
assert len(hf) == 128256 and hf.bos_token == "<|begin_of_text|>" and hf.eos_token == "<|end_of_text|>"
assert hf(text)["input_ids"] == enc.ids
assert all(hf(s, add_special_tokens=False)["input_ids"] == e for s, e in vectors)
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
want = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
got = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
assert got == want, got
print(f"  transformers {__import__('transformers').__version__}: loads, same ids (test vectors too), chat template ok")

# ladle's own tokenizer
from ladle.model.tokenizer import Tokenizer

lt = Tokenizer.from_folder(folder)
assert lt.vocab_size == 128256 and lt.bos_token_id == 128000 and 128001 in lt.eos_token_ids, lt.eos_token_ids
assert lt.apply_chat_template(msgs, add_generation_prompt=True) == want
assert lt.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]) == (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n")
assert lt.encode(text, add_special_tokens=True) == enc.ids
assert lt.encode(want, add_special_tokens=False)[0] == 128000 and lt.decode(lt.encode(text)) == text
print("  ladle.model.tokenizer.Tokenizer.from_folder: vocab 128256, bos 128000, eos", sorted(lt.eos_token_ids),
      ", chat template and encode ok")
PY
ls -l "$TOKENIZER" | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
echo "tokenizer: $(du -sh "$TOKENIZER" | cut -f1)"
echo "total .gpu: $(du -sh "$OUT" | cut -f1) ($(du -sb "$OUT" | cut -f1) bytes)"
