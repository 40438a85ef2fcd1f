"""The multi-turn tool loop, tools and environments, driven by scripted replies (no server): what the model
"says" is fixed, and the test checks what the loop runs, records and hands to the trainer."""

import asyncio
import multiprocessing as mp
import time
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from tandem import AsyncGRPOConfig, AsyncRolloutLoop, TurnRecord
from tandem.contract.channels import ServedVersions
from tandem.rollout.environments import environment_tools, reset_prompt, validate_environments
from tandem.rollout.reconcile import reconcile
from tandem.rollout.settings import RolloutSettings
from tandem.rollout.tools import validate_tools
from tandem.tasks import TINY_MODEL_PATH

TOKENIZER = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("the tool broke")


def sleepy(x: int) -> int:
    """Takes far too long.

    Args:
        x: Ignored.
    """
    time.sleep(2)
    return x


class Counter:
    """TRL's IncrementEnv example, reset from a dataset column."""

    def reset(self, target: int = 3, **kwargs) -> str:
        self.counter, self.target = 0, target
        return f" Reach {target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedLoop(AsyncRolloutLoop):
    """generate_one_turn answers with the next scripted reply (text, tokenised as the model's output)."""

    replies: list[str] = []

    async def generate_one_turn(self, prompt_ids):
        text = self.replies.pop(0)
        ids = TOKENIZER.encode(text, add_special_tokens=False) + [TOKENIZER.eos_token_id]
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-0.5] * len(ids))


def make_loop(replies, tools=(), environment_factory=None, **config):
    config = {"train_sampling_strategy": "sequential", **config}  # row i is prompt index i
    settings = RolloutSettings(
        config=AsyncGRPOConfig(num_generations=2, max_completion_length=32, **config),
        model_name="tiny",
        tokenizer_path=TINY_MODEL_PATH,
        dataset=None,
        reward_funcs=[],
        eos_token_ids=[TOKENIZER.eos_token_id],
        base_url="http://127.0.0.1:9",
        tools=list(tools),
        environment_factory=environment_factory,
    )
    channels = SimpleNamespace(served=ServedVersions(mp.get_context("spawn")))  # the one channel generation reads
    loop = ScriptedLoop(settings, processing_class=TOKENIZER, channels=channels)
    loop.replies = list(replies)
    return loop


def run(loop, prompt="What is 6 times 7?", tools=None):
    messages = [{"role": "user", "content": prompt}]
    return asyncio.run(loop.generate_one(messages, loop.settings.tools if tools is None else tools))


def test_tools_run_in_order_and_their_results_feed_the_next_turn():
    loop = make_loop([call("multiply", a=6, b=7) + call("async_add", a=1, b=2), "42"], tools=[multiply, async_add])
    rollout = run(loop)
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "tool", "assistant"]
    assert [m["content"] for m in rollout.completion[1:3]] == ["42", "3"], "results in the order the calls were written"
    assert rollout.completion[-1]["content"] == "42"
    assert rollout.tool_call_count == 2 and rollout.tool_failure_count == 0
    assert len(rollout.turns) == 2
    assert b"<tool_response>\n42\n</tool_response>" in TOKENIZER.decode(rollout.turns[1].prompt_ids).encode()
    assert loop._scheduler.records["tools/parallel_calls_mean"] == [2]
    assert loop._scheduler.records["tools/multiply/call_count"] == [1] and loop._scheduler.records[
        "tools/call_frequency"
    ] == [2]


def test_a_clean_chain_of_turns_is_one_sample_training_only_the_generated_tokens():
    loop = make_loop([call("multiply", a=6, b=7), "42"], tools=[multiply])
    rollout = run(loop)
    [sample], stats = reconcile(rollout.turns, version=0)
    assert stats.forks == 0, "the tiny template re-renders the history as it was generated"
    generated = sum(len(t.output_ids) for t in rollout.turns)
    assert sum(sample.trained) == generated == len(rollout.completion_ids), "tool output is context, never trained"


