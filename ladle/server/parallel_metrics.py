"""/metrics for model parallelism: tokens per MoE expert (the load an expert balancer reads),
and the time the tensor-parallel ranks spend in collectives."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ladle.engine.engine import LLMEngine


class ParallelCollector:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        load = self.engine.expert_load()
        if load:
            tokens = CounterMetricFamily("ladle:moe_expert_tokens", "Tokens the router sent to each expert of "
                                         "each MoE layer (a token counts once per expert it chose).",
                                         labels=["model_name", "layer", "expert"])
            for layer, counts in load.items():
                for expert, n in enumerate(counts):
                    tokens.add_metric([self.model_name, str(layer), str(expert)], n)
            yield tokens
        c = self.engine.config
        ranks = GaugeMetricFamily("ladle:tensor_parallel_size", "Ranks the model is split over.",
                                  labels=["model_name", "expert_parallel"])
        ranks.add_metric([self.model_name, str(c.enable_expert_parallel).lower()], c.tensor_parallel_size)
        yield ranks
        stats = self.engine.collective_stats()
        if stats is not None:
            seconds = CounterMetricFamily("ladle:tp_collective_seconds", "Time rank 0 spent in the forward's "
                                          "collectives (all-reduce, all-to-all, gathers), waiting included.",
                                          labels=["model_name"])
            seconds.add_metric([self.model_name], stats.seconds)
            calls = CounterMetricFamily("ladle:tp_collectives", "Collectives rank 0 took part in.",
                                        labels=["model_name"])
            calls.add_metric([self.model_name], stats.calls)
            yield from (seconds, calls)
