"""ladle.router.stream_end: which forwarded streams ended properly, and the event that ends one that did not."""

from __future__ import annotations

import json

import pytest

from ladle.router.stream_end import StreamEnd


def fed(chunks: list[bytes], responses: bool = False) -> StreamEnd:
    end = StreamEnd(responses)
    for chunk in chunks:
        end.feed(chunk)
    return end


@pytest.mark.parametrize("stream", [
    [b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"],
    [b'data: {"choices": []}\n\ndata: [DO', b"NE]\n\n"],  # the ending split between two chunks
    [b'data: {"error": {"message": "engine failed"}}\n\n'],  # the worker's own error event
    [b'event: response.created\ndata: {"sequence_number": 0}\n\n', b"event: response.compl", b"eted\ndata: {}\n\n"],
    [b"event: response.failed\ndata: {}\n\n"],
])
def test_a_stream_that_reached_its_last_event_ended(stream: list[bytes]) -> None:
    assert fed(stream, responses=b"response." in b"".join(stream)).ended


def test_a_stream_cut_short_ends_in_an_error_event_never_done() -> None:
    end = fed([b'data: {"choices": [{"text": "Once"}]}\n\n', b'data: {"choices": [{"te'])
    assert not end.ended
    event = end.failure_event("the worker failed")
    assert event.startswith(b"\n\n")  # the event cut short is closed first
    body = json.loads(event.strip()[len(b"data: "):])
    assert body == {"error": {"message": "the worker failed", "type": "server_error", "param": None,
                              "code": "worker_failed"}}
    assert b"[DONE]" not in event


def test_a_responses_stream_cut_short_gets_an_error_event_numbered_after_the_last() -> None:
    end = fed([b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n',
               b'event: response.output_text.delta\ndata: {"sequence_number": 7, "delta": "Hi"}\n\n'], responses=True)
    assert not end.ended
    event = end.failure_event("the worker failed").decode()
    name, data = event.strip().split("\n")
    assert name == "event: error"
    assert json.loads(data[len("data: "):]) == {"type": "error", "code": "worker_failed",
                                                "message": "the worker failed", "param": None, "sequence_number": 8}