@pytest.mark.parametrize(
    "reply, status",
    [
        (call("explode", x=1), "RuntimeError: the tool broke"),
        (call("nonexistent", x=1), "unknown tool 'nonexistent'"),
        ("<tool_call>\n{not json}\n</tool_call>", "malformed tool call"),
        (call("multiply", a=1), "bad arguments for 'multiply'"),
        (call("sleepy", x=1), "did not answer within 0.2s"),
    ],
)
def test_each_tool_failure_is_an_error_message_to_the_model_and_a_counted_failure(reply, status):
    loop = make_loop([reply, "done"], tools=[multiply, explode, sleepy], tool_call_timeout=0.2)
    started = time.monotonic()
    rollout = run(loop)
    assert time.monotonic() - started < 1.5, "a hung tool must not hold the rollout"
    tool_message = rollout.completion[1]
    assert tool_message["role"] == "tool" and status in tool_message["content"] and '"error"' in tool_message["content"]
    assert rollout.tool_failure_count == 1 and loop._scheduler.records["tools/failure_frequency"] == [1.0]
    assert rollout.completion[-1]["content"] == "done", "the run goes on after the failure"
    unknown = loop._scheduler.records["tools/unknown_name_count"]
    assert unknown == [int("unknown" in status)]


def test_the_iteration_cap_stops_a_rollout_that_keeps_calling_and_it_is_still_trained():
    loop = make_loop([call("multiply", a=1, b=2)] * 5, tools=[multiply], max_tool_calling_iterations=2)
    rollout = run(loop)
    assert len(rollout.turns) == 3 and rollout.tool_call_count == 2, "two tool-calling turns, then the cap"
    assert loop._scheduler.records["tools/loop_exhausted_frac"] == [1.0]
    samples, _ = reconcile(rollout.turns, version=0)
    assert sum(sum(s.trained) for s in samples) == len(rollout.completion_ids)


def test_tool_call_parser_reads_replies_in_the_models_own_format():
    """A Llama 3.2-style model writes pythonic calls; the chat template still renders them back as messages."""
    loop = make_loop(["[multiply(a=6, b=7)]", "42"], tools=[multiply], tool_call_parser="pythonic")
    rollout = run(loop)
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant"]
    assert rollout.completion[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    ]
    assert rollout.completion[1]["content"] == "42" and rollout.tool_call_count == 1

    hermes_block = make_loop([call("multiply", a=6, b=7)], tools=[multiply], tool_call_parser="pythonic")
    assert run(hermes_block).tool_call_count == 0, "another format's block is plain text to this one"


def test_a_conversation_that_would_pass_max_model_len_ends_there_and_is_counted():
    loop = make_loop([call("multiply", a=1, b=2)] * 5, tools=[multiply])
    first = loop.render([{"role": "user", "content": "What is 6 times 7?"}], loop.toolbox([multiply]).schemas)
    loop._scheduler.generation.max_model_len = len(first) + 60
    rollout = run(loop)
    assert 1 <= len(rollout.turns) < 5
    assert loop._scheduler.records["rollout/context_exhausted_count"] == [1]


def test_a_first_prompt_that_leaves_no_room_is_a_clear_error():
    loop = make_loop(["hi"], tools=[multiply])
    loop._scheduler.generation.max_model_len = 50
    with pytest.raises(ValueError, match="leaving no room to generate in max_model_len=50"):
        run(loop)


def test_without_tools_a_reply_is_plain_text_and_nothing_is_run():
    loop = make_loop([call("multiply", a=1, b=2)])
    rollout = run(loop, tools=[])
    assert len(rollout.turns) == 1 and rollout.tool_call_count == 0
    assert "tools/call_frequency" not in loop._scheduler.records


def test_an_environment_is_reset_from_its_row_exposes_its_methods_and_scores_itself():
    loop = make_loop([call("increment", step=3), "done"], environment_factory=Counter)
    episode = asyncio.run(
        loop._scheduler.generation.one_rollout(
            {"prompt": [{"role": "user", "content": "Count."}], "target": 3}, group_id=0
        )
    )
    assert episode.prompt == [{"role": "user", "content": "Count. Reach 3."}], (
        "reset's text joins the last user message"
    )
    assert episode.rollout.completion[1]["content"] == "3"
    assert episode.env_reward == (Counter, 1.0)
    assert loop._scheduler.records["env/reset_s"] and loop._scheduler.records["env/reward_s"]
    assert len(loop._scheduler.generation.environments.idle[None]) == 1, "the instance went back to the pool"
    loop.replies.append("no")
    second = asyncio.run(loop._scheduler.generation.one_rollout({"target": 5}, group_id=1))
    assert second.prompt == [{"role": "user", "content": " Reach 5."}] and second.env_reward == (Counter, 0.0)
    assert len(loop._scheduler.generation.environments.idle[None]) == 1, "and was reused, not made again"


