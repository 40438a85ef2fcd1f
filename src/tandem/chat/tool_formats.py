"""Tool-call formats: how each model family writes a call in its reply, read as vLLM's tool-call parser of the same name
reads it (`vllm serve --tool-call-parser NAME`), so a client sees the same `tool_calls` from `tandem serve` and a
rollout reads the same calls a served model would make.

| name | written by | a call looks like |
|---|---|---|
| hermes | Qwen 2.5 / 3, Hermes | `<tool_call>{"name": "f", "arguments": {...}}</tool_call>` |
| llama3_json | Llama 3.1 - 3.3 | `<|python_tag|>{"name": "f", "parameters": {...}}` (any JSON object with a name) |
| mistral | Mistral, Mixtral (tokenizers before v11) | `[TOOL_CALLS][{"name": "f", "arguments": {...}}]` |
| deepseek_v3 | DeepSeek-V3, R1 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f` + a fenced JSON line |
| granite | Granite 3.0 / 3.1 | `<|tool_call|>[{"name": "f", "arguments": {...}}]` |
| pythonic | Llama 3.2 / 4, ToolACE | `[f(a=1), g(b="x")]` |

Each reader is all or nothing, as vLLM's: a reply whose calls do not all read is plain content. One difference:
vLLM's mistral (v11) and granite readers convert a string argument to the type the request's tool schema gives it
(`"n": "2"` to `2` for an integer); tandem passes arguments as written.

Only the standard library and `regex` (a transformers dependency, for the time-bounded match vLLM uses) are imported
here.
"""

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import regex

from tandem.errors import UsageError

UNREADABLE = (ValueError, KeyError, TypeError, RecursionError, MemoryError)
"""What reading a malformed or pathological call raises (bad JSON; a 5000-digit integer; deep nesting; a value JSON
cannot hold): the reply is then plain text, as vLLM's parsers answer."""


@dataclass
class Reading:
    """What a parser makes of a reply: the text left as content (None: none) and each call's name and arguments (a
    JSON text, as the OpenAI API carries them)."""

    content: str | None
    calls: list[tuple[str, str]]
    called: bool
    """vLLM's `tools_called`: whether the reply reads as calling tools, so that its content is the reading's (the chat
    endpoint's finish_reason is "tool_calls" only with calls); True without calls only where deepseek_v3 finds its
    opening token but no call it can read."""


def plain(text: str) -> Reading:
    return Reading(text, [], False)


def called(content: str | None, calls: list[tuple[str, str]]) -> Reading:
    return Reading(content, calls, True)


def as_json(value) -> str:
    """Arguments as vLLM re-encodes them: non-ASCII kept, default separators."""
    return json.dumps(value, ensure_ascii=False)


# ---- hermes ---------------------------------------------------------------------------------------------
HERMES_OPEN = "<tool_call>"


def read_hermes(text: str) -> Reading:
    """Every `<tool_call>` block, closed by `</tool_call>` or running to the end, must hold a JSON object with a string
    "name" and an "arguments" (any JSON); the content is the text before the first block."""
    if HERMES_OPEN not in text:
        return plain(text)
    calls = []
    for closed, unclosed in re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, flags=re.DOTALL):
        try:
            body = json.loads(closed or unclosed)
            name, arguments = body["name"], body["arguments"]
        except UNREADABLE:
            return plain(text)
        if not isinstance(name, str):
            return plain(text)
        calls.append((name, as_json(arguments)))
    return called(text[: text.find(HERMES_OPEN)] or None, calls)


# ---- llama3_json ----------------------------------------------------------------------------------------
PYTHON_TAG = "<|python_tag|>"


def read_llama3_json(text: str) -> Reading:
    """Every JSON object in the reply is a call (its `<|python_tag|>` and any text around the objects are ignored): a
    string "name" and "arguments" or, as Llama 3 writes them, "parameters". No content when it calls."""
    decoder, calls, end = json.JSONDecoder(), [], -1
    for start in (m.start() for m in re.finditer(r"\{", text)):
        if start <= end:  # inside the object just read (or right after it, as vLLM skips it too)
            continue
        try:
            body, length = decoder.raw_decode(text[start:])
            name = body["name"]
            arguments = body["arguments"] if "arguments" in body else body["parameters"]
        except UNREADABLE:
            return plain(text)
        if not isinstance(name, str):
            return plain(text)
        end = start + length
        calls.append((name, as_json(arguments)))
    return called(None, calls) if calls else plain(text)


# ---- mistral --------------------------------------------------------------------------------------------
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"


