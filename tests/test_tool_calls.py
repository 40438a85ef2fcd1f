"""Reading tool calls out of a model's reply (tandem.chat.tool_calls): Hermes / Qwen `<tool_call>` blocks, a tokenizer's
own `response_template`, and tool schemas from Python functions."""

import copy

import pytest

from tandem.chat.prompts import PROBE_TOOL
from tandem.chat.tool_calls import parse_reply, tool_schema

CALL_1_PLUS_2 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
CALL_3_TIMES_4 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>'


def calls_of(reply) -> list[tuple]:
    """(name, arguments, error) of each call, in order."""
    return [(call.name, call.arguments, call.error) for call in reply.tool_calls]


# --- Hermes / Qwen blocks ----------------------------------------------------------------------------------------


def test_one_clean_call_becomes_an_assistant_message_with_tool_calls():
    reply = parse_reply(CALL_1_PLUS_2)
    assert calls_of(reply) == [("calculator", {"expression": "1 + 2"}, None)]
    assert reply.tool_calls[0].raw == CALL_1_PLUS_2
    assert reply.message() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 2"}}}],
    }


def test_parallel_calls_keep_their_order():
    reply = parse_reply(f"{CALL_1_PLUS_2}\n{CALL_3_TIMES_4}")
    assert [call.arguments["expression"] for call in reply.tool_calls] == ["1 + 2", "3 * 4"]
    assert reply.content == ""


def test_text_around_the_calls_is_the_content():
    reply = parse_reply(f"Let me compute both.\n{CALL_1_PLUS_2}\n{CALL_3_TIMES_4}\nThen I will add them.")
    assert len(reply.tool_calls) == 2
    assert reply.content.startswith("Let me compute both.") and reply.content.endswith("Then I will add them.")
    assert "<tool_call>" not in reply.content, "well-formed calls leave the content"


def test_arguments_written_as_a_json_string_are_accepted():
    reply = parse_reply('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1 + 2\\"}"}</tool_call>')
    assert calls_of(reply) == [("calculator", {"expression": "1 + 2"}, None)]


def test_a_call_without_arguments_has_empty_arguments():
    assert calls_of(parse_reply('<tool_call>{"name": "now"}</tool_call>')) == [("now", {}, None)]


def test_llama_style_parameters_are_read_as_arguments():
    reply = parse_reply('<tool_call>{"name": "calculator", "parameters": {"expression": "1 + 2"}}</tool_call>')
    assert calls_of(reply) == [("calculator", {"expression": "1 + 2"}, None)]


def test_invalid_json_is_a_malformed_call_that_stays_in_the_content():
    text = 'Checking.\n<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    reply = parse_reply(text)
    [call] = reply.tool_calls
    assert (call.name, call.arguments) == ("", {}) and call.error.startswith("invalid JSON"), call.error
    assert call.raw == text.removeprefix("Checking.\n")
    assert reply.content == text, "nothing the model wrote disappears"
    assert "tool_calls" not in reply.message(), "a malformed call is not sent to the conversation as a call"


@pytest.mark.parametrize(
    "body, complaint",
    [
        ('{"arguments": {"expression": "1 + 2"}}', '"name"'),
        ('{"name": "", "arguments": {}}', '"name"'),
        ('{"name": "calculator", "arguments": ["1 + 2"]}', '"arguments" is a JSON list'),
        ('{"name": "calculator", "arguments": "1 + 2"}', '"arguments" is a string but not valid JSON'),
        ('["calculator", "1 + 2"]', "not an object"),
    ],
)
def test_a_call_of_the_wrong_shape_is_malformed_and_says_why(body, complaint):
    text = f"<tool_call>{body}</tool_call>"
    reply = parse_reply(text)
    [call] = reply.tool_calls
    assert call.error is not None and complaint in call.error, f"{body}: {call.error}"
    assert reply.content == text


