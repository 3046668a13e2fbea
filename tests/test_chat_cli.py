"""`ladle chat`: driven through its standard input as a user's terminal would, against a real ladle
server (`--base-url`) and in process on the embedded model; replies checked against the server's own
greedy answers to the same messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import GREEDY, MODEL, Server

from ladle import chat as chat_cli
from ladle.chat import RemoteChat, Sampling, content_deltas

FRANCE = "What is the capital of France?"
GERMANY = "And of Germany?"  # means something only after FRANCE
SYSTEM = "You are a terse geography teacher."
LONG = "Write a long story about a cat who lives in Paris."


def answer(client: openai.OpenAI, messages: list[dict], max_tokens: int = 16) -> str:
    """The server's greedy reply, not streamed."""
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
    return reply.choices[0].message.content


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# stdout a pipe, as for a user's `ladle chat | tee log`: block-buffered unless the chat flushes each piece
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def run_chat(args: list[str], stdin: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ladle.cli", "chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=ENV)


class ChatProcess:
    """`ladle chat` as a subprocess whose output is read as it comes, each read timestamped."""

    def __init__(self, args: list[str], sigint_ignored: bool = False):
        self.stderr = tempfile.TemporaryFile()
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        self.proc = subprocess.Popen([sys.executable, "-m", "ladle.cli", "chat", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, bufsize=0, env=ENV,
                                     preexec_fn=ignore)
        self.reads: list[tuple[float, bytes]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while data := os.read(self.proc.stdout.fileno(), 65536):
            self.reads.append((time.monotonic(), data))

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def __enter__(self) -> "ChatProcess":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait_for_reads(self, count: int, timeout: float = 180) -> list[tuple[float, bytes]]:
        deadline = time.monotonic() + timeout
        while len(self.reads) < count:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.reads
            time.sleep(0.01)
        return list(self.reads)

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        """Close standard input (EOF), wait; (exit status, stdout, stderr)."""
        self.proc.stdin.close()
        rc = self.proc.wait(timeout)
        self.reader.join(10)
        self.stderr.seek(0)
        return rc, self.stdout, self.stderr.read().decode()

    @property
    def stdout(self) -> str:
        return b"".join(data for _, data in self.reads).decode()


def test_two_turns_follow_the_history_and_exit_stops(server: Server, client: openai.OpenAI) -> None:
    first = answer(client, [user(FRANCE)])
    second = answer(client, [user(FRANCE), {"role": "assistant", "content": first}, user(GERMANY)])
    assert second != answer(client, [user(GERMANY)])  # so the second turn shows the history was sent
    proc = run_chat(["--base-url", server.base_url, "--temperature", "0", "--max-tokens", "16"],
                    f"{FRANCE}\n{GERMANY}\n/exit\n{FRANCE}\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{first}\n\n{second}\n\n"  # nothing after /exit


def test_reset_forgets_but_keeps_the_system_prompt(server: Server, client: openai.OpenAI) -> None:
    system = {"role": "system", "content": SYSTEM}
    first = answer(client, [system, user(FRANCE)])
    fresh = answer(client, [system, user(GERMANY)])
    assert fresh != answer(client, [system, user(FRANCE), {"role": "assistant", "content": first}, user(GERMANY)])
    proc = run_chat(["--base-url", server.base_url, "--temperature", "0", "--max-tokens", "16", "--system", SYSTEM],
                    f"{FRANCE}\n/reset\n{GERMANY}\n")  # then end of input
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{first}\n\n(conversation cleared)\n\n{fresh}\n\n"


def test_quit_and_end_of_input_exit_0(server: Server) -> None:
    for stdin in ("/quit\nhello\n", ""):
        proc = run_chat(["--base-url", server.base_url], stdin)
        assert (proc.returncode, proc.stdout) == (0, ""), proc.stderr


def test_an_unreachable_server_is_a_clear_error() -> None:
    proc = run_chat(["--base-url", "http://127.0.0.1:9/v1"], "hello\n")
    assert proc.returncode == 2
    assert proc.stderr.startswith("ladle chat: cannot reach http://127.0.0.1:9/v1"), proc.stderr


def test_the_sse_reader_yields_a_real_stream_piece_by_piece(server: Server, client: openai.OpenAI) -> None:
    whole = answer(client, [user(LONG)], max_tokens=32)
    body = {"model": MODEL, "messages": [user(LONG)], "max_tokens": 32, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=300) as r:
        pieces = list(content_deltas(r.iter_lines()))
    assert len(pieces) > 10 and "".join(pieces) == whole
    chat = RemoteChat(server.url)  # the server's root works as well as .../v1; the model: the first listed
    timed: list[tuple[float, str]] = []
    reply = chat.reply([user(LONG)], Sampling(temperature=0, max_tokens=32),
                       lambda piece: timed.append((time.monotonic(), piece)))
    assert chat.model == MODEL and reply == whole and len(timed) > 10
    assert timed[-1][0] - timed[0][0] > 0.05  # written as they came, not all at the end


def test_replies_print_as_they_stream_and_ctrl_c_stops_one(server: Server, client: openai.OpenAI) -> None:
    # started with SIGINT ignored, as a parent may pass it on (Python then raises no KeyboardInterrupt
    # unless the chat restores the handler); 1200 tokens of story take seconds, so Ctrl-C lands mid-reply
    with ChatProcess(["--base-url", server.base_url, "--temperature", "0", "--max-tokens", "1200"],
                     sigint_ignored=True) as chat:
        chat.send(f"{LONG}\n")
        reads = chat.wait_for_reads(4)  # the reply's first pieces, each read as it was written
        assert reads[-1][0] - reads[0][0] > 0.02  # spread over time, not all at once
        chat.proc.send_signal(signal.SIGINT)
        chat.send(f"{FRANCE}\n")
        rc, stdout, stderr = chat.finish()
    assert rc == 0, stderr
    head, stopped, tail = stdout.partition("\n(reply stopped)\n\n")
    assert stopped and LONG not in head and len(head) > 0, (len(stdout), stdout[-300:], stderr[-300:])
    assert tail == f"{answer(client, [user(FRANCE)], max_tokens=1200)}\n\n"  # the stopped turn was not kept
    stats = server.wait_idle()  # the aborted request left the engine
    assert stats["num_unfinished_requests"] == 0


def test_in_process_on_the_embedded_model(smollm2_dir: Path, client: openai.OpenAI) -> None:
    """No --base-url: the engine runs in the chat's own process (the same model as the server's)."""
    with ChatProcess(["--temperature", "0", "--max-tokens", "200", "--num-kv-blocks", "256"]) as chat:
        chat.send(f"{LONG}\n")
        reads = chat.wait_for_reads(4)
        assert reads[-1][0] - reads[0][0] > 0.02
        chat.proc.send_signal(signal.SIGINT)
        chat.send(f"{FRANCE}\n{GERMANY}\n")
        rc, stdout, stderr = chat.finish()
    assert rc == 0, stderr
    first = answer(client, [user(FRANCE)], max_tokens=200)
    second = answer(client, [user(FRANCE), {"role": "assistant", "content": first}, user(GERMANY)], max_tokens=200)
    head, stopped, tail = stdout.partition("\n(reply stopped)\n\n")
    assert stopped and head and tail == f"{first}\n\n{second}\n\n"


def test_a_stream_that_fails_to_close_after_ctrl_c_is_a_stopped_reply(capsys: pytest.CaptureFixture) -> None:
    class Closing:  # Ctrl-C lands while the stream is read; closing it then fails with a transport error
        def reply(self, messages, sampling, write):
            try:
                try:
                    write("Once upon")
                    raise KeyboardInterrupt
                finally:
                    raise httpx.ReadError("connection reset while closing")
            except httpx.HTTPError as e:
                raise chat_cli.ChatError(str(e)) from e

    class Failing:
        def reply(self, messages, sampling, write):
            raise chat_cli.ChatError("the server said no")

    conversation = chat_cli.Conversation()
    chat_cli.answer(Closing(), conversation, chat_cli.Sampling(), "Tell me a story.")
    assert "(reply stopped)" in capsys.readouterr().out and not conversation.turns
    chat_cli.answer(Failing(), conversation, chat_cli.Sampling(), "Tell me a story.")
    assert "the server said no" in capsys.readouterr().err and not conversation.turns
