"""RouterConfig: the workers, the routing policy and its tuning, as the CLI or `ladle serve` give them."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_load", "cache_aware", "kv_events")


@dataclass
class RouterConfig:
    workers: list[str] = field(default_factory=list)  # base URLs without /v1
    policy: str = "cache_aware"
    prefill: list[str] = field(default_factory=list)  # disaggregated mode: both lists set, workers unused
    decode: list[str] = field(default_factory=list)
    health_check_interval: float = 2.0
    max_retries: int = 2
    # cache_aware, named as SGLang's router names them
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**22  # characters per worker
    request_timeout: float = 600.0  # seconds an upstream may go quiet mid-reply
    prefill_timeout: float = 120.0  # the disaggregated prefill hop, before decode recomputes instead

    def __post_init__(self) -> None:
        self.workers = [strip_url(u) for u in self.workers]
        self.prefill = [strip_url(u) for u in self.prefill]
        self.decode = [strip_url(u) for u in self.decode]
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("disaggregated mode needs both --prefill and --decode workers")
        if not (self.workers or self.prefill):
            raise ValueError("give at least one --worker (or --prefill and --decode)")
        if self.max_retries < 0:
            raise ValueError("--max-retries must be >= 0")
        if self.health_check_interval <= 0:
            raise ValueError("--health-check-interval must be > 0")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)


def strip_url(url: str) -> str:
    """A worker's base URL: scheme added if missing, no trailing slash, no /v1."""
    url = url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url[: -len("/v1")] if url.endswith("/v1") else url