class Game:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:
        """Apply an action.

        Args:
            action: One of up, down, left, right.
        """
        return "moved " + action


def test_routing_exposes_only_the_rows_environment_tools():
    assert [t.__name__ for t in environment_tools(Counter())] == ["increment"]
    assert [t.__name__ for t in environment_tools(Game())] == ["move"]
    loop = make_loop([call("increment", step=1), "ok"], environment_factory={"count": Counter, "game": Game})
    episode = asyncio.run(loop._scheduler.generation.one_rollout({"environment": "game"}, group_id=0))
    assert "unknown tool 'increment'" in episode.rollout.completion[1]["content"], "the game rollout cannot count"


def test_reset_text_becomes_the_prompt_when_the_row_has_none():
    assert reset_prompt(None, "Reach 4.") == [{"role": "user", "content": "Reach 4."}]
    with pytest.raises(ValueError, match="reset\\(\\) must return the task"):
        reset_prompt(None, None)


def nested_tool_factory():
    def inner(x: int) -> int:
        """Nested.

        Args:
            x: A number.
        """
        return x

    return inner


def no_hints(x):
    """No type hints.

    Args:
        x: A number.
    """
    return x


class NoReset:
    def go(self, x: int) -> int:
        """Go.

        Args:
            x: A number.
        """
        return x


@pytest.mark.parametrize(
    "tools, message",
    [
        ([lambda x: x], "a lambda cannot be a tool"),
        ([nested_tool_factory()], "a nested function"),
        ([no_hints], "no_hints"),
        ([multiply, multiply], "two tools are named 'multiply'"),
    ],
)
def test_bad_tools_fail_before_any_work_naming_the_fix(tools, message):
    with pytest.raises((TypeError, ValueError), match=message):
        validate_tools(tools)


def test_bad_environments_fail_before_any_work_naming_the_fix():
    with pytest.raises(TypeError, match="has no reset"):
        validate_environments(NoReset, [], {"train_dataset": None})
    rows = [{"environment": "count"}, {"environment": "game"}]
    with pytest.raises(ValueError, match=r"names \['game'\]"):
        validate_environments({"count": Counter}, [], {"train_dataset": rows})
    with pytest.raises(ValueError, match="'environment' column"):
        validate_environments({"count": Counter}, [], {"train_dataset": [{"prompt": "x"}]})
    with pytest.raises(ValueError, match="two tools are named 'increment'"):
        validate_environments(Counter, [Counter().increment], {"train_dataset": None})


def test_an_eval_row_naming_an_unknown_environment_fails_when_the_trainer_is_built():
    train = [{"prompt": "x", "environment": "count"}]
    with pytest.raises(ValueError, match=r"eval_dataset's 'environment' column names \['game'\]"):
        validate_environments(
            {"count": Counter}, [], {"train_dataset": train, "eval_dataset": [{"environment": "game"}]}
        )
    with pytest.raises(ValueError, match="the eval_dataset has columns"):
        validate_environments({"count": Counter}, [], {"train_dataset": train, "eval_dataset": [{"prompt": "x"}]})


class Expensive(Counter):
    """An environment whose __init__ is costly: the pool pays it once per instance."""

    built = 0

    def __init__(self):
        super().__init__()
        Expensive.built += 1


def test_reading_an_environment_class_tools_runs_no_init_of_it():
    Expensive.built = 0
    [cls] = validate_environments(Expensive, [], {"train_dataset": None})
    assert cls is Expensive and Expensive.built == 0, "the class is read, not built: its __init__ is the pool's"
    validate_environments(lambda: Expensive(), [], {"train_dataset": None})
    assert Expensive.built == 1, "a factory function is called once to see what it makes"
