"""Kill a worker under load: `ladle serve --data-parallel-size 2`, thousands of mixed requests at concurrency
32 (streams raw and through the openai SDK, Responses streams, streams the client drops, plain and decision
requests, bad bodies, prompts too long), one engine process SIGKILLed partway. Counts how every request
ended. A stream must end with its last event ([DONE], or a Responses stream's response.completed) or an
error event: one that just stops ("silent") looks like a short finished reply, and the script fails if it
sees any. The SDK must raise for every stream that broke off.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port, machine  # noqa: E402

MODEL = "default"
KINDS = ("chat raw", "completion raw", "chat sdk", "responses raw", "dropped", "plain", "decision", "bad body",
         "too long")


def start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ladle.cli", "serve", "--data-parallel-size", "2", "--max-waiting-requests", "64",
           "--port", str(port), "--num-threads", "1", "--no-webui", "--served-model-name", MODEL,
           "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json().get("healthy_workers") == 2:
                return proc
        except (httpx.HTTPError, json.JSONDecodeError):
            pass
        assert proc.poll() is None, "the server exited at start"
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def replicas(proc: subprocess.Popen) -> list[int]:
    """The engine processes the data-parallel server started (its children)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def stream_end(url: str, path: str, body: dict, drop_after: int | None = None) -> str:
    """How a raw stream ended: "done", "error event", "silent", "dropped" or "refused <status>"."""
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            return f"refused {r.status_code}"
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if drop_after is not None and len(events) == drop_after:
                    return "dropped"
    if not events:
        return "silent"
    if events[-1] == "[DONE]":
        return "done"
    last = json.loads(events[-1])
    if last.get("type") in ("response.completed", "response.incomplete"):  # a Responses stream's own last event
        return "done"
    # chat and completions: {"error": {...}}; a Responses stream: its own `error` event ({"type": "error",
    # "code", "message", ...}, no "error" key) or response.failed
    if last.get("type") in ("error", "response.failed") or "error" in last and last.get("type") is None:
        return "error event"
    return "silent"


def sdk_stream(url: str, body: dict) -> str:
    """The openai SDK's view: "done" (a finish_reason came), "raised", or "silent" (it ended without one)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    finished = False
    try:
        for chunk in client.chat.completions.create(stream=True, **body):
            finished = finished or any(c.finish_reason for c in chunk.choices)
    except openai.APIError:
        return "raised"
    return "done" if finished else "silent"


def one(url: str, i: int, long_prompt: str) -> tuple[str, str]:
    rng = random.Random(i)
    kind = rng.choice(KINDS)
    tokens = rng.randrange(8, 64)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about item {i}."}],
            "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    if kind == "chat raw":
        return kind, stream_end(url, "/v1/chat/completions", {**chat, "stream": True})
    if kind == "completion raw":
        body = {"model": MODEL, "prompt": f"Item {i} is", "max_tokens": tokens, "stream": True, "ignore_eos": True}
        return kind, stream_end(url, "/v1/completions", body)
    if kind == "chat sdk":
        return kind, sdk_stream(url, {k: v for k, v in chat.items() if k != "ignore_eos"})
    if kind == "responses raw":
        body = {"model": MODEL, "input": f"Describe item {i}.", "max_output_tokens": tokens, "stream": True}
        return kind, stream_end(url, "/v1/responses", body)
    if kind == "dropped":
        return kind, stream_end(url, "/v1/chat/completions", {**chat, "stream": True}, drop_after=2)
    if kind == "decision":
        body = {"model": MODEL, "input": f"Ticket {i}: the app crashes on sync.",
                "questions": [{"id": "team", "type": "choice", "question": "Which team?",
                               "options": [{"name": "billing"}, {"name": "technical"}]}]}
        r = httpx.post(url + "/v1/decisions", json=body, timeout=300)
    elif kind == "bad body":
        r = httpx.post(url + "/v1/chat/completions", json={**chat, "max_tokens": -3}, timeout=300)
    elif kind == "too long":
        r = httpx.post(url + "/v1/chat/completions", timeout=300,
                       json={**chat, "messages": [{"role": "user", "content": long_prompt}]})
    else:
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=300)
    shaped = "error" in r.json() if r.status_code != 200 else True
    return kind, f"{r.status_code}" + ("" if shaped else " (not in the error shape)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--kill-after", type=float, default=40.0, help="seconds into the run")
    ap.add_argument("--out", default=None, help="the counts as JSON")
    ap.add_argument("--quick", action="store_true", help="smoke run: 36 requests, the kill after 12 of them")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.concurrency = 36, 8
    print(f"machine: {machine()}")
    port = free_port()
    server = start_server(port)
    url = f"http://127.0.0.1:{port}"
    long_prompt = "word " * 20000
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    lock = threading.Lock()
    killed = None
    try:
        victim = replicas(server)[0]
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futures = [pool.submit(one, url, i, long_prompt) for i in range(args.requests)]
            done_before = 0
            while any(not f.done() for f in futures):
                done = sum(f.done() for f in futures)
                due = done >= args.requests // 3 if args.quick else time.monotonic() - started >= args.kill_after
                if killed is None and due:
                    os.kill(victim, signal.SIGKILL)
                    killed = (time.monotonic() - started, done)
                    print(f"  SIGKILLed engine process {victim} at {killed[0]:.1f} s ({done} requests done)",
                          flush=True)
                if done - done_before >= max(1, args.requests // 10):
                    print(f"  {done}/{args.requests} requests done, {time.monotonic() - started:.0f} s", flush=True)
                    done_before = done
                time.sleep(0.1)
            for f in futures:
                kind, how = f.result()
                with lock:
                    outcomes[(kind, how)] += 1
        health = httpx.get(f"{url}/health", timeout=10).json()
        seconds = time.monotonic() - started
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    print(f"\n{args.requests} requests at concurrency {args.concurrency} in {seconds:.0f} s; "
          f"one of 2 engines SIGKILLed at {killed[0]:.1f} s; /health afterwards: {health}")
    print("\n| request | ended | count |\n| --- | --- | --- |")
    for (kind, how), n in sorted(outcomes.items()):
        print(f"| {kind} | {how} | {n} |")
    streams = sum(n for (kind, _), n in outcomes.items() if kind in ("chat raw", "completion raw", "responses raw"))
    silent = sum(n for (_, how), n in outcomes.items() if how == "silent")
    broken = sum(n for (kind, how), n in outcomes.items() if how == "error event")
    raised = outcomes[("chat sdk", "raised")]
    unshaped = sum(n for (_, how), n in outcomes.items() if "not in the error shape" in how)
    print(f"\nstreams read to their end: {streams} raw, {sum(n for (k, _), n in outcomes.items() if k == 'chat sdk')} "
          f"through the SDK; error events {broken}, SDK raised {raised}; silent cuts: {silent}; "
          f"errors not in OpenAI's shape: {unshaped}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "args": vars(args), "killed_at_s": killed[0],
                                              "outcomes": {f"{k} | {h}": n for (k, h), n in outcomes.items()}},
                                             indent=1))
    if silent or unshaped:
        sys.exit(1)


if __name__ == "__main__":
    main()
