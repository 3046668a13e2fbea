"""Runtime tokenizer: the `tokenizers` backend plus the chat template, without importing transformers."""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _parse(path: Path) -> _Backend:
    stat = os.stat(path)
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _parsed(path: str, mtime_ns: int, size: int) -> _Backend:
    """tokenizer.json parsed once per version of the file (~0.1 s for a 49k vocabulary): the engines of
    one process (tests, data-parallel replicas, a draft model) share the backend, which ladle never changes."""
    return _Backend.from_file(path)


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json holds special tokens as plain strings or as AddedToken dicts
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in some templates): render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # like transformers: no HTML escaping, unlike jinja's built-in tojson
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    def __init__(self, backend: _Backend, tokenizer_config: dict[str, Any] | None = None,
                 chat_template: str | None = None, extra_eos_ids: list[int] | None = None) -> None:
        self.backend = backend
        cfg = tokenizer_config or {}
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        # the strings templates see as bos_token, eos_token, ... (transformers' special_tokens_map)
        self.special_tokens = {
            k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (s := _token_str(cfg.get(k))) is not None
        }
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None
        eos = self.special_tokens.get("eos_token")
        eos_ids = set(extra_eos_ids or [])
        if eos and (eos_id := backend.token_to_id(eos)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: set[int] = eos_ids
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template or CHATML_TEMPLATE)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = _parse(folder / "tokenizer.json")
        cfg = _read_json(folder / "tokenizer_config.json")
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        eos = _ids(_read_json(folder / "config.json").get("eos_token_id"))
        eos += _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        return cls(backend, cfg, template, eos)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False, keep_last: int | None = None) -> list[int]:
        """keep_last: at most that many tokens, the text's last ones; the special tokens added around
        the text are kept and count among them (transformers' truncation, truncation_side="left")."""
        ids = self._encode(text, add_special_tokens)
        if keep_last is None or len(ids) <= keep_last:
            return ids
        if not add_special_tokens:
            return ids[len(ids) - keep_last :]
        content = self._encode(text, False)
        start = next(i for i in range(len(ids) - len(content) + 1) if ids[i : i + len(content)] == content)
        head, tail = ids[:start], ids[start + len(content) :]
        room = max(keep_last - len(head) - len(tail), 0)
        return head + content[len(content) - room :] + tail

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render the conversation as the prompt text, as transformers' apply_chat_template(tokenize=False)."""
        # like transformers: drop keys set to None (OpenAI clients send content=None with tool calls)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        kwargs = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time (vLLM's prefix/read offset technique).

    Text is only emitted once it is complete: a UTF-8 character split over several byte tokens comes
    out whole, with the token that completes it. Seeding with the prompt ids gives the decoder the
    context it needs for leading spaces (SentencePiece drops the space of a sequence's first piece).
    """

    CONTEXT = 5  # prompt tokens kept as decoding context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prompt = list(prompt_ids or [])[-self.CONTEXT:]
        self.ids: list[int] = prompt
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] is context already emitted
        self.read_offset = len(prompt)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of generation: whatever is still pending, even an incomplete character (as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        new = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new