def read_mistral(text: str) -> Reading:
    """`[TOOL_CALLS]` then a JSON list of calls (or one call); the first non-blank piece after a marker is read, and
    trailing text after its JSON is ignored. A call needs a "name" or "arguments" (a missing name reads as "");
    string arguments pass as written. Content: the text before the marker, None when blank."""
    if MISTRAL_CALLS not in text:
        return plain(text)
    content, *pieces = text.split(MISTRAL_CALLS)
    body = next((piece.strip() for piece in pieces if piece.strip()), "")
    try:
        parsed = json.JSONDecoder().raw_decode(body)[0]
    except UNREADABLE:
        bracketed = re.findall(r"\[{.*}\]", body, flags=re.DOTALL)
        try:
            parsed = json.loads(bracketed[0]) if bracketed else None
        except UNREADABLE:
            parsed = None
    entries = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
    calls = []
    for entry in entries:
        if not isinstance(entry, dict) or ("name" not in entry and "arguments" not in entry):
            continue
        name, arguments = entry.get("name"), entry.get("arguments")
        arguments = "{}" if arguments is None else arguments if isinstance(arguments, str) else as_json(arguments)
        calls.append((name if isinstance(name, str) else "", arguments))
    if not calls:
        return Reading(body, [], False)
    return called(content if content.strip() else None, calls)


# ---- deepseek_v3 ----------------------------------------------------------------------------------------
DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>.*)<｜tool▁sep｜>(?P<name>.*)\n```json\n(?P<arguments>.*)\n```"
    r"<｜tool▁call▁end｜>"
)
"""One call: its type ("function"), then its name, then its arguments on one line inside a ```json fence."""


def read_deepseek_v3(text: str) -> Reading:
    """Every call after `<｜tool▁calls▁begin｜>`, its name and arguments as written (not checked as JSON); a call of
    another type than "function" makes the reply plain. Content: the text before the opening token."""
    if DEEPSEEK_CALLS_BEGIN not in text:
        return plain(text)
    matches = DEEPSEEK_CALL.findall(text)
    if any(kind != "function" for kind, _, _ in matches):
        return plain(text)
    return called(
        text[: text.find(DEEPSEEK_CALLS_BEGIN)] or None, [(name, arguments) for _, name, arguments in matches]
    )


# ---- granite --------------------------------------------------------------------------------------------
GRANITE_MARKERS = ("<|tool_call|>", "<tool_call>")
"""Granite 3.0 writes a special token, 3.1 the same words as plain text."""


def read_granite(text: str) -> Reading:
    """Each marker is followed by a JSON list of calls; each element with a non-blank string "name" (stripped) is a
    call, its "arguments" passed as written ("{}" without one; a string as the text it holds). With calls the content is
    the text before the first marker, stripped; without, the text less its markers (and the space after each) and its
    lists."""
    first, marker = next_marker(text)
    if marker is None:
        return plain(text)
    pieces, calls, rest = [text[:first]], [], text[first + len(marker) :]
    while True:
        rest = rest.lstrip()
        elements = list_elements(rest)
        if elements is not None:
            entries, rest = elements
            calls += [
                (entry["name"].strip(), written_arguments(entry, written))
                for entry, written in entries
                if isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry["name"].strip()
            ]
        at, marker = next_marker(rest)
        if marker is None:
            break
        pieces.append(rest[:at])
        rest = rest[at + len(marker) :]
    if calls:
        return called(text[:first].strip() or None, calls)
    return Reading("".join(pieces + [rest]) or None, [], False)


def next_marker(text: str) -> tuple[int, str | None]:
    """Where the first Granite marker in `text` starts, and which it is (None: there is none)."""
    found = [(text.find(marker), marker) for marker in GRANITE_MARKERS if marker in text]
    return min(found) if found else (-1, None)


def list_elements(text: str) -> tuple[list[tuple[object, str]], str] | None:
    """The elements of the JSON list `text` starts with, each with its text as written, and the text after the list;
    None when it does not start with one."""
    decoder = json.JSONDecoder()
    try:
        whole, end = decoder.raw_decode(text)
    except UNREADABLE:
        return None
    if not isinstance(whole, list):
        return None
    elements, at = [], 1
    for _ in whole:
        at = skip_space(text, at)
        value, stop = decoder.raw_decode(text, at)
        elements.append((value, text[at:stop]))
        at = skip_space(text, stop) + 1  # past the comma (or the closing bracket)
    return elements, text[end:]


def skip_space(text: str, at: int) -> int:
    while text[at] in " \t\n\r":
        at += 1
    return at


def written_arguments(entry: dict, written: str) -> str:
    """The "arguments" of a call as the model wrote them in its element's text (`written`, spacing kept): a string as
    the text it holds; "{}" when there are none."""
    if "arguments" not in entry:
        return "{}"
    if isinstance(entry["arguments"], str):
        return entry["arguments"]
    decoder = json.JSONDecoder()
    for m in re.finditer(r'"arguments"\s*:\s*', written):
        try:
            value, end = decoder.raw_decode(written, m.end())
        except UNREADABLE:
            continue
        if value == entry["arguments"]:
            return written[m.end() : end]
    return as_json(entry["arguments"])


# ---- pythonic -------------------------------------------------------------------------------------------
PYTHONIC_LIST = regex.compile(
    r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*"
    r"([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]",
    regex.DOTALL,
)
"""The shape vLLM requires from the reply's first character: a Python list of calls with keyword arguments."""
PYTHONIC_TIMEOUT_S = 1.0
"""How long that match may take, as vLLM bounds it (VLLM_TOOL_PARSE_REGEX_TIMEOUT_SECONDS): it can backtrack
exponentially on a list cut off mid-call (with Python's re, 20 calls and a cut one took 3.3 s, each 4 more 16x), and a
reply past the bound is plain text."""
JSON_NAMES = {"null": None, "true": True, "false": False}


