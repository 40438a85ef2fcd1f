"""The shipped tiny model and the arithmetic task it was pretrained on."""

import asyncio
import json

from transformers import AutoConfig, AutoModelForCausalLM

from tandem.generation.client import GenerationClient
from tandem.tasks import TINY_MODEL_PATH, arithmetic
from tests.conftest import chat_prompt


def test_loads_with_the_ordinary_from_pretrained():
    config = AutoConfig.from_pretrained(TINY_MODEL_PATH)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)
    assert config.model_type == "qwen2"
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 5e6


def test_chat_template_renders_every_role_and_a_tools_list(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "2 + 2"}}}]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    tools = [{"type": "function", "function": {"name": "calc", "description": "evaluate", "parameters": {"type": "object"}}}]
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
    assert not any(r["prompt"][0]["content"] in train_questions for r in arithmetic.make_rows(200, split="test", seed=1))
    assert arithmetic.is_correct(" 85 is the answer", "85")
    assert arithmetic.is_correct("-3", "-3")
    assert not arithmetic.is_correct("8", "85")
    assert not arithmetic.is_correct("no idea", "85")


def test_held_out_pass_rate_leaves_room_to_learn(server, tokenizer):
    """Sampled at temperature 1.0, the tiny model solves between 20% and 80% of held-out problems."""
    rows = arithmetic.make_rows(200, split="test", seed=2)

    async def ask():
        async with GenerationClient(server.url) as client:
            return await asyncio.gather(*[
                client.complete(chat_prompt(tokenizer, r["prompt"][0]["content"]), max_tokens=8, seed=i, temperature=1.0)
                for i, r in enumerate(rows)
            ])

    results = asyncio.run(ask())
    correct = sum(arithmetic.is_correct(tokenizer.decode(c.token_ids, skip_special_tokens=True), r["solution"]) for r, [c] in zip(rows, results))
    assert 0.2 <= correct / len(rows) <= 0.8, f"pass rate {correct / len(rows):.2f}"
