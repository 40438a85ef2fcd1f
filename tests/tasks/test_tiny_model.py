"""The shipped tiny model, the arithmetic task it was pretrained on, and the tools it learned to call."""

import asyncio
import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import get_json_schema

from tandem.chat.tool_calls import parse_reply
from tandem.generation.client import GenerationClient
from tandem.tasks import TINY_MODEL_PATH, arithmetic
from tandem.tasks.tools import calculator
from tests.conftest import chat_prompt
from tests.trainer.test_agent_training import IncrementEnv  # TRL's example environment


def test_loads_with_the_ordinary_from_pretrained():
    config = AutoConfig.from_pretrained(TINY_MODEL_PATH)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)
    assert config.model_type == "qwen2"
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 5e6


def test_chat_template_renders_every_role_and_a_tools_list(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "2 + 2"}}}],
        },
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    tools = [
        {"type": "function", "function": {"name": "calc", "description": "evaluate", "parameters": {"type": "object"}}}
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(tools[0]) in text
    assert '<tool_call>\n{"name": "calc", "arguments": {"expression": "2 + 2"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n4<|im_end|>\n")


def test_a_longer_conversation_extends_the_shorter_ones_tokens(tokenizer):
    first = [{"role": "user", "content": "What is 5 + 6?"}]
    second = first + [{"role": "assistant", "content": "11"}, {"role": "user", "content": "And 11 + 1?"}]
    short = tokenizer.apply_chat_template(first, tokenize=True, return_dict=False)
    long = tokenizer.apply_chat_template(second, tokenize=True, return_dict=False)
    assert long[: len(short)] == short


def test_digits_are_single_tokens(tokenizer):
    assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]


def test_the_splits_are_disjoint_and_answers_are_checked_by_value():
    train_questions = {arithmetic.question(p) for p in arithmetic.all_problems() if arithmetic.split_of(p) == "train"}
    assert not any(
        r["prompt"][0]["content"] in train_questions for r in arithmetic.make_rows(200, split="test", seed=1)
    )
    assert arithmetic.is_correct(" 85 is the answer", "85")
    assert arithmetic.is_correct("-3", "-3")
    assert not arithmetic.is_correct("8", "85")
    assert not arithmetic.is_correct("no idea", "85")


def test_held_out_pass_rate_leaves_room_to_learn(server, tokenizer):
    """Sampled at temperature 1.0, the tiny model solves between 20% and 80% of held-out problems."""
    rows = arithmetic.make_rows(200, split="test", seed=2)

    async def ask():
        async with GenerationClient(server.url) as client:
            return await asyncio.gather(
                *[
                    client.complete(
                        chat_prompt(tokenizer, r["prompt"][0]["content"]), max_tokens=8, seed=i, temperature=1.0
                    )
                    for i, r in enumerate(rows)
                ]
            )

    results = asyncio.run(ask())
    correct = sum(
        arithmetic.is_correct(tokenizer.decode(c.token_ids, skip_special_tokens=True), r["solution"])
        for r, [c] in zip(rows, results)
    )
    assert 0.2 <= correct / len(rows) <= 0.8, f"pass rate {correct / len(rows):.2f}"


def sample(server, tokenizer, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """One completion per prompt at temperature 1.0 (seed = the prompt's index), decoded up to <|im_end|>."""

    async def ask():
        async with GenerationClient(server.url) as client:
            return await asyncio.gather(
                *[client.complete(p, max_tokens=max_tokens, seed=i, temperature=1.0) for i, p in enumerate(prompts)]
            )

    return [tokenizer.decode(c.token_ids).split(tokenizer.eos_token)[0] for [c] in asyncio.run(ask())]


def tools_prompt(tokenizer, messages: list[dict], tools: list) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def test_calculator_adds_and_subtracts_integers_and_nothing_else():
    assert calculator("37 + 48") == "85"
    assert calculator("5 - 12 + 3") == "-4"
    assert calculator("-4 - -3") == "-1"
    for bad in ("2 * 3", "1 +", "", "__import__('os')", "1.5 + 2"):
        with pytest.raises(ValueError, match="integers joined by \\+ and -"):
            calculator(bad)


def test_a_function_and_its_schema_render_the_same_tools_block(tokenizer):
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    assert tools_prompt(tokenizer, messages, [calculator]) == tools_prompt(
        tokenizer, messages, [get_json_schema(calculator)]
    )


def the_call(text: str) -> dict | None:
    """The reply's only well-formed tool call as {"name": ..., "arguments": ...}, else None."""
    calls = parse_reply(text).tool_calls
    return (
        {"name": calls[0].name, "arguments": calls[0].arguments} if len(calls) == 1 and calls[0].error is None else None
    )


def test_with_the_calculator_offered_it_calls_it_on_part_of_the_problems(server, tokenizer):
    """Room for RL: the model calls the calculator on some held-out problems, not all, and answers with the
    tool's result once it has it."""
    problems = [p for p in arithmetic.all_problems() if arithmetic.split_of(p) == "test"][::20][:100]
    asks = [[{"role": "user", "content": arithmetic.question(p)}] for p in problems]
    expressions = [f"{a} {op} {b}" for a, op, b in problems]

    texts = sample(server, tokenizer, [tools_prompt(tokenizer, m, [calculator]) for m in asks], max_tokens=40)
    calls = sum(
        the_call(t) == {"name": "calculator", "arguments": {"expression": e}} for t, e in zip(texts, expressions)
    )
    assert 0.1 <= calls / len(problems) <= 0.7, f"calculator call rate {calls / len(problems):.2f}"

    used = [
        m
        + [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
                ],
            },
            {"role": "tool", "content": calculator(e)},
        ]
        for m, e in zip(asks, expressions)
    ]
    answers = sample(server, tokenizer, [tools_prompt(tokenizer, m, [calculator]) for m in used], max_tokens=8)
    correct = sum(arithmetic.is_correct(t, str(arithmetic.answer(p))) for t, p in zip(answers, problems))
    assert correct / len(problems) >= 0.8, f"answer after the tool's response right {correct / len(problems):.2f}"


def test_it_calls_an_environments_integer_tool_with_the_messages_integer(server, tokenizer):
    schema = get_json_schema(IncrementEnv().increment)
    assert list(schema["function"]["parameters"]["properties"]) == ["step"]  # a bound method's schema leaves out self
    prompt = tools_prompt(tokenizer, [{"role": "user", "content": "Increment the counter by 3."}], [schema])

    texts = sample(server, tokenizer, [prompt] * 100, max_tokens=40)
    calls = sum(the_call(t) == {"name": "increment", "arguments": {"step": 3}} for t in texts)
    assert 0.3 <= calls / len(texts) <= 0.95, f"increment call rate {calls / len(texts):.2f}"