def test_an_unclosed_block_at_the_end_is_a_malformed_call():
    truncated = '<tool_call>\n{"name": "calculator", "arguments": {"expr'
    reply = parse_reply(f"{CALL_1_PLUS_2}\n{truncated}")
    assert [call.error is None for call in reply.tool_calls] == [True, False]
    assert "not closed" in reply.tool_calls[1].error
    assert reply.content == truncated
    assert len(reply.message()["tool_calls"]) == 1, "the well-formed call before it still counts"


def test_a_block_left_open_before_the_next_one_does_not_swallow_it():
    reply = parse_reply(f'<tool_call>{{"name": "calculator"\n{CALL_3_TIMES_4}')
    assert [call.error is None for call in reply.tool_calls] == [False, True]
    assert reply.tool_calls[1].arguments == {"expression": "3 * 4"}


def test_a_reply_without_calls_is_all_content():
    reply = parse_reply("  The answer is 3.\n")
    assert reply.content == "The answer is 3." and reply.tool_calls == []
    assert reply.message() == {"role": "assistant", "content": "The answer is 3."}


def test_the_tokenizers_eos_token_is_dropped_and_nothing_else(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert parse_reply(f"{CALL_1_PLUS_2}<|im_end|>\n", tokenizer).content == ""
    assert parse_reply("The answer is 3.<|im_end|>", tokenizer).content == "The answer is 3."
    assert parse_reply("The answer is 3.<|endoftext|>", tokenizer).content == "The answer is 3.<|endoftext|>"
    assert parse_reply("The answer is 3.<|im_end|>").content == "The answer is 3.<|im_end|>", "no tokenizer, no EOS"


def test_a_parsed_reply_renders_back_into_the_text_the_model_wrote(tokenizer):
    """The tiny template writes calls as the model learned them; parsing what it writes and rendering the parsed
    message again gives back the same text, so a tool loop's history shows the model its own words."""
    question = [{"role": "user", "content": "What are 1 + 2 and 3 * 4?"}]
    sent = {
        "role": "assistant",
        "content": "Both at once.",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 2"}}},
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "3 * 4", "exact": True}},
            },
        ],
    }
    prompt = tokenizer.apply_chat_template(question, tools=[PROBE_TOOL], add_generation_prompt=True, tokenize=False)
    rendered = tokenizer.apply_chat_template(question + [sent], tools=[PROBE_TOOL], tokenize=False)
    written = rendered.removeprefix(prompt)
    assert written.startswith("Both at once.\n<tool_call>"), written

    reply = parse_reply(written, tokenizer)
    assert reply.message() == sent
    again = tokenizer.apply_chat_template(question + [reply.message()], tools=[PROBE_TOOL], tokenize=False)
    assert again == rendered


# --- A tokenizer's response_template (other families) -----------------------------------------------------------

MISTRAL_STYLE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "[/INST]",
    "fields": {
        "tool_calls": {
            "open": "[TOOL_CALLS]",
            "content": "json",
            "transform_each": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
        },
        "content": {"content": "text"},
    },
}
"""Mistral's format, `[TOOL_CALLS]` and a JSON list of calls, as a transformers response_template."""


@pytest.fixture
def mistral_tokenizer(tokenizer):
    """The tiny tokenizer with a Mistral-style response_template (a copy: the session's tokenizer stays as it is)."""
    mistral = copy.deepcopy(tokenizer)
    mistral.response_template = MISTRAL_STYLE
    return mistral


def test_a_response_template_reads_other_families(mistral_tokenizer):
    text = (
        'Both at once.[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1 + 2"}}, '
        '{"name": "calculator", "arguments": {"expression": "3 * 4"}}]<|im_end|>'
    )
    reply = parse_reply(text, mistral_tokenizer)
    assert calls_of(reply) == [
        ("calculator", {"expression": "1 + 2"}, None),
        ("calculator", {"expression": "3 * 4"}, None),
    ]
    assert reply.content == "Both at once."
    no_calls = parse_reply("The answer is 3.", mistral_tokenizer)
    assert no_calls.message() == {"role": "assistant", "content": "The answer is 3."}


