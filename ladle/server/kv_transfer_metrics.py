"""/metrics for disaggregated prefill/decode: K/V moved between workers, and what it saved."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from ladle.distributed.kv_transfer import TransferStats
from ladle.engine.handoff import HandoffStats


class KVTransferCollector:
    def __init__(self, transfers: TransferStats, handoffs: HandoffStats, model_name: str):
        self.transfers, self.handoffs, self.model_name = transfers, handoffs, model_name

    def collect(self) -> Iterator[Metric]:
        t, h = self.transfers, self.handoffs
        bytes_ = CounterMetricFamily("ladle:kv_transfer_bytes", "Bytes of K/V moved between prefill and decode "
                                     "workers (frames included).", labels=["model_name", "direction"])
        count = CounterMetricFamily("ladle:kv_transfers", "K/V transfers completed.",
                                    labels=["model_name", "direction"])
        for direction, nbytes, n in (("sent", t.sent_bytes, t.sent), ("received", t.received_bytes, t.received)):
            bytes_.add_metric([self.model_name, direction], nbytes)
            count.add_metric([self.model_name, direction], n)
        yield from (bytes_, count)
        seconds = CounterMetricFamily("ladle:kv_transfer_receive_seconds", "Time decode workers spent fetching "
                                      "K/V (connect to last byte, checks included).", labels=["model_name"])
        seconds.add_metric([self.model_name], t.receive_seconds)
        yield seconds
        failures = CounterMetricFamily("ladle:kv_transfer_failures", "Fetches that failed (the prompt was computed "
                                       "instead), by reason.", labels=["model_name", "reason"])
        for reason in sorted({"unreachable", "not_found", "corrupt", "protocol", *t.failures}):
            failures.add_metric([self.model_name, reason], t.failures.get(reason, 0))
        yield failures
        for name, doc, value in (
            ("ladle:kv_handoffs_exported", "Prompts whose K/V this prefill worker kept for a decode worker.",
             h.exported),
            ("ladle:kv_handoffs_imported", "Requests this decode worker continued from handed-over K/V.", h.imported),
            ("ladle:kv_handoff_tokens_imported", "Prompt tokens this decode worker took from handed-over K/V "
             "instead of computing.", h.imported_tokens),
            ("ladle:kv_handoffs_rejected", "Handed-over K/V that did not fit the request or this engine (the "
             "prompt was computed).", h.rejected),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
