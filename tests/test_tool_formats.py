"""Each tool-call format read as vLLM's parser of that name reads it (the `vllm` tier compares the two on the same
replies), how `tandem serve` answers with a reading, and how a rollout reads one."""

import pytest
from transformers import AutoTokenizer

from tandem.chat.tool_calls import parse_reply
from tandem.chat.tool_formats import FORMATS, Reading, served_reply, tool_call_format
from tandem.errors import UsageError
from tandem.tasks import TINY_MODEL_PATH


def read(name: str, text: str) -> Reading:
    return FORMATS[name].read(text)


def test_each_format_reads_its_own_calls_and_the_content_around_them():
    assert read("hermes", 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>') == Reading(
        "Let me add.", [("add", '{"a": 1}')], True
    )
    assert read("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}') == Reading(
        None, [("add", '{"a": 1}')], True
    ), "Llama 3 writes parameters; no content when it calls"
    assert read("mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]') == Reading(
        "Sure.", [("add", '{"a": 1}')], True
    )
    deepseek = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert read("deepseek_v3", "Sure." + deepseek) == Reading("Sure.", [("add", '{"a": 1}')], True)
    assert read("granite", 'Sure. <|tool_call|>[{"name": "add", "arguments": {"a":  1}}]') == Reading(
        "Sure.", [("add", '{"a":  1}')], True
    ), "Granite's arguments pass as written"
    assert read("pythonic", "[add(a=1, b=-2.5), stop(now=true)]") == Reading(
        None, [("add", '{"a": 1, "b": -2.5}'), ("stop", '{"now": true}')], True
    )


def test_a_reply_whose_calls_do_not_all_read_is_plain_content():
    for name, text in [
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{oops'),
        ("llama3_json", '{"name": "f", "parameters": {}} and {"arguments": {}}'),
        ("pythonic", "[f(a=1)] because"),
        ("deepseek_v3", "no calls here"),
    ]:
        assert read(name, text) == Reading(text, [], False), name


def test_the_server_answers_blank_content_as_none_and_an_unread_reply_as_generated():
    assert served_reply(FORMATS["hermes"], '  <tool_call>{"name": "f", "arguments": {}}</tool_call>') == (
        None,
        [("f", "{}")],
    )
    assert served_reply(FORMATS["mistral"], "[TOOL_CALLS] not json") == ("[TOOL_CALLS] not json", []), (
        "without calls the reply is the text as generated, not the reading's content"
    )


def test_a_rollout_reads_its_format_and_names_a_call_it_could_not_read():
    reply = parse_reply('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', tool_format=FORMATS["mistral"])
    assert reply.message() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}],
    }
    broken = parse_reply('<|python_tag|>{"name": "add", "parameters": {"a": 1}', tool_format=FORMATS["llama3_json"])
    (call,) = broken.tool_calls
    assert call.error == "the reply opens a call with <|python_tag|> but does not read as llama3_json tool calls"
    assert broken.content.startswith("<|python_tag|>"), "the reply stays as written, so the next turn can show it"
    not_an_object = parse_reply('[TOOL_CALLS][{"name": "add", "arguments": "[1, 2]"}]', tool_format=FORMATS["mistral"])
    assert "not an object" in not_an_object.tool_calls[0].error


def test_a_format_is_refused_at_start_naming_what_tandem_has_or_the_token_the_tokenizer_lacks():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    with pytest.raises(
        UsageError, match="'jamba' is not one tandem has: hermes, llama3_json, mistral, deepseek_v3, granite, pythonic"
    ):
        tool_call_format("jamba", tokenizer)
    with pytest.raises(
        UsageError, match=r"reads calls opened by <\|python_tag\|>, which this tokenizer has no token for"
    ):
        tool_call_format("llama3_json", tokenizer)
    tokenizer.add_tokens(["[TOOL_CALLS]", "[ARGS]"], special_tokens=True)
    with pytest.raises(NotImplementedError, match=r"\[ARGS\] .* vllm serve --tool-call-parser mistral"):
        tool_call_format("mistral", tokenizer)
    assert tool_call_format("pythonic", tokenizer).name == "pythonic"
