"""`ladle serve --data-parallel-size N`: N engine processes behind the router on one port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from ladle.server.data_parallel import replica_argv
from tests.server_utils import free_port

pytestmark = pytest.mark.slow  # starts worker processes: make test-fast leaves it out


def test_each_replica_gets_the_serve_flags_but_not_the_fleets() -> None:
    argv = ["--data-parallel-size", "2", "--port=9000", "--num-kv-blocks", "64", "--router-policy", "kv_events",
            "--host", "0.0.0.0", "--seed", "3", "-dp=2"]
    assert replica_argv(argv) == ["--num-kv-blocks", "64", "--seed", "3"]


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ladle serve exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the fleet did not become healthy")


def replica_pids(parent: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_two_replicas_serve_behind_one_port_and_stop_with_it() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "ladle.cli", "serve", "--data-parallel-size", "2", "--port", str(port),
           "--router-policy", "round_robin", "--num-kv-blocks", "64", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, proc)
        pids = replica_pids(proc.pid)
        assert len(pids) == 2
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
        texts = {httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
                 ["content"] for _ in range(4)}
        assert len(texts) == 1  # the same greedy answer from either replica
        workers = httpx.get(f"{url}/workers").json()
        workers = workers["workers"] if isinstance(workers, dict) else workers
        assert len(workers) == 2 and all(w["healthy"] for w in workers)
        assert sorted(w["requests_total"] for w in workers) == [2, 2]  # round robin shared them out
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert "2 replicas behind the router" in err
    for pid in pids:  # the replicas went with it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
