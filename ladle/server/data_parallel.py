"""`ladle serve --data-parallel-size N`: N engine processes behind the router, on one port.

Each replica is a `ladle serve` of its own (its own threads and KV pool) on a free loopback port;
this process runs `ladle router` in front of them with the chosen policy and stops them when it
stops. Across machines, run `ladle serve` on each and `ladle router --worker URL ...` instead.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import time

from ladle.distributed.processes import die_with_parent, free_port

# flags that belong to the fleet, not to each replica (with how many values they take)
FLEET_FLAGS = {"--data-parallel-size": 1, "-dp": 1, "--router-policy": 1, "--host": 1, "--port": 1}
START_TIMEOUT_SECONDS = 600.0


def replica_argv(argv: list[str]) -> list[str]:
    """The serve flags every replica gets: argv without the fleet's own."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in FLEET_FLAGS:
            skip = 0 if "=" in arg else FLEET_FLAGS[name]
            continue
        out.append(arg)
    return out


def threads_per_replica(args: argparse.Namespace) -> int:
    """--num-threads as given, else the cores shared out evenly (at least one each)."""
    if args.num_threads is not None:
        return args.num_threads
    return max(1, (os.cpu_count() or 1) // args.data_parallel_size)


def start_replicas(args: argparse.Namespace, argv: list[str]) -> list[tuple[subprocess.Popen, str]]:
    base = replica_argv(argv)
    threads = threads_per_replica(args)
    replicas = []
    for i in range(args.data_parallel_size):
        port = free_port()
        cmd = [sys.executable, "-m", "ladle.cli", "serve", *base, "--host", "127.0.0.1", "--port", str(port),
               "--no-webui"] + ([] if args.num_threads is not None else ["--num-threads", str(threads)])
        print(f"ladle: replica {i} on 127.0.0.1:{port} ({threads} thread(s))", file=sys.stderr, flush=True)
        # SIGTERM when the fleet's process dies: a replica still stops cleanly
        replicas.append((subprocess.Popen(cmd, preexec_fn=functools.partial(die_with_parent, signal.SIGTERM)),
                         f"http://127.0.0.1:{port}"))
    return replicas


def wait_healthy(replicas: list[tuple[subprocess.Popen, str]]) -> None:
    """Until every replica answers /health; raises RuntimeError when one exits first."""
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    pending = list(replicas)
    while pending:
        proc, url = pending[0]
        if proc.poll() is not None:
            raise RuntimeError(f"replica {url} exited with status {proc.returncode} while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica {url} did not become healthy in {START_TIMEOUT_SECONDS:.0f} s")
        time.sleep(0.5)


def stop_replicas(replicas: list[tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in replicas:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _ in replicas:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(0)


def run_fleet(args: argparse.Namespace, argv: list[str]) -> int:
    import uvicorn

    from ladle.router.app import build_app
    from ladle.router.config import RouterConfig

    if args.data_parallel_size < 1:
        print("ladle serve: --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    replicas = start_replicas(args, argv)
    try:
        wait_healthy(replicas)
        urls = [url for _, url in replicas]
        app = build_app(RouterConfig(workers=urls, policy=args.router_policy))
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"ladle: {len(urls)} replicas behind the router ({args.router_policy}) at "
              f"http://{host}:{args.port}/v1", file=sys.stderr, flush=True)
        # uvicorn re-raises the SIGTERM it caught once it has shut down: let that unwind through
        # the `finally` below (which stops the replicas) instead of killing this process there
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_keep_alive=30)
    except RuntimeError as e:
        print(f"ladle serve: {e}", file=sys.stderr)
        return 1
    finally:
        stop_replicas(replicas)
    return 0
