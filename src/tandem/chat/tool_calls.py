"""Tool calls in a model's reply: which calls it makes, which of them are malformed, and the assistant message
that goes back into the conversation. Used by the rollout worker's multi-turn tool loop, which reads replies in the
format the run's `tool_call_parser` names (tool_formats.py, the readings `tandem serve` and vLLM answer with) or, by
default, in one of two ways:

- Hermes / Qwen blocks, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, tried first for every
  tokenizer. Each block is judged on its own: a malformed one (bad JSON, no name, arguments that are not an
  object, no closing tag) is reported with its reason and stays in the content as written, so nothing the model
  wrote disappears and the next turn can tell the model what was wrong.
- Any other family whose tokenizer carries a transformers `response_template` (Mistral's `[TOOL_CALLS]`, Gemma,
  ...): `tokenizer.parse_response`. That parser reads a reply as a whole, so a reply it cannot read, or one with
  a malformed call, is kept whole as content with one malformed call saying why.

`tool_schema` turns a Python function into the JSON schema chat templates take as `tools`.

Only the standard library is imported here; transformers is imported when `tool_schema` runs (its
`get_json_schema` may load torch itself, to describe tensor arguments).
"""

import json
import re
from dataclasses import dataclass, field

from tandem.chat.tool_formats import HERMES_OPEN, ToolCallFormat
from tandem.errors import UsageError

TOOLS_DOCS = "https://huggingface.co/docs/transformers/en/chat_extras#passing-tools"

HERMES_CLOSE = "</tool_call>"

HERMES_BLOCK = re.compile(
    r"<tool_call>(?P<body>(?:(?!<tool_call>).)*?)(?P<close></tool_call>|(?=<tool_call>)|\Z)", re.DOTALL
)
"""One Hermes block: its body ends at `</tool_call>`, or (unclosed) at the next `<tool_call>` or the end of the
text, where a truncated generation stops."""


@dataclass
class ToolCall:
    """One call the model wrote, well-formed or not."""

    name: str
    """The tool's name; "" when the block could not be parsed as far as a name."""
    arguments: dict
    """The call's arguments; {} when the block could not be parsed."""
    error: str | None = None
    """Why the block is malformed (invalid JSON, no "name", "arguments" not an object, ...); None when well-formed."""
    raw: str = ""
    """The block's text as the model wrote it (read by a response_template: the parsed entry as JSON, since that
    parser does not report the text of each call)."""

    def as_message_call(self) -> dict:
        """The call as an assistant message carries it (OpenAI's chat shape, with the arguments as an object)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    """A reply split into what it says and the tool calls it makes."""

    content: str
    """The text outside well-formed tool-call blocks, stripped; malformed blocks stay in it as written."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Every block in order, well-formed or not."""
    reasoning: str | None = None
    """Reasoning a `response_template` separated from the content (its `reasoning_content`); None otherwise.
    Hermes blocks leave `<think>` text in the content, where Qwen templates look for it."""

    def message(self) -> dict:
        """The assistant message to append to the conversation: the content, the reasoning when the parser
        separated it, and the well-formed calls (no "tool_calls" key when there are none)."""
        message: dict = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        calls = [call.as_message_call() for call in self.tool_calls if call.error is None]
        if calls:
            message["tool_calls"] = calls
        return message


def parse_reply(
    text: str, tokenizer=None, *, prefix: str = "", tool_format: ToolCallFormat | None = None
) -> ParsedReply:
    """Read the tool calls in `text`, a decoded reply.

    A trailing end marker is dropped when it is `tokenizer.eos_token`. With a `tool_format` other than hermes the reply
    is read as that format reads it (`read_in_format`). Otherwise Hermes `<tool_call>` blocks are read whatever the
    tokenizer, each on its own (a malformed block is reported, the others run: more than vLLM's all-or-nothing
    reading gives the model to learn from); a reply without one goes through the tokenizer's `response_template` when
    it has one (not with hermes chosen), else it is all content.
    `prefix` is the prompt's text, which that parser needs for families whose generation prompt already opens part of
    the reply (a template ending its prompt with `<think>`, such as Qwen3-Thinking-2507's, makes the reply start
    inside the reasoning); "" when the prompt opens nothing.
    """
    text = strip_eos(text, tokenizer)
    if tool_format is not None and tool_format.name != "hermes":
        return read_in_format(text, tool_format)
    if HERMES_OPEN in text or tool_format is not None:
        return parse_hermes(text)
    if getattr(tokenizer, "response_template", None) is not None:
        return parse_with_response_template(text, tokenizer, prefix)
    return ParsedReply(content=text.strip())


def strip_eos(text: str, tokenizer) -> str:
    """`text` without a trailing `tokenizer.eos_token` (and the whitespace after it); unchanged otherwise."""
    eos = getattr(tokenizer, "eos_token", None)
    stripped = text.rstrip()
    return stripped[: -len(eos)] if eos and stripped.endswith(eos) else text


