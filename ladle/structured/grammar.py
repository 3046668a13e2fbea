"""Constraints compiled to xgrammar grammars, once per constraint (an LRU cache), thread-safe.

xgrammar compiles a JSON schema, regex or EBNF grammar against the tokenizer's vocabulary
into a CompiledGrammar from which per-sequence matchers produce each step's token mask.
Compiling costs milliseconds to seconds (large schemas); the server does it on a worker
thread before the request reaches the engine, so the engine thread only meets cache hits.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ladle.errors import InvalidRequestError
from ladle.structured.spec import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from ladle.model.tokenizer import Tokenizer

CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: "xgrammar.GrammarCompiler | None" = None
        self._cache: OrderedDict[tuple, "xgrammar.CompiledGrammar"] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.compile_seconds = 0.0  # spent compiling (misses only)

    def compile(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """The compiled grammar for spec, from the cache when seen before. Raises
        InvalidRequestError naming the field when the constraint does not compile."""
        with self._lock:
            compiled = self._cache.get(spec.key)
            if compiled is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return compiled
            compiler = self._xgrammar_compiler()
        start = time.perf_counter()  # compiled outside the lock: a hit never waits for another's compile
        compiled = self._compile(compiler, spec)
        with self._lock:
            self.compile_seconds += time.perf_counter() - start
            self.misses += 1
            self._cache[spec.key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: "xgrammar.GrammarCompiler", spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        param = f"{spec.field}.{spec.kind}" if spec.field == "structured_outputs" else spec.field
        try:
            if spec.kind == "json":
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace,
                                                    strict_mode=spec.strict)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=not spec.disable_any_whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"{param} could not be compiled: {_first_line(e)}", param=param) from None

    def _xgrammar_compiler(self) -> "xgrammar.GrammarCompiler":
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(_hf_tokenizer(self._tokenizer), vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose root is exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _hf_tokenizer(tokenizer: "Tokenizer") -> Any:
    """transformers' wrapper around our tokenizers backend: what xgrammar reads the vocabulary from."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
