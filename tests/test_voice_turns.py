"""Voice-agent turns through the server: drafts cancelled by request id or by leaving, follow-ups
that start where the draft stopped, barge-in continuations and per-request timings."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from server_utils import GREEDY, MODEL, Server, chat

SYSTEM = ("You are a restaurant's phone agent. Answer in one or two short spoken sentences, no lists, no "
          "markdown. Confirm names, dates, times and party sizes back to the caller before booking.")


def conversation(user: str) -> list[dict]:
    # a unique first line: nothing another test sent can be in the cache for it
    return [{"role": "system", "content": f"[call {uuid.uuid4().hex[:8]}] {SYSTEM}"},
            {"role": "user", "content": user}]


def events(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def body(messages: list[dict], **kw) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY, **kw}


def reply(server: Server, messages: list[dict], **kw) -> dict:
    """A non-streamed chat reply's JSON."""
    payload = {**body(messages), "stream": False, "stream_options": None, **kw}
    response = httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def tokens(server: Server, messages: list[dict]) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cancel(server: Server, request_id: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/requests/{request_id}/cancel")


def test_a_draft_cancelled_by_its_request_id_ends_with_abort_and_its_prompt_serves_the_follow_up(server: Server):
    draft_messages = conversation("Hi, I'd like to book a table for")
    rid = f"draft-{uuid.uuid4().hex}"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/chat/completions", json=body(draft_messages, request_id=rid)) as r:
            assert r.status_code == 200
            chunks = events(r)
            first = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))
            assert first["id"] == f"chatcmpl-{rid}"
            assert cancel(server, rid).status_code == 200  # the connection stays open meanwhile
            rest = list(chunks)
    finishing = [c for c in rest if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finishing] == ["abort"]
    usage = rest[-1]["usage"]
    assert 0 < usage["completion_tokens"] < 200  # it stopped early, and says how far it got
    server.wait_idle()  # every block it held is back

    gone = cancel(server, rid)  # it is over: nothing to cancel
    assert gone.status_code == 404
    assert gone.json()["error"]["param"] == "request_id" and gone.json()["error"]["code"] == "request_not_found"

    # the caller kept talking: the final transcript extends the draft's
    final_messages = [draft_messages[0], {"role": "user", "content": "Hi, I'd like to book a table for four tonight."}]
    shared = common_prefix(tokens(server, draft_messages), tokens(server, final_messages))
    usage = reply(server, final_messages, max_tokens=4)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == shared  # to the token, partial block too


def test_a_draft_cancelled_by_disconnecting_frees_its_blocks_and_keeps_its_prompt(server: Server):
    messages = conversation("My order number is 4 4 7 1 and the parcel never")
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/chat/completions", json=body(messages)) as r:
            next(c for c in events(r) if c["choices"] and c["choices"][0]["delta"].get("content"))
    server.wait_idle()
    longer = [messages[0], {"role": "user", "content": messages[1]["content"] + " arrived, can you check it?"}]
    shared = common_prefix(tokens(server, messages), tokens(server, longer))
    assert reply(server, longer, max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"] == shared


def test_many_cancelled_drafts_return_the_pool_to_its_baseline(server: Server):
    baseline = server.wait_idle()
    before = server.scrape().get('vllm:request_success_total{finished_reason=abort}', 0.0)
    messages = conversation("I need to move my appointment on")
    with httpx.Client(timeout=60) as http:
        for i in range(30):
            messages[1]["content"] += f" {i}"
            rid = f"many-{uuid.uuid4().hex}"
            with http.stream("POST", f"{server.base_url}/chat/completions", json=body(messages, request_id=rid)) as r:
                chunks = events(r)  # (dropping this generator would close the connection)
                next(chunks)  # the role chunk: admitted
                if i % 2:
                    assert cancel(server, rid).status_code == 200
                    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "abort" for c in chunks)
    after = server.wait_idle()
    assert after["num_free_blocks"] == baseline["num_free_blocks"] == after["num_blocks"]
    # vLLM's counter for aborted requests counts both kinds of cancel
    assert server.scrape()['vllm:request_success_total{finished_reason=abort}'] - before == 30


def test_cancel_names_only_running_requests_and_request_ids_are_checked(server: Server):
    assert cancel(server, "never-sent").status_code == 404
    bad = httpx.post(f"{server.base_url}/chat/completions",
                     json={**body(conversation("hello")), "request_id": "no spaces/allowed"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    rid = f"twice-{uuid.uuid4().hex}"
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/chat/completions",
                         json=body(conversation("hello"), request_id=rid)) as r:
            chunks = events(r)
            next(chunks)
            again = http.post(f"{server.base_url}/chat/completions", json=body(conversation("hi"), request_id=rid))
            assert again.status_code == 400 and again.json()["error"]["param"] == "request_id"
            assert cancel(server, f"chatcmpl-{rid}").status_code == 200  # the response id names it too
    completion = httpx.post(f"{server.base_url}/completions",
                            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2,
                                  "request_id": "c-1"}).json()
    assert completion["id"] == "cmpl-c-1"


def test_barge_in_keeps_what_was_heard_and_continues_it(server: Server, client: openai.OpenAI):
    messages = conversation("What are your opening hours on Sunday?")
    full = chat(client, messages, max_tokens=32).choices[0].message.content
    heard = full[: full.index(" ", len(full) // 3)]  # the caller cut in a third of the way through
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    kept = messages + [{"role": "assistant", "content": heard}]
    rest = chat(client, kept, max_tokens=24, extra_body=flags)
    continued = heard + rest.choices[0].message.content
    n = min(len(continued), len(full))
    assert n > len(heard) and continued[:n] == full[:n]  # greedy: the continuation is the reply's own
    assert rest.usage.prompt_tokens_details.cached_tokens >= len(tokens(server, messages))  # and the cache held
    with pytest.raises(openai.BadRequestError) as err:  # continuing and opening a new turn at once
        chat(client, kept, extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert err.value.body["param"] == "continue_final_message"


def check_timings(timings: dict, usage: dict) -> None:
    assert timings["prompt_tokens"] == usage["prompt_tokens"]
    assert timings["completion_tokens"] == usage["completion_tokens"]
    assert timings["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= timings["queued_ms"] and 0 < timings["prefill_ms"]
    assert timings["first_token_ms"] == pytest.approx(timings["queued_ms"] + timings["prefill_ms"], abs=0.01)
    assert timings["first_token_ms"] <= timings["last_token_ms"] < 60_000


def test_timings_are_opt_in_and_add_up(server: Server):
    messages = conversation("Do you have a table for two at eight?")
    assert "timings" not in reply(server, messages, max_tokens=8)
    timed = reply(server, messages, max_tokens=8, include_timings=True)
    check_timings(timed["timings"], timed["usage"])
    assert timed["timings"]["cached_tokens"] > 0  # the same prompt again

    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/chat/completions",
                         json=body(messages, max_tokens=8, include_timings=True)) as r:
            chunks = list(events(r))
    assert all("timings" not in c for c in chunks[:-1])
    check_timings(chunks[-1]["timings"], chunks[-1]["usage"])  # the last chunk: usage and timings
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/chat/completions",
                         json={**body(messages, max_tokens=8, include_timings=True), "stream_options": None}) as r:
            last = list(events(r))[-1]
    assert last["choices"] == [] and "usage" not in last and last["timings"]["completion_tokens"] == 8

    completion = httpx.post(f"{server.base_url}/completions",
                            json={"model": MODEL, "prompt": ["One, two,", "Red, green,"], "max_tokens": 3,
                                  "include_timings": True, **GREEDY}).json()
    check_timings(completion["timings"], completion["usage"])
