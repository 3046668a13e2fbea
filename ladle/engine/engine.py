"""The step loop: schedule, run the model, sample, detokenise, check stops, free blocks.

Not thread-safe: one thread owns an engine (the server wraps it in `AsyncEngine`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ladle.config import EngineConfig
from ladle.engine.handoff import HandoffStats, KVExports, KVHandoff, block_writer, export_handoff, handoff_mismatch
from ladle.engine.hybrid import check_hybrid, start_states
from ladle.engine.image_prompts import ImagePrompts, takes_images
from ladle.engine.multimodal import ImagePrompt, ImageSpan, ImageTokens
from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.kv_events import KVEventLog
from ladle.engine.kv_report import describe_kv_bytes
from ladle.engine.prefix_cache import root_digest
from ladle.engine.request import CompletionDelta, RequestTimings, Sequence, StepOutput, TokenLogprob
from ladle.engine.sampling_params import SamplingParams
from ladle.engine.scheduler import Scheduler
from ladle.engine.stop import OutputTextTracker
from ladle.engine.threads import claim_compute
from ladle.errors import InvalidRequestError
from ladle.lora.adapter import AdapterError, AdapterRef
from ladle.lora.registry import LoRARegistry
from ladle.lora.slots import LoRASlots
from ladle.model.attention import KVCache
from ladle.model.config import ModelConfig
from ladle.model.dtype import DTYPES, canonical_name
from ladle.model.kv_quant import KV_8BIT
from ladle.model.quantization import describe as describe_weights
from ladle.model.loader import holds_fp8_weights, holds_quantized_weights, load_weights, resolve_model_path
from ladle.engine.runner import ModelRunner
from ladle.engine.sampler import Sampler, token_logprob
from ladle.model.tokenizer import IncrementalDetokenizer, Tokenizer
from ladle.platform import resolve_platform
from ladle.reasoning.budget import PROMPT_TAIL_TOKENS, ReasoningSpec
from ladle.reasoning.parser import tags_for
from ladle.spec_decode.proposer import Proposer
from ladle.spec_decode.stats import SpecDecodeStats
from ladle.spec_decode.verify import verify_all
from ladle.structured.grammar import GrammarCompiler
from ladle.structured.matcher import GrammarState

if TYPE_CHECKING:
    from ladle.distributed.tensor_parallel import RankSpec
    from ladle.model.collectives import CommStats

# a slowdown planted in every step, for tests/test_gate.py alone: the performance gate must catch it
PLANTED_STEP_SLEEP_S = float(os.environ.get("LADLE_PLANTED_STEP_SLEEP_MS", "0")) / 1000

log = logging.getLogger("ladle")


@dataclass
class EngineStats:
    """Running totals, read by the server's snapshot."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size > 1 and config.num_threads is None:  # the cores shared out over the ranks
            config = replace(config, num_threads=max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        self.config = config
        claim_compute(config.num_threads)  # the offline LLM computes on this thread
        folder = resolve_model_path(config.model, config.revision, config.download_dir)
        self.model_path = folder
        self.model_config = ModelConfig.from_folder(folder)
        self.tokenizer = Tokenizer.from_folder(folder)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.platform = resolve_platform(config.device, config.attention_backend)
        self.platform.check(config)
        quantized = config.quantization == "int8" or (config.quantization == "auto" and holds_quantized_weights(folder))
        self.dtype = self.platform.choose_dtype(config.dtype, quantized)
        self.kv_cache_dtype_name = kv_name = self._kv_cache_dtype_name()
        self.kv_dtype = KV_8BIT.get(kv_name) or DTYPES[kv_name]
        self.isa = self.platform.kernels
        log.info("device %s; compute dtype %s (%s); KV cache %s; kernels: %s", self.platform.describe(),
                 self.dtype.name, self.dtype.reason, kv_name, self.isa)
        check_hybrid(config, self.model_config)
        num_blocks = self._fixed_num_blocks()
        self.quantization = self._quantization(folder)
        self.runner = ModelRunner(self.model_config, self._weights(folder), num_blocks, config.block_size,
                                  self.kv_dtype, self.quantization,
                                  self._parallel_spec(folder, num_blocks), self.platform)
        states = start_states(config, self.model_config)
        if states is not None:
            self.runner.allocate_states(states.num_slots)
        if num_blocks is None:  # the platform measures what is left for it
            num_blocks = self._measured_num_blocks()
            self.runner.allocate_kv_cache(num_blocks)
        pool_tokens = num_blocks * config.block_size
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %s; %s)", num_blocks, config.block_size, pool_tokens,
                 kv_name, describe_kv_bytes(self.model_config, self.kv_dtype))
        window = self._kv_window()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 cache_outputs=not config.deterministic, window=window, states=states)
        model_len = config.max_model_len or self.model_config.max_position_embeddings
        if window is not None and self._peak_tokens_held(window) <= pool_tokens:
            pool_tokens = model_len  # a sequence holds its window and a step's tokens, however long it is
        if model_len > pool_tokens:
            log.warning("max_model_len %d exceeds the KV pool (%d tokens); capping it", model_len, pool_tokens)
        self.max_model_len = min(model_len, pool_tokens, self.model_config.max_position_embeddings)
        self.kv_events = self._start_kv_events()
        self.scheduler = Scheduler(config, self.kv)
        self.sampler = Sampler(config.seed, self.platform.top_p_head, self.platform.nucleus_kernel,
                               self.platform.argmax_kernel)
        if config.kv_offload_gib > 0:
            self._start_offload()
        self.loras = self._start_lora() if config.enable_lora else None
        self.reasoning = ReasoningSpec.of(self.tokenizer, tags_for(config.reasoning_parser)) \
            if config.reasoning_parser else None
        self.images = ImagePrompts.from_folder(folder, self.tokenizer, self.dtype.dtype,
                                               config.mm_encoder_cache_mib * 2**20) \
            if takes_images(folder) and config.load_format != "dummy" else None
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        log.info("matmuls by rows per call: %s (measured: %s)", self.runner.model.routing.table(),
                 self.runner.model.routing.measured)
        spec, c = config.speculative_config, self.model_config
        if spec is not None and c.mrope_section:  # drafts would need M-RoPE's positions too
            raise ValueError("speculative decoding on M-RoPE models (Qwen2.5-VL) is not supported yet")
        self.proposer = Proposer(spec, self.runner, self.kv, c.num_hidden_layers, c.vocab_size, self.dtype.dtype,
                                 num_blocks, config.block_size) if spec is not None else None
        # the states are not graphed, nor M-RoPE's positions
        if self.platform.graphs and not config.enforce_eager and states is None and not c.mrope_section:
            self.runner.capture_decode_graphs(config.decode_graph_rows, self.max_model_len)
        self.requests: dict[str, list[Sequence]] = {}
        self.stats = EngineStats()
        transfer = config.kv_transfer_config
        self.kv_exports = KVExports(transfer.kv_buffer_size) if transfer is not None and transfer.produces else None
        self.handoffs = HandoffStats()
        self._handed_over: list[tuple[str, CompletionDelta]] = []  # first tokens of handoffs, sent next step
        self._seq_ids = itertools.count()

    def _kv_window(self) -> int | None:
        """Sequences let go of the blocks behind every layer's window, unless this engine hands whole
        prompts' K/V to another (P/D prefill): those need every block."""
        transfer = self.config.kv_transfer_config
        return None if transfer is not None and transfer.produces else self.model_config.kv_window

    def _peak_tokens_held(self, window: int) -> int:
        """The most tokens' blocks a sequence holds under sliding windows: its window, one step's tokens,
        and the partial blocks at either end."""
        return window + self.config.max_num_batched_tokens + 2 * self.config.block_size

    def _parallel_spec(self, folder, num_blocks: int) -> "RankSpec | None":
        """What the tensor-parallel ranks are to build; None on one process."""
        c = self.config
        if c.enable_expert_parallel and self.model_config.moe is None:
            raise ValueError("enable_expert_parallel (--enable-expert-parallel) needs a mixture-of-experts model")
        if c.enable_lora and self.model_config.moe is not None:
            raise ValueError("LoRA adapters on mixture-of-experts models are not supported yet")
        if c.enable_lora and self.model_config.model_type == "gemma4_text":
            raise ValueError("LoRA adapters on Gemma 4 models are not supported yet")
        if c.tensor_parallel_size == 1:
            return None
        if self.model_config.mrope_section:
            raise ValueError("tensor parallelism on M-RoPE models (Qwen2.5-VL) is not supported yet")
        from ladle.distributed.tensor_parallel import RankSpec
        from ladle.model.sharding import Shard

        Shard(0, c.tensor_parallel_size, c.enable_expert_parallel).check(self.model_config)  # before any worker starts
        return RankSpec(str(folder), self.model_config, self.dtype.dtype, c.quantization, num_blocks, c.block_size,
                        self.kv_dtype, c.tensor_parallel_size, c.enable_expert_parallel, c.num_threads,
                        c.distributed_executor_backend)

    def close(self) -> None:
        """Stops what the engine started outside this process's threads (tensor-parallel workers)."""
        self.runner.close()

    @property
    def healthy(self) -> bool:
        """False once a tensor-parallel worker has died: nothing can be computed any more."""
        return self.failure is None

    @property
    def failure(self) -> str | None:
        """Why this engine cannot compute (a tensor-parallel worker died); None while it can."""
        workers = self.runner.workers
        return None if workers is None else workers.failure

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, by MoE layer (empty for a dense model)."""
        return {i: block.tokens_per_expert.tolist() for i, block in self.runner.model.moe_blocks.items()}

    def collective_stats(self) -> "CommStats | None":
        """Rank 0's time in the tensor-parallel collectives; None on one process."""
        workers = self.runner.workers
        return None if workers is None else workers.comm.stats

    def _start_kv_events(self) -> KVEventLog | None:
        """The log of blocks the prefix cache stores and evicts (GET /v1/kv_events); None without one."""
        if self.kv.cache is None:
            return None
        events = KVEventLog(self.config.block_size, root_digest(0).hex())
        self.kv.cache.listener = events
        return events

    def _start_lora(self) -> LoRARegistry:
        c = self.config
        registry = LoRARegistry(self.model_config, c.max_lora_rank, c.max_cpu_loras)
        for name, path in c.lora_modules.items():
            try:
                registry.add(name, path)
            except AdapterError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
        self.runner.enable_lora(LoRASlots(self.model_config, c.max_loras, c.max_lora_rank, self.dtype.dtype,
                                           self.platform.device),
                                registry.weights)
        log.info("LoRA: %d adapter(s) loaded, %d slot(s) of rank up to %d, %d kept in memory",
                 len(c.lora_modules), c.max_loras, c.max_lora_rank, c.max_cpu_loras)
        return registry

    def _start_offload(self) -> None:
        if not self.config.enable_prefix_caching:
            raise ValueError("--kv-offload-gib keeps prefix-cache blocks: it needs prefix caching on")
        from ladle.engine.kv_offload import OffloadTier

        tier = OffloadTier(self.config.kv_offload_dir, int(self.config.kv_offload_gib * 2**30))
        tensors = self.runner.kv_cache.tensors()
        self.kv.enable_offload(tier, lambda block: [t[:, block] for t in tensors])
        log.info("KV offload tier: up to %.2f GiB in %s", self.config.kv_offload_gib, tier.directory)

    def _measure_prefill(self, plan, seconds: float) -> None:
        """The second tier's break-even: what a token costs in a step that is mostly prefill."""
        prefill = sum(item.num_new_tokens for item in plan.scheduled if item.num_new_tokens > 1)
        if prefill >= 4 * self.config.block_size and prefill * 2 >= plan.num_tokens:
            self.kv.offload.record_prefill(seconds, plan.num_tokens)

    def add_lora(self, name: str, path: str) -> AdapterRef:
        """Serve another adapter (thread-safe: it reads the folder on the calling thread); raises
        AdapterError for a folder it cannot serve, RuntimeError without enable_lora."""
        if self.loras is None:
            raise RuntimeError("LoRA is not enabled (enable_lora / --enable-lora)")
        return self.loras.add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter to new requests (those accepted finish on it); False if unknown."""
        return self.loras is not None and self.loras.remove(name) is not None

    def list_loras(self) -> list[AdapterRef]:
        return [] if self.loras is None else self.loras.refs()

    def _pin(self, adapter: AdapterRef) -> None:
        """Keep the adapter's weights in memory while the request runs (read again if paged out), so
        no step ever waits on its folder or fails for want of it."""
        try:
            self.loras.pin(adapter)
        except AdapterError as e:
            raise InvalidRequestError(str(e), param="model") from None

    def _adapter(self, name: str | None) -> AdapterRef | None:
        if name is None:
            return None
        ref = None if self.loras is None else self.loras.get(name)
        if ref is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", param="model",
                                      code="model_not_found")
        return ref

    def runtime_info(self) -> dict[str, str]:
        """How this engine computes on this machine, and why (the start log and /version)."""
        routing = self.runner.model.routing
        return {"device": self.platform.describe(), "dtype": self.dtype.name, "dtype_reason": self.dtype.reason,
                "quantization": self.config.quantization,
                "weights": describe_weights(self.runner.model.linears),
                "kv_cache_dtype": self.kv_cache_dtype_name, "kernels": self.isa,
                "matmul": routing.table()}

    def cache_config_info(self) -> dict[str, str]:
        """The KV pool as vLLM's `vllm:cache_config_info` labels it (on the CPU, its blocks are in RAM)."""
        return {"block_size": str(self.config.block_size), "cache_dtype": self.kv_cache_dtype_name,
                "num_gpu_blocks": str(self.kv.num_blocks),
                "enable_prefix_caching": str(self.config.enable_prefix_caching)}

    def _kv_cache_dtype_name(self) -> str:
        name = self.config.kv_cache_dtype
        if name == "auto":
            return self.dtype.name
        return "fp8_e4m3" if name == "fp8" else name if name in KV_8BIT else canonical_name(name)

    def _fixed_num_blocks(self) -> int | None:
        """The pool's size in blocks as the flags fix it; None when the platform is to measure it."""
        c = self.config
        if c.num_kv_blocks:
            return c.num_kv_blocks
        gib = c.kv_cache_memory_gib if c.kv_cache_memory_gib is not None else self.platform.default_kv_cache_gib
        return None if gib is None else max(1, int(gib * 2**30) // self._bytes_per_block())

    def _measured_num_blocks(self) -> int:
        c = self.config
        max_len = c.max_model_len or self.model_config.max_position_embeddings
        profile = functools.partial(self.runner.profile_forward, c.max_num_batched_tokens, max_len, c.max_num_seqs)
        return self.platform.kv_cache_blocks(profile, c, self.model_config.vocab_size, self._bytes_per_block())

    def _bytes_per_block(self) -> int:
        c = self.model_config
        kv_heads = c.num_key_value_heads // self.config.tensor_parallel_size  # the pool is per rank
        return KVCache.bytes_per_block(c.num_kv_layers, self.config.block_size, max(1, kv_heads), c.head_dim,
                                       self.kv_dtype, c.cache_layer_shapes)

    def _weights(self, folder) -> dict:
        """The model's weights where the platform computes with them (random ones for --load-format dummy)."""
        if self.config.load_format == "dummy":
            from ladle.model.dummy import dummy_weights

            return dummy_weights(self.model_config, self.dtype.dtype, self.platform.device, self.config.seed)
        weights = load_weights(folder, self.dtype.dtype, keep_fp8=self.quantization == "fp8")
        return self.platform.place_weights(weights, self.dtype.dtype)

    def _quantization(self, folder) -> str:
        """--quantization as the platform serves it: its weights may have been dequantised on the way in,
        and an FP8 checkpoint stays FP8 under auto where the platform multiplies FP8."""
        q = self.config.quantization
        if q == "auto" and holds_fp8_weights(folder):
            fp8 = self.platform.fp8_matmuls
            log.info("fp8 checkpoint: %s", "served in fp8" if fp8 else f"dequantised ({self.platform.name} has no "
                     "fp8 matmuls; --quantization fp8 keeps it fp8 on torch's scaled matmul)")
            return "fp8" if fp8 else "none"
        return "none" if q == "auto" and not self.platform.keeps_quantized_weights else q

    # -- requests -------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | ImagePrompt | ImageTokens,
                    params: SamplingParams, priority: int = 0, arrival_time: float | None = None,
                    lora: str | None = None) -> list[int]:
        """Queue a request, on the LoRA adapter named `lora` if given; returns its prompt token ids.
        Raises InvalidRequestError."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", param="request_id")
        adapter = self._adapter(lora)
        ids, spans = self._prompt_ids(prompt)
        self._check_prompt(ids, params)
        if params.bad_words and params.bad_words_token_ids is None:  # not yet tokenized by the caller
            params = replace(params)
            params.update_from_tokenizer(self.tokenizer, self.model_config.vocab_size)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens != params.max_tokens:
            params = replace(params, max_tokens=max_tokens)
        arrival = time.time() if arrival_time is None else arrival_time
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        handoff, params = params.kv_handoff, replace(params, kv_handoff=None)
        seqs = [self._new_sequence(request_id, i, ids, params, priority, arrival, adapter, spans)
                for i in range(params.n)]
        for seq in seqs if grammar is not None else ():
            seq.grammar = GrammarState(grammar)
        if adapter is not None:
            self._pin(adapter)
        if handoff is not None:
            self._continue_from(seqs[0], handoff)
        self.requests[request_id] = seqs
        self.stats.prompt_tokens += len(ids) * params.n
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.add(seq)
        return ids

    def _prompt_ids(self, prompt: str | list[int] | ImagePrompt | ImageTokens) -> tuple[list[int],
                                                                                     tuple[ImageSpan, ...]]:
        """The prompt's token ids and its images' placeholder spans (ladle.engine.multimodal)."""
        if isinstance(prompt, ImageTokens):
            return list(prompt.ids), prompt.spans
        if not isinstance(prompt, ImagePrompt) or not prompt.images:
            text = prompt.text if isinstance(prompt, ImagePrompt) else prompt
            return (self.tokenizer.encode(text) if isinstance(text, str) else list(text)), ()
        if self.images is None:
            raise InvalidRequestError("this model is text-only: it takes no images", param="images")
        limit = self.config.limit_mm_per_prompt.get("image")
        if limit is not None and len(prompt.images) > limit:
            raise InvalidRequestError(f"{len(prompt.images)} images in one prompt, over the limit of {limit} "
                                      "(--limit-mm-per-prompt)", param="images")
        if self.runner.workers is not None:
            raise InvalidRequestError("images under tensor parallelism are not supported yet", param="images")
        return self.images.prompt(prompt.text, list(prompt.images))

    def _continue_from(self, seq: Sequence, handoff: KVHandoff) -> None:
        """Start seq on a prompt's K/V and first token that a prefill engine computed: the blocks
        enter the prefix cache (pinned until seq is matched) and the first token is appended as
        if sampled here, reaching the reader with the next step's outputs."""
        tensors = self.runner.kv_cache.tensors()
        why = handoff_mismatch(handoff, seq.prompt_token_ids, seq, tensors, self.config.block_size)
        if why is not None or self.kv.cache is None:
            self.handoffs.rejected += 1
            log.warning("request %s: computing the prompt, not using the K/V handed over: %s", seq.request_id,
                        why or "this engine has no prefix cache")
            return
        # keyed as the prefix cache keys them: an image's blocks by its hash (the prompt re-sent with its images)
        seq.pinned_blocks = self.kv.import_prefix(seq.cache_token_ids[: seq.num_prompt_tokens], handoff.blocks,
                                                  block_writer(tensors))
        self.handoffs.imported += 1
        self.handoffs.imported_tokens += min(len(seq.pinned_blocks) * self.config.block_size, seq.num_prompt_tokens)
        delta = self._append_token(seq, handoff.first_token, handoff.first_logprob, time.time())
        self._handed_over.append((seq.request_id, delta))

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise InvalidRequestError("a thinking budget needs a reasoning model served with --reasoning-parser",
                                      param="thinking_token_budget")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        for name in ("stop_token_ids", "label_token_ids", "allowed_token_ids"):
            if any(not 0 <= t < vocab for t in getattr(params, name) or ()):
                raise InvalidRequestError(f"{name} must be in [0, {vocab})", param=name)
        layers = self.model_config.num_hidden_layers
        if any(not 0 <= i <= layers for i in params.hidden_state_layers or ()):
            raise InvalidRequestError(f"hidden_state_layers must be in [0, {layers}]", param="hidden_state_layers")
        if params.hidden_state_layers and params.hidden_state_start >= len(ids):
            raise InvalidRequestError(f"hidden_state_start must be below the prompt's {len(ids)} tokens",
                                      param="hidden_state_start")
        limit = self.max_model_len
        want = len(ids) + (params.max_tokens or 1)
        if len(ids) >= limit or want > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested {want} tokens "
                f"({len(ids)} in the prompt, {want - len(ids)} for the completion), {want - limit} over. "
                "Please reduce the length of the prompt or of max_tokens.",
                param="max_tokens" if len(ids) < limit else "prompt", code="context_length_exceeded")

    def _new_sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams,
                      priority: int, arrival: float, lora: AdapterRef | None = None, images: tuple = ()) -> Sequence:
        gen = None if params.seed is None else self.platform.generator(params.seed + index)
        seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=index, token_ids=list(ids),
                       num_prompt_tokens=len(ids), params=params, arrival_time=arrival, priority=priority,
                       eos_token_ids=self.eos_token_ids, generator=gen,
                       canonical=self.config.deterministic or params.is_scoring, lora=lora, images=images)
        detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        seq.text = OutputTextTracker(detok, params.stop)
        if self.reasoning is not None and not params.is_scoring:
            budget = params.thinking_token_budget
            if budget is None and params.structured_outputs is None:  # a grammar cannot take the forced close
                budget = self.config.thinking_token_budget
            tail = self.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            seq.reasoning = self.reasoning.tracker(tail, budget)
        return seq

    def abort_request(self, request_id: str) -> StepOutput | None:
        """Drop a request wherever it is; its blocks are free on return (what it computed stays in
        the prefix cache). Returns the output its reader sees last, where its unfinished sequences
        end with finish_reason "abort"; None for a request that is not here."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return None
        for seq in seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        if seqs[0].lora is not None:
            self.loras.unpin(seqs[0].lora)
        first = seqs[0]
        deltas = [CompletionDelta(index=s.index, token_ids=[], text="", logprobs=[], finish_reason="abort")
                  for s in seqs if s.finish_reason == "abort"]
        return StepOutput(request_id=request_id, prompt_token_ids=first.prompt_token_ids, deltas=deltas,
                          finished=True, num_cached_tokens=first.num_cached_tokens, arrival_time=first.arrival_time,
                          timings=RequestTimings.of(seqs))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no running request holds (vLLM's API; benchmarks call it for
        a cold run): a prompt served before is computed again, in the second tier's blocks too.
        Returns True when the cache is empty, False when running requests hold blocks, which stay."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        handed_over = self._handed_over_outputs()
        self._propose_drafts()
        plan = self.scheduler.schedule()
        if not plan:
            return handed_over
        now = time.time()
        if PLANTED_STEP_SLEEP_S:
            time.sleep(PLANTED_STEP_SLEEP_S)
        logits = self.runner.execute(plan.scheduled)
        if self.kv.offload is not None:
            self._measure_prefill(plan, time.time() - now)
        for item in plan.scheduled:
            item.seq.first_scheduled_time = item.seq.first_scheduled_time or now
        verified = self._verify_drafts(plan, logits.draft_rows)
        self.scheduler.update_after_step(plan)
        for seq, first, rows in logits.prompt_rows:
            self._record_prompt_logprobs(seq, first, rows)
        rows = [i for i, s in enumerate(logits.sample_seqs) if not s.params.is_scoring]
        scored = [i for i, s in enumerate(logits.sample_seqs) if s.params.is_scoring]
        sampled = self.sampler(self._rows_of(logits.sample_logits, rows), [logits.sample_seqs[i] for i in rows]) \
            if rows else []
        done_at = time.time()
        deltas: dict[str, list[CompletionDelta]] = {}
        for i, (token, lp) in zip(rows, sampled):
            seq = logits.sample_seqs[i]
            deltas.setdefault(seq.request_id, []).append(self._append_token(seq, token, lp, done_at))
        for i in scored:
            seq = logits.sample_seqs[i]
            deltas.setdefault(seq.request_id, []).append(self._finish_scoring(seq, logits.sample_logits[i], done_at))
        for seq, emitted in verified:
            deltas.setdefault(seq.request_id, []).append(self._append_verified(seq, emitted, done_at))
        if self.proposer is not None:
            self.proposer.keep_only(self.scheduler.running)
        self.stats.steps += 1
        self.stats.generation_tokens += len(sampled) + sum(len(emitted) for _, emitted in verified)
        return handed_over + [self._request_output(rid, d) for rid, d in deltas.items()]

    @staticmethod
    def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits[rows], without copying [rows, vocab] when the rows are all of them (no scoring request
        in the step): on the CPU that copy took a decode step at batch 256 longer than its sampling."""
        return logits if len(rows) == len(logits) else logits[rows]  # rows: ascending, so all of them

    def _handed_over_outputs(self) -> list[StepOutput]:
        """The first tokens of requests that started on handed-over K/V (and were not aborted since)."""
        pending, self._handed_over = self._handed_over, []
        return [self._request_output(rid, [delta]) for rid, delta in pending if rid in self.requests]

    # -- speculative decoding (ladle.spec_decode) --------------------------------

    def _propose_drafts(self) -> None:
        if self.proposer is None:
            return
        k = self.config.speculative_config.tokens_at(len(self.scheduler.running))
        drafting, rooms = [], []
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            # at most what max_tokens and the context leave after this step's own token
            room = min(k, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if room > 0 and self._may_speculate(seq):
                drafting.append(seq)
                rooms.append(room)
        for seq, draft in zip(drafting, self.proposer.propose(drafting, rooms)):
            seq.draft_token_ids = draft

    @staticmethod
    def _may_speculate(seq: Sequence) -> bool:
        """Decoding, and not canonical (scoring, --deterministic: a verification step is not a decode
        step, so it would not give a decode step's bits)."""
        forcing = seq.reasoning is not None and seq.reasoning.may_force  # its next tokens may be forced
        return (seq.num_computed_tokens == seq.num_tokens - 1 and not seq.canonical and not seq.params.is_scoring
                and not forcing)

    def _verify_drafts(self, plan, draft_rows: list[tuple[Sequence, torch.Tensor]]) -> list:
        """Decide each drafting sequence's tokens before the scheduler counts them: only the kept
        drafts were computed for good (the rejected ones' K/V slots are written over later)."""
        if not draft_rows:
            return []
        items = {item.seq.seq_id: item for item in plan.scheduled}
        jobs = []
        for seq, rows in draft_rows:
            jobs.append((rows, seq, seq.draft_token_ids))
            seq.draft_token_ids = []
        verified = []
        for (_, seq, drafts), emitted in zip(jobs, verify_all(jobs, self.sampler)):
            kept = len(emitted) - 1
            items[seq.seq_id].num_new_tokens = 1 + kept
            seq.token_ids.extend(token for token, _ in emitted[:kept])  # so their blocks cache as they are
            self.stats.spec.record(len(drafts), kept)
            verified.append((seq, emitted))
        return verified

    def _append_verified(self, seq: Sequence, emitted: list, now: float) -> CompletionDelta:
        """The kept drafts and the drawn token, through the same checks as any sampled token (stop
        strings, EOS, max_tokens), as one delta; blocks written only by rejected drafts go back."""
        del seq.token_ids[len(seq.token_ids) - (len(emitted) - 1) :]
        parts = []
        for token, lp in emitted:
            parts.append(self._append_token(seq, token, lp, now))
            if parts[-1].finish_reason is not None:
                break
        if not seq.is_finished:
            self.kv.trim(seq)
        last = parts[-1]
        return CompletionDelta(index=seq.index, token_ids=[t for d in parts for t in d.token_ids],
                               text="".join(d.text for d in parts), logprobs=[lp for d in parts for lp in d.logprobs],
                               finish_reason=last.finish_reason, stop_reason=last.stop_reason,
                               num_reasoning_tokens=last.num_reasoning_tokens)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float) -> CompletionDelta:
        seq.token_ids.append(token)
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        if lp is not None:
            seq.logprobs.append(lp)
        p = seq.params
        stop_reason: int | str | None = None
        finish = None
        if token in seq.eos_token_ids and not p.ignore_eos:
            finish = "stop"
        elif token in p.stop_token_ids:
            finish, stop_reason = "stop", token
        else:
            text_before = len(seq.text.text)
            stop_reason = seq.text.append(token)
            finish = "stop" if stop_reason is not None else None
            if seq.reasoning is not None:
                self._observe_reasoning(seq, token, text_before)
        if seq.grammar is not None and finish is None and self._grammar_done(seq, token):
            finish = "stop"
        if finish is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            finish = "length"
        if finish:
            seq.finish_reason, seq.stop_reason = finish, stop_reason
            if seq.params.export_kv and self.kv_exports is not None:  # before its blocks are let go
                if self.kv_exports.put(seq.request_id, export_handoff(seq, self.runner.kv_cache.tensors(),
                                                                     self.config.block_size)):
                    self.handoffs.exported += 1
            self.scheduler.finish(seq)
        return CompletionDelta(index=seq.index, token_ids=[token], text=seq.text.release(finish is not None),
                               logprobs=[lp] if lp is not None else [], finish_reason=finish, stop_reason=stop_reason,
                               num_reasoning_tokens=seq.reasoning.num_reasoning_tokens if seq.reasoning else None)

    @staticmethod
    def _observe_reasoning(seq: Sequence, token: int, text_before: int) -> None:
        tracker = seq.reasoning
        if tracker.forced and tracker.forced[0] == token:  # the sampler emitted it
            tracker.forced.pop(0)
        tracker.observe(seq.text.text, text_before)

    @staticmethod
    def _grammar_done(seq: Sequence, token: int) -> bool:
        """Advance the sequence's grammar; it is done once complete (it accepted a stop token, even
        under ignore_eos) or if it refused the token (only when every token was masked)."""
        if not seq.grammar.accept(token):
            log.warning("request %s: grammar refused token %d; finishing", seq.request_id, token)
            return True
        return seq.grammar.is_terminated

    def _finish_scoring(self, seq: Sequence, logits: torch.Tensor, now: float) -> CompletionDelta:
        p = seq.params
        labels = None
        if p.label_token_ids is not None:
            labels = torch.log_softmax(logits.double(), dim=-1)[torch.tensor(p.label_token_ids)].tolist()
        states = None
        if p.hidden_state_layers is not None:
            count = seq.num_prompt_tokens - p.hidden_state_start if p.hidden_state_pooling == "mean" else 1
            states = {layer: (seq.hidden_states[layer] / count).tolist() for layer in p.hidden_state_layers}
        seq.first_token_time = seq.last_token_time = now
        seq.finish_reason = "stop"
        self.scheduler.finish(seq)
        return CompletionDelta(index=seq.index, token_ids=[], text="", logprobs=[], finish_reason="stop",
                               label_logprobs=labels, hidden_states=states)

    def _record_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """Row i predicts prompt token first + i + 1; rows already recorded (a recompute
        after preemption) are skipped."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # nothing predicts the first token
        k = seq.params.prompt_logprobs or 0
        for i in range(logits.shape[0]):
            nxt = first + i + 1
            if nxt < seq.num_prompt_tokens and len(seq.prompt_logprobs) == nxt:
                seq.prompt_logprobs.append(token_logprob(logprobs[i], seq.token_ids[nxt], k))

    def _request_output(self, request_id: str, deltas: list[CompletionDelta]) -> StepOutput:
        seqs = self.requests[request_id]
        finished = all(s.is_finished for s in seqs)
        first = seqs[0]
        if finished:
            del self.requests[request_id]
            if first.lora is not None:
                self.loras.unpin(first.lora)
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None and not first.prompt_logprobs_sent:
            prompt_logprobs, first.prompt_logprobs_sent = first.prompt_logprobs, True
        return StepOutput(request_id=request_id, prompt_token_ids=first.prompt_token_ids, deltas=deltas,
                          finished=finished, num_cached_tokens=first.num_cached_tokens,
                          prompt_logprobs=prompt_logprobs, arrival_time=first.arrival_time,
                          timings=RequestTimings.of(seqs) if finished else None)
