"""Small helpers for the processes ladle starts beside itself (replicas, tensor-parallel ranks)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent(sig: int) -> None:
    """In a child before it starts (a preexec_fn): Linux sends it `sig` when the parent dies, even by
    SIGKILL, so no child outlives the process that started it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
