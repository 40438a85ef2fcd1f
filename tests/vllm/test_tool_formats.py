"""tandem's tool-call formats read the same replies as vLLM's own parsers of the same names: for each format, well-formed
replies (one call, several, content around them) and the malformed ones a model in training writes (bad JSON, no name,
an unclosed block, prose where a call should be). vLLM's parsers run in its own environment, each given a test
tokenizer made from the tiny one with that format's special tokens added (vLLM refuses a parser whose tokens the
tokenizer lacks)."""

import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tandem.chat import tool_formats
from tandem.tasks import TINY_MODEL_PATH
from tests.vllm.conftest import ENV_DIR

DEEPSEEK_CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"
CALLS_BEGIN, CALLS_END = tool_formats.DEEPSEEK_CALLS_BEGIN, tool_formats.DEEPSEEK_CALLS_END

TOKENS = {
    "hermes": [],
    "llama3_json": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]"],
    "deepseek_v3": [CALLS_BEGIN, CALLS_END, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"],
    "granite": ["<|tool_call|>"],
    "pythonic": [],
}
"""The special tokens each format's test tokenizer adds to the tiny one."""

REPLIES = {
    "hermes": [
        'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "neg", "arguments": {"x": "é"}}',
        '  <tool_call>{"name": "f", "arguments": []}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{oops</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
        "The answer is 42.",
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "add", "parameters": {"a": 12, "b": 30}}',
        '{"name": "add", "arguments": {"a": 1}}; {"name": "neg", "parameters": {"x": "é"}}',
        'I will call it: {"name": "f", "parameters": {"nested": {"k": [1, 2]}}} now',
        '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"y": null}}]',
        '{"name": "f", "arguments": "{\\"a\\": 1}"}',
        '{"name": "f", "parameters": {}}{"name": "g", "parameters": {}}',
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}',
        '{"parameters": {"a": 1}}',
        '{"name": "f"}',
        "plain { not json",
        "The answer is 42.",
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 12, "b": 30}}]',
        'Let me see. [TOOL_CALLS] [{"name": "f", "arguments": {"x": "é"}}, {"name": "g", "arguments": "{\\"y\\": 1}"}] trailing',
        '[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}',
        '[TOOL_CALLS][{"name": "f"}, {"arguments": {"a": 1}}, {"other": 1}, 7]',
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {oops',
        '[TOOL_CALLS] [{"oops": 1}]',
        "[TOOL_CALLS]not json at all",
        '[TOOL_CALLS][TOOL_CALLS][{"name": "f", "arguments": {}}][TOOL_CALLS]after',
        "The answer is 42.",
    ],
    "deepseek_v3": [
        f"{CALLS_BEGIN}{DEEPSEEK_CALL.format(name='add', arguments=json.dumps({'a': 12, 'b': 30}))}{CALLS_END}",
        f"Let me see.{CALLS_BEGIN}{DEEPSEEK_CALL.format(name='f', arguments='{}')}\n"
        f"{DEEPSEEK_CALL.format(name='g', arguments=json.dumps({'y': 'é'}, ensure_ascii=False))}{CALLS_END}",
        f"{CALLS_BEGIN}{DEEPSEEK_CALL.format(name='f', arguments='not json')}{CALLS_END}",
        f"{CALLS_BEGIN}{DEEPSEEK_CALL.format(name='f', arguments='{{')}".replace("function", "code") + CALLS_END,
        f"{CALLS_BEGIN}{DEEPSEEK_CALL.format(name='f', arguments=chr(10).join(['{', '}']))}{CALLS_END}",
        f"{CALLS_BEGIN}garbage",
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>",
        "The answer is 42.",
    ],
    "granite": [
        '<|tool_call|>[{"name": "add", "arguments": {"a": 12, "b": 30}}]',
        'Let me see. <tool_call> [{"name": "f", "arguments": {"x":  "é"}}, {"name": "g", "arguments": {}}] and more',
        '<|tool_call|>[{"name": "f"}, {"arguments": {"a": 1}}]',
        '<|tool_call|>[{"arguments": {"a": 1}}]',
        '<tool_call>{"name": "f", "arguments": {}}',
        "<tool_call>not json",
        'Intro <|tool_call|>[{"arguments": {}}] tail',
        'a<|tool_call|>[{"name": "f", "arguments": {"a": 1}}]<|tool_call|>[{"name": "g", "arguments": {}}]',
        '<|tool_call|>[{"name": "f", "arguments": "{\\"a\\": 1}"}, {"name": "g", "parameters": {"a": 1}}]',
        "<|tool_call|>[]",
        '<|tool_call|>[{"name": " f ", "arguments": [1]}, {"name": "", "arguments": {}}, {"name": "g", "arguments": null}]',
        '<|tool_call|>[ {"name": "f", "arguments": {"a":1}} ,\n {"name": "f", "arguments": {"a" :  1}} ] tail',
        "The answer is 42.",
    ],
    "pythonic": [
        "[add(a=12, b=30)]",
        '[f(x="é", flag=true, none=None, items=(1, 2), nested={"k": [-1, +2.5]}), g()]',
        "[f(a=1)]\nfoo",
        "[f(a=1)] more text",
        " [f(a=1)]",
        "[f(1)]",
        "[f(a=b)]",
        "[f(a=1), 3]",
        "[" + "f(a=1, b=2), " * 20 + "f(a=",
        "[f(a=" + "-" * 5000 + "1)]",
        "The answer is 42.",
    ],
}


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = ENV_DIR / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no vLLM environment at {ENV_DIR}: build it with scripts/vllm_env.sh")
    return str(python)


@pytest.mark.parametrize("name", list(tool_formats.FORMATS))
def test_each_format_reads_replies_as_vllms_parser_of_that_name(name, vllm_python, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    tokenizer.add_tokens(TOKENS[name], special_tokens=True)
    tokenizer.save_pretrained(tmp_path)
    fmt = tool_formats.tool_call_format(name, tokenizer)  # tandem checks the tokenizer as vLLM does
    done = subprocess.run(
        [vllm_python, str(Path(__file__).with_name("vllm_tool_parsers.py")), str(tmp_path), name],
        input=json.dumps(REPLIES[name]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for reply, vllm in zip(REPLIES[name], theirs):
        ours = fmt.read(reply)
        assert {"called": ours.called, "content": ours.content, "calls": [list(call) for call in ours.calls]} == vllm, (
            f"{name} reads {reply!r} otherwise than vLLM"
        )
