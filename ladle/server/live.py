"""The running requests a client may cancel by name (ladle.server.cancel)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LiveRequests:
    """The running requests a cancel may name: client request_id or response id -> engine request ids."""

    by_name: dict[str, list[str]] = field(default_factory=dict)

    def add(self, names: list[str | None], engine_ids: list[str]) -> "Tracked":
        """Track a request under each of its names (None: no such name) until `remove`."""
        tracked = Tracked(tuple(n for n in names if n), engine_ids)
        for name in tracked.names:
            self.by_name[name] = engine_ids
        return tracked

    def remove(self, tracked: "Tracked") -> None:
        for name in tracked.names:
            if self.by_name.get(name) is tracked.engine_ids:  # not a later request's under the same name
                del self.by_name[name]

    def get(self, name: str) -> list[str] | None:
        return self.by_name.get(name)


@dataclass(frozen=True)
class Tracked:
    names: tuple[str, ...]
    engine_ids: list[str]
