"""Per-request sampling settings, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ladle.errors import InvalidRequestError
from ladle.structured.spec import StructuredOutputsParams

if TYPE_CHECKING:
    from ladle.engine.handoff import KVHandoff

_GREEDY_EPS = 1e-5
POOLINGS = ("last", "mean")


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text (ladle.engine.stop)
    logprobs: int | None = None  # top alternatives to return per sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Sampling draws only from these tokens (None: all); logprobs stay the model's, unrestricted.
    allowed_token_ids: list[int] | None = None
    # Words never generated: the last token of a word's token sequence is banned where the output
    # ends with the rest of it. update_from_tokenizer turns the words into bad_words_token_ids (the
    # server and LLM call it; a caller of LLMEngine.add_request must too).
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    # Prefill-only scoring (decisions, /v1/score): when set, nothing is sampled; the
    # request returns these tokens' full-vocabulary log-probabilities at the position
    # after the prompt, and finishes.
    label_token_ids: list[int] | None = None
    # Prefill-only too (embeddings, decision heads): the prompt's hidden states after these
    # layers, numbered as transformers' output_hidden_states (0 the embeddings, i the output
    # of decoder layer i, the last after the final norm), pooled over the prompt: "last"
    # takes the last position (where the answer would come), "mean" averages the positions
    # from hidden_state_start on (those are always computed, never taken from the cache).
    hidden_state_layers: list[int] | None = None
    hidden_state_pooling: str = "last"
    hidden_state_start: int = 0
    # Constrained decoding: every sampled token keeps the output inside this grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Reasoning models (--reasoning-parser): past this many reasoning tokens the engine closes the
    # think block itself and the model answers. None: the server's default (unlimited without one).
    thinking_token_budget: int | None = None
    # Disaggregated prefill/decode (ladle.engine.handoff): keep the prompt's K/V for a decode engine
    # to fetch once the request ends (a prefill worker's one-token request) ...
    export_kv: bool = False
    # ... or start from the K/V and first token a prefill engine handed over, computing none of the prompt
    kv_handoff: "KVHandoff | None" = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the offending field."""
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1 (off), 0 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            # vLLM looks for stop strings only after min_tokens tokens; ladle's stop strings end the text at once
            (not (self.min_tokens and self.stop), "min_tokens", "cannot be combined with stop strings"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs", "must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative token ids"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
             "must not be empty"),
            (all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids or ()), "allowed_token_ids",
             "must be non-negative token ids"),
            (all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words", "must be non-blank strings"),
            (self.label_token_ids is None or len(self.label_token_ids) > 0, "label_token_ids", "must not be empty"),
            (self.hidden_state_layers is None or len(self.hidden_state_layers) > 0, "hidden_state_layers",
             "must not be empty"),
            (self.hidden_state_pooling in POOLINGS, "hidden_state_pooling", f"must be one of {POOLINGS}"),
            (self.hidden_state_start >= 0, "hidden_state_start", "must be non-negative"),
            (self.structured_outputs is None or not self.is_scoring, "structured_outputs",
             "cannot constrain a prefill-only (scoring) request"),
            (self.thinking_token_budget is None or self.thinking_token_budget >= 0, "thinking_token_budget",
             "must be non-negative"),
            (self.thinking_token_budget is None or self.structured_outputs is None, "thinking_token_budget",
             "cannot be combined with structured outputs (the forced end of thinking is outside the grammar)"),
            (self.n == 1 or not (self.export_kv or self.kv_handoff), "kv_transfer_params",
             "hands over one sequence's K/V: it needs n = 1"),
            (not self.is_scoring or not (self.export_kv or self.kv_handoff), "kv_transfer_params",
             "cannot hand over a prefill-only (scoring) request"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {why}", param=name)

    def update_from_tokenizer(self, tokenizer: Encoder, vocab_size: int) -> None:
        """Check the token ids against the model's vocabulary and tokenize bad_words, as vLLM does:
        each word alone and after a space (a word starting the text, and one inside it), the second
        only where the space makes a new first token and the same number of tokens. A sequence with
        a token outside the vocabulary can never be generated: it needs no ban."""
        if any(t >= vocab_size for t in self.allowed_token_ids or ()):
            raise InvalidRequestError(f"allowed_token_ids must be in [0, {vocab_size})", param="allowed_token_ids")
        sequences: list[list[int]] = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip())
            if not alone:
                raise InvalidRequestError(f"bad_words: {word!r} tokenizes to no token", param="bad_words")
            spaced = tokenizer.encode(" " + word.lstrip())
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        self.bad_words_token_ids = [s for s in sequences if max(s) < vocab_size]

    @property
    def is_scoring(self) -> bool:
        """Prefill-only: nothing is sampled, the request ends after its prompt."""
        return self.label_token_ids is not None or self.hidden_state_layers is not None

    @property
    def max_reused_prompt_tokens(self) -> int | None:
        """Leading prompt tokens that may be taken from the prefix cache or from another
        sequence's K/V rather than computed (None: no limit): positions whose logprobs or
        hidden states the request reports must be computed."""
        if self.prompt_logprobs is not None:
            return 0
        if self.hidden_state_layers is not None and self.hidden_state_pooling == "mean":
            return self.hidden_state_start
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
