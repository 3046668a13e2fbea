"""/v1/responses (OpenAI's Responses API) through the real `openai` SDK: the same prompts, sampling
and engine as /v1/chat/completions, so greedy replies and token counts must equal the chat route's."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_utils import GREEDY, MODEL, Server, app_server, chat


QUESTION = "Say hello in one short sentence."
USER = [{"role": "user", "content": QUESTION}]
# function tools in the Responses shape (flat), and the same in the chat shape
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}, "strict": True}
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                       "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                      "required": ["a", "b"], "additionalProperties": False}, "strict": True}
TOOLS = [WEATHER, ADD]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
ASK = "What is the weather in Paris, and what is 2 + 3?"


def respond(client: openai.OpenAI, input, **kw):
    return client.responses.create(model=MODEL, input=input, **{"max_output_tokens": 24, **GREEDY, **kw})


def prompt_tokens(server: Server, messages: list[dict]) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]


def test_plain_string_input_equals_the_chat_reply(server: Server, client: openai.OpenAI) -> None:
    r = respond(client, QUESTION)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "completed" and [c.type for c in item.content] == ["output_text"]
    assert r.output_text and r.output_text == item.content[0].text  # output_text: the SDK joins the parts
    # echoed settings, as OpenAI's response carries them
    assert (r.temperature, r.top_p, r.max_output_tokens, r.store) == (0.0, 1.0, 24, True)
    assert r.text.format.type == "text" and r.tools == [] and r.tool_choice == "auto"

    c = chat(client, USER, max_tokens=24)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens == prompt_tokens(server, USER)
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_instructions_are_a_system_message(client: openai.OpenAI) -> None:
    instructions = "You are a pirate. Answer like one."
    r = respond(client, QUESTION, instructions=instructions)
    c = chat(client, [{"role": "system", "content": instructions}, *USER], max_tokens=24)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.instructions == instructions
    assert r.output_text != respond(client, QUESTION).output_text  # the instructions changed the reply


def test_message_items_equal_chat_messages(client: openai.OpenAI) -> None:
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue.",
                                                                 "annotations": []}]},
        {"role": "user", "content": "Another one?"},
    ]
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
    r = respond(client, items)
    c = chat(client, messages, max_tokens=24)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_streamed_events_build_the_same_reply(client: openai.OpenAI) -> None:
    plain = respond(client, QUESTION, max_output_tokens=40)
    assert plain.status == "completed"
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=40, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()  # the SDK checks the sequence as it builds this
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(deltas)
    assert text == final.output_text == plain.output_text
    done = {e.type: e for e in events}
    assert done["response.output_text.done"].text == text and done["response.content_part.done"].part.text == text
    assert done["response.output_item.done"].item.id == final.output[0].id == events[2].item.id
    assert final.status == "completed" and final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert client.responses.retrieve(final.id).output_text == text  # streamed responses are stored too


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = respond(client, QUESTION, max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 2 and r.output_text
    # streamed, the last event says so (as OpenAI's does)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, stream=True, **GREEDY))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = respond(client, "My name is Ada. Say hi to me.", instructions="Be brief.")
    second = respond(client, "What is my name?", previous_response_id=first.id, instructions="Be friendly.")
    assert second.previous_response_id == first.id
    # the first turn's instructions are not carried over, its input and reply are
    history = [{"role": "system", "content": "Be friendly."},
               {"role": "user", "content": "My name is Ada. Say hi to me."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    c = chat(client, history, max_tokens=24)
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens
    alone = respond(client, "What is my name?", instructions="Be friendly.")
    assert alone.usage.input_tokens < second.usage.input_tokens  # the second turn really saw the first
    # a third turn continues the whole chain
    third = respond(client, "Say it again.", previous_response_id=second.id)
    chain = history[1:] + [{"role": "assistant", "content": second.output_text},
                           {"role": "user", "content": "Say it again."}]
    assert third.usage.input_tokens == chat(client, chain, max_tokens=1).usage.prompt_tokens


def test_unstored_and_unknown_responses_cannot_be_continued(client: openai.OpenAI) -> None:
    r = respond(client, QUESTION, store=False)
    assert r.store is False and r.output_text
    for missing in (r.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError) as err:
            respond(client, "And then?", previous_response_id=missing)
        body = err.value.body
        assert body["param"] == "previous_response_id" and missing in body["message"], body
        assert body["type"] == "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(missing)
        assert err.value.body["param"] == "response_id"


def test_retrieve_and_delete_a_stored_response(server: Server, client: openai.OpenAI) -> None:
    r = respond(client, QUESTION, metadata={"ticket": "42"}, user="u-7")
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"ticket": "42"} and got.user == "u-7"
    assert httpx.get(f"{server.base_url}/responses/{r.id}", params={"stream": "true"}).json()["error"]["param"] \
        == "stream"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_text_format_json_schema_through_sdk_parse(client: openai.OpenAI) -> None:
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    r = client.responses.parse(model=MODEL, input="Describe Paris. Reply with the JSON object only.",
                               text_format=City, max_output_tokens=80, **GREEDY)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City) and City.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"
    obj = respond(client, "Give me a JSON object with a key 'a'.", text={"format": {"type": "json_object"}},
                  max_output_tokens=60)
    assert isinstance(json.loads(obj.output_text), dict)


def test_bad_fields_are_400s_naming_them(server: Server, client: openai.OpenAI) -> None:
    limit = server.engine.max_model_len
    cases = [
        ({"input": QUESTION, "frequency_penalty": 0.5}, "frequency_penalty"),  # not a Responses field
        ({"input": QUESTION, "seed": 1}, "seed"),
        ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools[0].type"),  # hosted tools: not served
        ({"input": QUESTION, "tool_choice": "required"}, "tool_choice"),  # no tools
        ({"input": QUESTION, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "add"}}, "tool_choice"),
        ({"input": QUESTION, "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": QUESTION, "background": True}, "background"),
        ({"input": QUESTION, "reasoning": {"effort": "low"}}, "reasoning.effort"),  # needs --reasoning-parser
        ({"input": QUESTION, "truncation": "auto"}, "truncation"),
        ({"input": QUESTION, "text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": QUESTION, "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": QUESTION, "temperature": -1}, "temperature"),
        ({"input": QUESTION, "top_p": 0}, "top_p"),
        ({"input": QUESTION, "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": QUESTION, "max_output_tokens": limit + 1}, "max_output_tokens"),
        ({"input": QUESTION, "metadata": {"k": "v" * 600}}, "metadata.k"),
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": "hello " * (limit + 10)}, "input"),  # over the context
        ({"input": [{"type": "file_search_call", "id": "c"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].image_url"),  # a text-only model
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": "hi", "name": "x"}]}, "input[0].name"),
    ]
    r = httpx.post(f"{server.base_url}/responses", json={"input": QUESTION, "model": "gpt-4o"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "gpt-4o" in r.json()["error"]["message"]
    for body, param in cases:
        r = httpx.post(f"{server.base_url}/responses", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and param.split(".")[0].split("[")[0] in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:  # and through the SDK, streamed: before the stream starts
        client.responses.create(model=MODEL, input=QUESTION, stream=True, extra_body={"top_k": 3})
    assert err.value.body["param"] == "top_k"


def test_the_store_keeps_only_the_most_recent(async_engine) -> None:
    with app_server(async_engine, max_stored_responses=2) as server, \
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        ids = [respond(client, QUESTION, max_output_tokens=1).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])  # the least recently used, dropped
        for kept in ids[1:]:
            assert respond(client, "More.", max_output_tokens=1, previous_response_id=kept, store=False).output_text


# -- function tools -----------------------------------------------------------------------


def _calls(r) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in r.output if item.type == "function_call"]


@pytest.mark.parametrize("tool_choice, chat_choice", [
    ("required", "required"),
    ({"type": "function", "name": "add"}, {"type": "function", "function": {"name": "add"}})])
def test_function_calls_equal_the_chat_routes(client: openai.OpenAI, tool_choice, chat_choice) -> None:
    # one call each: greedy, the 135M model repeats parallel calls past any token budget
    r = respond(client, ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_output_tokens=200)
    c = chat(client, [{"role": "user", "content": ASK}], tools=CHAT_TOOLS, tool_choice=chat_choice,
             parallel_tool_calls=False, max_tokens=200)
    assert r.status == "completed" and c.choices[0].finish_reason == "tool_calls"
    assert _calls(r) == [(t.function.name, t.function.arguments) for t in c.choices[0].message.tool_calls]
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    for item in r.output:
        if item.type == "function_call":
            assert item.id.startswith("fc_") and item.call_id.startswith("call_") and item.status == "completed"
            jsonschema.validate(json.loads(item.arguments), schemas[item.name])
    if isinstance(tool_choice, dict):
        assert [name for name, _ in _calls(r)] == ["add"] and r.tool_choice.name == "add"
    assert [t.name for t in r.tools] == ["get_weather", "add"]
    assert r.usage.input_tokens == c.usage.prompt_tokens  # the tools were shown to the model the same way


def test_a_function_result_continues_by_previous_response_id(client: openai.OpenAI) -> None:
    first = respond(client, ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                    max_output_tokens=80)
    [call] = [item for item in first.output if item.type == "function_call"]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    second = respond(client, result, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                     max_output_tokens=30)
    # the same conversation spelled out for the chat route: the call, then its result
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"}]
    c = chat(client, history, tools=CHAT_TOOLS, tool_choice="none", max_tokens=30)
    assert second.output_text == c.choices[0].message.content and second.output_text
    assert second.usage.input_tokens == c.usage.prompt_tokens
    # and passing the call back as an input item, as a client without a store does, is the same turn
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), *result]
    again = respond(client, items, tools=TOOLS, tool_choice="none", max_output_tokens=30, store=False)
    assert again.output_text == second.output_text and again.usage.input_tokens == second.usage.input_tokens


def test_streamed_function_calls_build_the_same_items(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=200, **GREEDY)
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()  # the SDK rebuilds every item from the events
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] * len(_calls(plain))
    assert all(e.item.arguments == "" and e.item.status == "in_progress" for e in added)
    assert kinds.count("response.function_call_arguments.delta") > len(added)  # arguments arrive in pieces
    for e in added:
        pieces = [d.delta for d in events if d.type == "response.function_call_arguments.delta"
                  and d.item_id == e.item.id]
        [done] = [d for d in events if d.type == "response.function_call_arguments.done" and d.item_id == e.item.id]
        assert "".join(pieces) == done.arguments
    assert _calls(final) == _calls(plain) and final.usage.output_tokens == plain.usage.output_tokens
    assert [item.id for item in final.output] == [e.item.id for e in added]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_call_items_join_the_assistant_message_before_them() -> None:
    from ladle.server.responses import input_messages

    call = {"type": "function_call", "name": "add", "arguments": '{"a": 2, "b": 3}', "status": "completed"}
    messages = input_messages([
        {"role": "user", "content": ASK},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {**call, "call_id": "call_1"}, {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "function_call_output", "call_id": "call_2", "output": "5"},
        {**call, "call_id": "call_3"}])
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert messages[1].content == "Let me check." and [c.id for c in messages[1].tool_calls] == ["call_1", "call_2"]
    assert [m.tool_call_id for m in messages[2:4]] == ["call_1", "call_2"]
    assert messages[4].content is None and messages[4].tool_calls[0].function.arguments == '{"a": 2, "b": 3}'
