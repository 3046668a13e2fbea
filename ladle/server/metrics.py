"""Prometheus metrics with vLLM's names, meanings, buckets and `model_name` label, so vLLM's
dashboards work unchanged. Each app owns its registry (no global one).

Engine state (queues, KV usage, prefix cache, preemptions) is read from the AsyncEngine
when /metrics is scraped. Request timings come from a step listener on the engine thread:
TTFT at a request's first output, inter-token latency at every later token, and queue,
prefill, decode and end-to-end times when it finishes. All times are from arrival, which
is when the server submitted the request to the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ladle.engine.async_engine import AsyncEngine, StepReport
from ladle.engine.request import RequestTimings, Sequence
from ladle.spec_decode.stats import SpecDecodeStats
from ladle.engine.encoder_cache import EncoderStats

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class EngineStateCollector:
    """Gauges and counters the engine already keeps, read at scrape time."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot()
        for kind, name, doc, value in (
            (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution batches.",
             s.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             self.engine.num_waiting()),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             s.kv_cache_usage),
            (CounterMetricFamily, "vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             s.prefix_cache_hits),
            (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             s.num_preemptions),
            (CounterMetricFamily, "ladle:prefix_cache_evictions", "Blocks evicted from the prefix cache.",
             s.prefix_cache_evictions),
            (CounterMetricFamily, "ladle:requests_rejected",
             "Requests refused with 429 because the waiting queue was full.", self.engine.num_rejected),
        ):
            family = kind(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        yield from self._spec_decode(s.spec_decode)
        if self.engine.engine.images is not None:
            yield from self._images(self.engine.engine.images.stats)
        if s.kv_offload is not None:
            yield from self._kv_offload(s)
        if self.engine.lora_enabled:
            yield self._lora_info(s)
        cache = self.engine.cache_config_info
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=["model_name", *cache])
        family.add_metric([self.model_name, *cache.values()], 1.0)
        yield family


    def _lora_info(self, s) -> Metric:
        """vLLM's: the adapters running and waiting as labels, the time they were read as the value."""
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric([self.model_name, str(self.engine.engine.config.max_loras), ",".join(s.waiting_loras),
                           ",".join(s.running_loras)], s.taken_at)
        return family

    def _kv_offload(self, s) -> Iterator[Metric]:
        """The second KV tier (--kv-offload-gib): blocks written, read back, and lost; and the
        break-even it restores by, as measured (once measured)."""
        stats = s.kv_offload
        for name, doc, value in (
            ("ladle:kv_offload_restore_seconds_per_block", "Mean time to read one KV block back from the tier.",
             s.kv_offload_restore_s),
            ("ladle:kv_offload_prefill_seconds_per_block", "Mean time to prefill one block's tokens (blocks are "
             "read back while that is faster).", s.kv_offload_prefill_s),
        ):
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self.model_name], value)
                yield family
        for name, doc, value in (
            ("ladle:kv_offload_stored_blocks", "KV blocks the prefix cache evicted into the offload tier.",
             stats.stored),
            ("ladle:kv_offload_restored_blocks", "KV blocks read back from the offload tier on a prefix hit "
             "instead of recomputed.", stats.restored),
            ("ladle:kv_offload_dropped_blocks", "KV blocks that left the offload tier unread: for room, or "
             "found corrupt or missing.", stats.dropped),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family

    def _images(self, stats: EncoderStats) -> Iterator[Metric]:
        """A vision-language model's images: received, encoded (runs and seconds), and found in the encoder cache."""
        for name, doc, value in (
            ("ladle:images_received", "Images received in prompts.", stats.images),
            ("ladle:image_encoder_runs", "Images the vision encoder ran on (the others were cached).", stats.runs),
            ("ladle:image_encoder_seconds", "Seconds spent processing and encoding images.", stats.seconds),
            ("ladle:image_encoder_cache_hits", "Images found in the encoder cache (by content hash).", stats.hits),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's speculative decoding counters (zero while speculation is off)."""
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels=["model_name", "position"])
        for position, value in enumerate(spec.accepted_per_pos):
            family.add_metric([self.model_name, str(position)], value)
        yield family


class Metrics:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStateCollector(engine, model_name))
        reg, labels = self.registry, ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=reg)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success = success
        self._model_name = model_name
        lengths = buckets_1_2_5(engine.max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               lengths)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", lengths)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        # each finished sequence of two or more tokens: (last token - first) / (tokens - 1), as a client's TPOT
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.reasoning_tokens = self.request_reasoning_tokens = None
        if engine.engine.config.reasoning_parser is not None:
            self.reasoning_tokens = counter("ladle:reasoning_tokens", "Reasoning (think block) tokens generated.")
            self.request_reasoning_tokens = histogram("ladle:request_reasoning_tokens",
                                                      "Reasoning tokens per finished request.", lengths)
        # request id -> time of each sequence's latest token (None: no token yet); engine thread only
        self._last_token: dict[str, list[float | None]] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_step(self, report: StepReport) -> None:
        """The step listener (engine thread)."""
        for request_id in report.aborted:  # as vLLM: an aborted request counts under finished_reason="abort"
            self._last_token.pop(request_id, None)
            self.request_success["abort"].inc()
        generated = 0
        for out in report.outputs:
            seqs = report.sequences.get(out.request_id)
            if not seqs:
                continue
            last = self._last_token.get(out.request_id)
            if last is None:  # the request's first output
                last = self._last_token[out.request_id] = [None] * len(seqs)
                self.ttft.observe(_first_token_time(seqs) - seqs[0].arrival_time)
                self.prompt_tokens.inc(seqs[0].num_prompt_tokens * len(seqs))
            for d in out.deltas:
                if not d.token_ids:
                    continue
                generated += len(d.token_ids)
                seq = seqs[d.index]
                if last[d.index] is not None:
                    self.itl.observe(seq.last_token_time - last[d.index])
                last[d.index] = seq.last_token_time
            if out.finished:
                del self._last_token[out.request_id]
                self._finished(seqs)
        if generated:
            self.generation_tokens.inc(generated)

    def _finished(self, seqs: list[Sequence]) -> None:
        t = RequestTimings.of(seqs)
        arrival = t.arrival
        scheduled = t.first_scheduled or arrival
        first = t.first_token or arrival
        last = t.last_token or first
        self.e2e.observe(last - arrival)
        self.queue.observe(scheduled - arrival)
        self.inference.observe(last - scheduled)
        self.prefill.observe(first - scheduled)
        self.decode.observe(last - first)
        for s in seqs:
            if s.num_output_tokens > 1 and s.first_token_time is not None:
                self.tpot.observe((s.last_token_time - s.first_token_time) / (s.num_output_tokens - 1))
        self.request_prompt_tokens.observe(seqs[0].num_prompt_tokens)
        self.request_generation_tokens.observe(sum(s.num_output_tokens for s in seqs))
        if self.reasoning_tokens is not None:
            reasoning = sum(s.reasoning.num_reasoning_tokens for s in seqs if s.reasoning is not None)
            self.reasoning_tokens.inc(reasoning)
            self.request_reasoning_tokens.observe(reasoning)
        reason = seqs[0].finish_reason or "stop"
        counter = self.request_success.get(reason) or self._success.labels(self._model_name, reason)
        counter.inc()


def _first_token_time(seqs: list[Sequence]) -> float:
    return min((s.first_token_time for s in seqs if s.first_token_time is not None), default=seqs[0].arrival_time)