def read_pythonic(text: str) -> Reading:
    """The reply is a Python list of calls, `[f(a=1), g(b="x")]`, whose keyword arguments are literals (strings,
    numbers, None/True/False or null/true/false, lists, tuples, sets, dicts); anything else makes it plain. No content
    when it calls."""
    try:
        if PYTHONIC_LIST.match(text, timeout=PYTHONIC_TIMEOUT_S) is None:
            return plain(text)
    except TimeoutError:
        return plain(text)
    try:
        node = getattr(ast.parse(text).body[0], "value", None)
        if not isinstance(node, ast.List):
            return plain(text)
        calls = [call for call in node.elts if isinstance(call, ast.Call)]
        if len(calls) != len(node.elts):
            return plain(text)
        return called(
            None,
            [(dotted_name(call.func), as_json({k.arg: literal(k.value) for k in call.keywords})) for call in calls],
        )
    except (SyntaxError, IndexError, *UNREADABLE):
        return plain(text)


def dotted_name(node: ast.expr) -> str:
    """`f` or `a.b.f`; anything else is not a tool's name."""
    if isinstance(node, ast.Attribute):
        return f"{dotted_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    raise ValueError("a call of something that is not a name")


def literal(node: ast.expr):
    """A keyword argument's value as JSON holds it (tuples and sets as lists); ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Dict):
        keys = [key for key in node.keys if isinstance(key, ast.Constant)]
        if len(keys) == len(node.keys):
            return {key.value: literal(value) for key, value in zip(keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [literal(element) for element in node.elts]
    if isinstance(node, ast.JoinedStr):
        parts = [part for part in node.values if isinstance(part, ast.Constant)]
        if len(parts) == len(node.values):
            return "".join(str(part.value) for part in parts)
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a literal: {ast.dump(node)}")


# ---- the formats by name --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    read: Callable[[str], Reading]
    markers: tuple[str, ...]
    """Text that opens a call: a reply holding one that reads as no call made a malformed one."""
    vocab: tuple[str, ...] = ()
    """Tokens the tokenizer must have for the format (vLLM refuses the parser at start without them)."""
    keeps_special_tokens: bool = False
    """Whether the reply is decoded with its special tokens (vLLM's parser sets skip_special_tokens=False), where the
    format's markers may be special tokens."""
    streams_until: str | None = None
    """A streamed reply's content is sent as it comes up to this marker; None: whole at the end (the reading decides
    what of the text is content)."""


FORMATS = {
    f.name: f
    for f in (
        ToolCallFormat("hermes", read_hermes, (HERMES_OPEN,), keeps_special_tokens=True, streams_until=HERMES_OPEN),
        ToolCallFormat("llama3_json", read_llama3_json, (PYTHON_TAG,), vocab=(PYTHON_TAG,)),
        ToolCallFormat("mistral", read_mistral, (MISTRAL_CALLS,), vocab=(MISTRAL_CALLS,), keeps_special_tokens=True),
        ToolCallFormat(
            "deepseek_v3", read_deepseek_v3, (DEEPSEEK_CALLS_BEGIN,), vocab=(DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END)
        ),
        ToolCallFormat("granite", read_granite, GRANITE_MARKERS, keeps_special_tokens=True),
        ToolCallFormat("pythonic", read_pythonic, ()),
    )
}


def served_reply(fmt: ToolCallFormat, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A chat reply's content and calls as vLLM's chat endpoint answers them: with calls, the reading's content (None
    when blank); without, the text as generated."""
    reading = fmt.read(text)
    if not reading.called:
        return text, []
    return (reading.content if reading.content and reading.content.strip() else None), reading.calls


def tool_call_format(name: str, tokenizer=None) -> ToolCallFormat:
    """The format called `name`, checked against `tokenizer` (when given) as vLLM checks it at start; a UsageError in
    one line naming the supported formats or the missing token."""
    if name not in FORMATS:
        raise UsageError(
            f"tool-call parser {name!r} is not one tandem has: {', '.join(FORMATS)} (vLLM's names for them)"
        )
    fmt = FORMATS[name]
    vocab = tokenizer.get_vocab() if tokenizer is not None else None
    if vocab is not None:
        missing = [token for token in fmt.vocab if token not in vocab]
        if missing:
            raise UsageError(
                f"tool-call parser {name!r} reads calls opened by {' and '.join(missing)}, which this "
                "tokenizer has no token for: pick the parser of the model's own format"
            )
        if name == "mistral" and MISTRAL_ARGS in vocab:
            raise NotImplementedError(
                "tool-call parser 'mistral' with a tokenizer that has [ARGS] (Mistral's v11 "
                "format, `[TOOL_CALLS]name[ARGS]{...}`) is not implemented in tandem: serve the "
                "model with vllm serve --tool-call-parser mistral"
            )
    return fmt
