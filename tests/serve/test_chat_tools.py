"""Tool calls on `/v1/chat/completions` as an OpenAI-SDK agent loop uses them, against
`tandem serve --enable-auto-tool-choice --tool-call-parser hermes`.

The tiny model never writes a tool call of its own, so these tests script its choices: each decode step's logits
are replaced by ones that put all mass on the next token of a scripted reply (chosen by what the prompt holds).
Everything else — the template rendering the tools and the tool messages, the parser, the HTTP shapes, the SDK —
runs as it would with a model that calls tools.
"""

import json

import openai
import pytest

from tandem.serve.engine import Engine
from tandem.tasks import TINY_MODEL_PATH
from tests.conftest import ServerThread

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>'
ANSWER = "The sum is 42."


def scripted_server(tokenizer, parser: str, call: str) -> ServerThread:
    """A server reading `parser` calls whose model writes `call` to a fresh question and ANSWER once a tool response
    is in the prompt."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    scripts = {False: tokenizer.encode(call) + [eos], True: tokenizer.encode(ANSWER) + [eos]}
    answered = tokenizer.encode("<tool_response>")[0]
    server = ServerThread(enable_auto_tool_choice=True, tool_call_parser=parser)
    engine = server.server.engine

    def scripted_emit(rows, logits):
        for b, i in enumerate(rows):
            request, seq = engine.rows[i]
            script = scripts[answered in request.prompt]
            logits[b] = float("-inf")
            logits[b, script[min(len(seq.output), len(script) - 1)]] = 0.0
        return Engine._emit(engine, rows, logits)

    engine._emit = scripted_emit  # this server's engine only
    return server


@pytest.fixture(scope="module")
def tool_server(tokenizer):
    server = scripted_server(tokenizer, "hermes", CALL)
    yield server
    server.close()


def test_an_openai_sdk_agent_loop_gets_tool_calls_and_a_final_answer(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    reply = client.chat.completions.create(model=TINY_MODEL_PATH, messages=messages, tools=[ADD], max_tokens=64)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 12, "b": 30}
    assert call.id.startswith("chatcmpl-tool-")

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(12 + 30)},
    ]
    final = client.chat.completions.create(model=TINY_MODEL_PATH, messages=messages, tools=[ADD], max_tokens=64)
    assert final.choices[0].message.content == ANSWER and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "stop"


def test_streamed_tool_calls_arrive_as_deltas_and_none_leaves_the_reply_as_text(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    chunks = [
        c.choices[0]
        for c in client.chat.completions.create(
            model=TINY_MODEL_PATH, messages=messages, tools=[ADD], max_tokens=64, stream=True
        )
    ]
    assert "".join(c.delta.content or "" for c in chunks) == "Let me add.", "the call's text is not content"
    calls = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "add", {"a": 12, "b": 30})
    ]
    assert chunks[-1].finish_reason == "tool_calls"

    plain = client.chat.completions.create(
        model=TINY_MODEL_PATH,
        messages=messages,
        tools=[ADD],
        tool_choice="none",
        max_tokens=64,
        extra_body={"skip_special_tokens": False},
    ).choices[0]
    assert plain.message.content == CALL and not plain.message.tool_calls and plain.finish_reason == "stop"


def test_tool_choices_tandem_serve_cannot_honour_are_clear_400s(tool_server, server):
    cases = [
        (tool_server, {"tools": [ADD], "tool_choice": "required"}, "guided decoding"),
        (tool_server, {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "guided"),
        (
            tool_server,
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "does not match",
        ),
        (tool_server, {"tools": [ADD], "tool_choice": {"type": "function"}}, "Invalid value for `function`"),
        (tool_server, {"tools": [ADD], "tool_choice": {"type": "function", "function": {}}}, "Expected field `name`"),
        (tool_server, {"tools": [], "tool_choice": "auto"}, "must not be an empty array"),
        (tool_server, {"tool_choice": "auto"}, "`tools` must be set"),
        (server, {"tools": [ADD]}, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
        (server, {"tools": [ADD], "tool_choice": "required"}, "requires --tool-call-parser to be set"),
    ]
    for target, fields, message in cases:
        status, body = target.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **fields})
        assert status == 400 and message in body["error"]["message"], (fields, body)
    assert (
        server.post(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tools": [ADD], "tool_choice": "none", "max_tokens": 2},
        )[0]
        == 200
    )


def test_a_model_that_writes_pythonic_calls_is_served_with_its_parser(tokenizer):
    """Llama 3.2's format: the reply is a Python list of calls. Streamed, its content comes whole at the end, where the
    reading decides what of the text is content."""
    server = scripted_server(tokenizer, "pythonic", "[add(a=12, b=30)]")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is 12 + 30?"}]
        choice = client.chat.completions.create(
            model=TINY_MODEL_PATH, messages=messages, tools=[ADD], max_tokens=64
        ).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 12, "b": 30}
        chunks = [
            c.choices[0]
            for c in client.chat.completions.create(
                model=TINY_MODEL_PATH, messages=messages, tools=[ADD], max_tokens=64, stream=True
            )
        ]
        assert not "".join(c.delta.content or "" for c in chunks), "the call's text is not content"
        assert [c.function.name for chunk in chunks for c in chunk.delta.tool_calls or []] == ["add"]
    finally:
        server.close()
