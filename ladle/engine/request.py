"""Request and sequence state, and what the engine hands back after each step."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ladle.engine.multimodal import cache_tokens
from ladle.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from ladle.engine.multimodal import ImageSpan
    from ladle.engine.prefix_cache import Node
    from ladle.engine.stop import OutputTextTracker
    from ladle.lora.adapter import AdapterRef
    from ladle.reasoning.budget import ReasoningTracker
    from ladle.structured.matcher import GrammarState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens at this position, best first
    rank: int | None = None  # prompt logprobs: how many tokens are at least as likely (vLLM's rank), itself included


@dataclass
class Sequence:
    """One continuation being generated; a request with n > 1 owns n of them.

    The engine computes `token_ids` (prompt then output) left to right; a token is
    sampled whenever every known token has been computed. After a preemption the
    whole run is recomputed, prompt and output alike.
    """

    seq_id: int
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    # Computed canonically: every token's K/V and logits independent of chunking, batch and
    # cache state (scoring always; every sequence under --deterministic). Such a sequence
    # only reuses cached blocks that were computed canonically too.
    canonical: bool = False
    lora: "AdapterRef | None" = None  # the LoRA adapter it runs on; its KV is cached apart from others'
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on first admission
    block_table: list[int] = field(default_factory=list)
    # blocks handed over by another engine (KVHandoff), referenced until the sequence is matched
    pinned_blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table entered in the prefix cache
    cached_tail: "Node | None" = None  # the prefix cache's node of block num_cached_blocks - 1
    # (source block, destination block, tokens): K/V the runner copies before this
    # sequence's first forward, when its prompt shares only part of a cached block.
    pending_copy: tuple[int, int, int] | None = None
    # (source block, destination block, tokens) the runner copies layer by layer during
    # this step's forward, right after the step wrote them: the sequence shares the start
    # of a prompt another sequence computes in the same step.
    in_step_copy: tuple[int, int, int] | None = None
    # hybrid models (ladle.engine.state_cache): its linear-attention state slot, the snapshot slot the runner
    # restores into it before its next forward (a prefix hit), and the snapshots its planned steps write
    # (block boundary -> snapshot slot)
    state_slot: int | None = None
    state_restore: int | None = None
    pending_snapshots: dict[int, int] = field(default_factory=dict)
    # its prompt's image placeholder spans and their embeddings (ladle.engine.multimodal)
    images: "tuple[ImageSpan, ...]" = ()
    generator: "torch.Generator | None" = None
    grammar: "GrammarState | None" = None  # params.structured_outputs: where the output is in it
    reasoning: "ReasoningTracker | None" = None  # --reasoning-parser: its think block and budget
    # tokens proposed to follow token_ids, verified by this step's forward (speculative decoding);
    # never part of token_ids until the target keeps them
    draft_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    text: "OutputTextTracker | None" = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # params.hidden_state_layers: layer -> the pooled state so far (a running sum for "mean")
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @functools.cached_property
    def prompt_token_ids(self) -> list[int]:
        """One list for the sequence's life (its prompt never changes), not a copy per engine step: each
        step's outputs carry it, and at 256 sequences of 1000-token prompts the copies were 256,000 ids."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def cache_token_ids(self) -> list[int]:
        """token_ids as the prefix cache keys them: an image's placeholders stand for the image."""
        return cache_tokens(self.token_ids, self.images)

    @property
    def adapter_id(self) -> int:
        """Its adapter's id, 0 for the base model: the prefix cache's namespace."""
        return 0 if self.lora is None else self.lora.id

    @property
    def forced_token(self) -> int | None:
        """The token the engine emits next whatever the logits say (budget forcing closing a think block)."""
        return self.reasoning.forced[0] if self.reasoning is not None and self.reasoning.forced else None

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens


@dataclass
class CompletionDelta:
    """What one sequence produced in one step (its text is released only once stop
    strings can no longer swallow it)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    label_logprobs: list[float] | None = None  # scoring requests: one per label token
    hidden_states: dict[int, list[float]] | None = None  # params.hidden_state_layers: layer -> pooled state
    num_reasoning_tokens: int | None = None  # --reasoning-parser: the sequence's reasoning tokens so far


@dataclass(frozen=True)
class RequestTimings:
    """When a finished request passed each stage (time.time() seconds; None: it never got there)."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None

    @classmethod
    def of(cls, seqs: list["Sequence"]) -> "RequestTimings":
        def earliest(times: list[float | None]) -> float | None:
            return min((t for t in times if t is not None), default=None)

        last = [s.last_token_time for s in seqs if s.last_token_time is not None]
        return cls(arrival=seqs[0].arrival_time, first_scheduled=earliest([s.first_scheduled_time for s in seqs]),
                   first_token=earliest([s.first_token_time for s in seqs]), last_token=max(last, default=None))


@dataclass
class StepOutput:
    """Everything one request produced in one engine step."""

    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # set once, with the first output
    arrival_time: float = field(default_factory=time.time)
    timings: RequestTimings | None = None  # set once finished