def read_in_format(text: str, tool_format: ToolCallFormat) -> ParsedReply:
    """`text` read as `tool_format` reads it. That reading is all or nothing, so a reply that opens a call the format
    cannot read is kept whole as content with one malformed call saying so; each call read must have arguments that
    are a JSON object."""
    reading = tool_format.read(text)
    if not reading.calls:
        opened = next((marker for marker in tool_format.markers if marker in text), None)
        if opened is None:
            return ParsedReply(content=text.strip())
        return unparsed(
            text, f"the reply opens a call with {opened} but does not read as {tool_format.name} tool calls"
        )
    entries = [{"name": name, "arguments": arguments} for name, arguments in reading.calls]
    calls = [call_from_object(entry, json.dumps(entry)) for entry in entries]
    return ParsedReply(content=(reading.content or "").strip(), tool_calls=calls)


def parse_hermes(text: str) -> ParsedReply:
    """Every `<tool_call>` block of `text` in order; well-formed blocks leave the content, malformed ones stay."""
    calls, pieces, start = [], [], 0
    for block in HERMES_BLOCK.finditer(text):
        call = hermes_call(block)
        calls.append(call)
        if call.error is None:
            pieces.append(text[start : block.start()])
            start = block.end()
    pieces.append(text[start:])
    return ParsedReply(content="".join(pieces).strip(), tool_calls=calls)


def hermes_call(block: re.Match) -> ToolCall:
    """One Hermes block as a call: its JSON body must be an object with a "name" and optional "arguments"."""
    raw = block.group(0)
    if not block.group("close"):
        return ToolCall("", {}, error=f"{HERMES_OPEN} is not closed by {HERMES_CLOSE}", raw=raw)
    try:
        body = json.loads(block.group("body"))
    except (ValueError, RecursionError) as e:  # bad JSON; a 5000-digit integer; nesting too deep
        return ToolCall("", {}, error=f"invalid JSON: {e}", raw=raw)
    return call_from_object(body, raw)


def call_from_object(body, raw: str) -> ToolCall:
    """A call from its decoded JSON: `{"name": str, "arguments": object or a JSON string holding one}`, with
    Llama 3's "parameters" read as "arguments"; a call with neither has no arguments."""
    if not isinstance(body, dict):
        return ToolCall("", {}, error=f"the call is a JSON {type(body).__name__}, not an object", raw=raw)
    name, arguments = body.get("name"), body.get("arguments", body.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, error='no "name" (a non-empty string)', raw=raw)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as e:
            return ToolCall(name, {}, error=f'"arguments" is a string but not valid JSON: {e}', raw=raw)
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, error=f'"arguments" is a JSON {type(arguments).__name__}, not an object', raw=raw)
    return ToolCall(name, arguments, raw=raw)


def parse_with_response_template(text: str, tokenizer, prefix: str) -> ParsedReply:
    """`text` through `tokenizer.parse_response`. The parser reports parsed calls, not the text of each, so a
    call's `raw` is its parsed entry as JSON; a reply that does not parse, or holds a malformed call, is kept
    whole as content with one malformed call whose `raw` is the reply."""
    try:
        parsed = tokenizer.parse_response(text, prefix=prefix)
    except (ValueError, KeyError) as e:  # the parser's verdict on text that does not fit the template
        reason = e.args[0] if e.args else repr(e)
        return unparsed(text, f"the reply does not parse with the tokenizer's response_template: {reason}")
    calls = [parsed_call(entry) for entry in parsed.get("tool_calls") or []]
    bad = next((i for i, call in enumerate(calls) if call.error is not None), None)
    if bad is not None:
        return unparsed(text, f"tool call {bad + 1} of the reply is malformed: {calls[bad].error}", calls[bad].name)
    reasoning = parsed.get("reasoning_content", parsed.get("thinking"))
    return ParsedReply(content=(parsed.get("content") or "").strip(), tool_calls=calls, reasoning=reasoning)


def parsed_call(entry) -> ToolCall:
    """One entry of a parsed reply's `tool_calls`: `{"type": "function", "function": {...}}` or the function object
    itself. Only function tools run: a call of another type is malformed, never looked up by its name."""
    raw = json.dumps(entry, ensure_ascii=False)
    if isinstance(entry, dict) and entry.get("type", "function") != "function":
        nested = entry.get("function")
        function: dict = nested if isinstance(nested, dict) else entry
        asked = function.get("name")
        name = asked if isinstance(asked, str) else ""  # what the model asked for
        return ToolCall(
            name, {}, error=f'a call of type {entry["type"]!r}: only "function" tools can be called', raw=raw
        )
    return call_from_object(entry.get("function", entry) if isinstance(entry, dict) else entry, raw)


def unparsed(text: str, error: str, name: str = "") -> ParsedReply:
    """A reply kept whole as content, with one malformed call that says why (and names the tool asked for, if any)."""
    return ParsedReply(content=text.strip(), tool_calls=[ToolCall(name, {}, error=error, raw=text)])


def tool_schema(func) -> dict:
    """The JSON schema of a Python tool, as chat templates take it in `tools`: transformers' `get_json_schema`,
    which reads the type hints and a Google-style docstring. Sync and async functions and bound methods (`self`
    left out) work. A function it cannot describe raises a ValueError naming the tool and the fix."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return get_json_schema(func)
    except (TypeHintParsingException, DocstringParsingException, TypeError, ValueError) as e:
        name = getattr(func, "__name__", repr(func))
        raise UsageError(
            f"tool {name!r} cannot be described to the model ({e}): add type hints and a "
            f"Google-style docstring with an Args: section — see {TOOLS_DOCS}"
        ) from e