@pytest.mark.parametrize(
    "calls, complaint",
    [
        (
            '[{"name": "calculator", "arguments": {"expression": "1 + 2"}',
            "does not parse with the tokenizer's response_template",
        ),
        (
            '[{"name": "calculator", "arguments": {}}, {"name": "calculator", "arguments": [1]}]',
            "tool call 2 of the reply is malformed",
        ),
    ],
)
def test_a_reply_the_response_template_cannot_read_is_kept_whole(mistral_tokenizer, calls, complaint):
    text = f"Trying.[TOOL_CALLS]{calls}"
    reply = parse_reply(text, mistral_tokenizer)
    [call] = reply.tool_calls
    assert complaint in call.error, call.error
    assert reply.content == text and call.raw == text
    assert "tool_calls" not in reply.message()


def test_hermes_blocks_are_read_even_when_the_tokenizer_has_a_response_template(mistral_tokenizer):
    assert calls_of(parse_reply(CALL_1_PLUS_2, mistral_tokenizer)) == [("calculator", {"expression": "1 + 2"}, None)]


# --- Tool schemas ------------------------------------------------------------------------------------------------


def calculator(expression: str, exact: bool = False) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "1 + 2".
        exact: Whether to answer with a fraction instead of a decimal.
    """
    return expression


async def search(query: str) -> list:
    """Search the web.

    Args:
        query: What to look for.
    """
    return [query]


class Notebook:
    def write(self, line: str) -> None:
        """Write a line in the notebook.

        Args:
            line: The line to write.
        """


def test_tool_schema_describes_sync_and_async_functions_and_bound_methods():
    schema = tool_schema(calculator)["function"]
    assert schema["name"] == "calculator" and schema["description"] == "Evaluate an arithmetic expression."
    assert schema["parameters"]["properties"]["exact"]["type"] == "boolean"
    assert schema["parameters"]["required"] == ["expression"]
    assert tool_schema(search)["function"]["parameters"]["required"] == ["query"]
    method = tool_schema(Notebook().write)["function"]
    assert method["name"] == "write" and list(method["parameters"]["properties"]) == ["line"], "self is left out"


def no_hints(expression):
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression.
    """


def no_docstring(expression: str):
    pass


def no_args_section(expression: str):
    """Evaluate an arithmetic expression."""


@pytest.mark.parametrize("func", [no_hints, no_docstring, no_args_section])
def test_tool_schema_names_the_tool_and_the_fix_when_it_cannot_describe_it(func):
    with pytest.raises(ValueError) as failure:
        tool_schema(func)
    message = str(failure.value)
    assert repr(func.__name__) in message, message
    assert "type hints" in message and "Args:" in message and "chat_extras#passing-tools" in message, message


def test_a_tool_call_whose_type_is_not_function_is_answered_with_an_error_not_run(mistral_tokenizer):
    as_written = copy.deepcopy(MISTRAL_STYLE)  # each call's JSON taken as written, its "type" included
    as_written["fields"]["tool_calls"] = {"open": "[TOOL_CALLS]", "content": "json"}
    mistral_tokenizer.response_template = as_written
    text = 'Run it.[TOOL_CALLS][{"type": "code_interpreter", "function": {"name": "calculator", "arguments": {}}}]'
    [call] = parse_reply(text, mistral_tokenizer).tool_calls
    assert 'only "function" tools can be called' in call.error and "'code_interpreter'" in call.error
    assert call.name == "calculator", "the error names the tool the model asked for"
    function = 'Run it.[TOOL_CALLS][{"type": "function", "function": {"name": "calculator", "arguments": {"x": 1}}}]'
    assert calls_of(parse_reply(function, mistral_tokenizer)) == [("calculator", {"x": 1}, None)]
