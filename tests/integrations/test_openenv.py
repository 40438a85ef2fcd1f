"""OpenEnv environments train unchanged through `HarnessAsyncGRPOTrainer`: an environment built here from OpenEnv's
core (an `MCPEnvironment` whose tool is a FastMCP tool, the calculator; no container, no download), played by OpenEnv's
own `MCPHarnessAdapter` in the rollout worker, every model call sampled by tandem. (examples/openenv_counter.py is
another, the counter; its whole run is in test_examples_learn.py.)"""

import functools
import json
import re
import sys

import pytest
from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
from openenv.core.env_server.types import Observation, State
from openenv.core.harness import MCPHarnessAdapter, ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult

from tandem import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, UsageError
from tandem.integrations.openenv import Episode, TimedSession, environment_reward, sessions_of
from tandem.tasks import arithmetic
from tandem.tasks.tools import calculator as add_and_subtract


class CalculatorEnvironment(MCPEnvironment):
    """Arithmetic with a calculator: its one tool wraps tandem's calculator, which the tiny model was pretrained to call."""

    def __init__(self):
        tools = FastMCP("calculator")

        @tools.tool
        def calculator(expression: str) -> str:
            """Add and subtract integers.

            Args:
                expression: Integers joined by + and - signs.
            """
            return add_and_subtract(expression)

        super().__init__(tools)

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        [row] = arithmetic.make_rows(1, split="test", seed=seed or 0)
        return Observation(metadata={"question": row["prompt"][0]["content"], "answer": row["solution"]})

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        raise ValueError("tool calls only")

    @property
    def state(self) -> State:
        return State()


class CalculatorSession(ResourceSession):
    """One question; the reward reads the answer from the transcript the harness passes to verify."""

    def __init__(self, seed, padding: str, broken: bool):
        self.env, self.broken = CalculatorEnvironment(), broken
        task = self.env.reset(seed=seed).metadata
        self.question, self.answer = padding + task["question"], task["answer"]

    def initial_messages(self):
        return [{"role": "user", "content": self.question}]

    def list_tools(self):
        return self.env.step(ListToolsAction()).tools

    def call_tool(self, name, arguments):
        observation = self.env.step(CallToolAction(tool_name=name, arguments=arguments))
        if observation.error is not None:
            return ToolResult(error=observation.error.message, data=f"error: {observation.error.message}")
        return ToolResult(data=str(observation.result.data))

    def verify(self, transcript, final_state=None):
        if self.broken:
            raise RuntimeError("the environment's verifier crashed")
        replies = [m for m in transcript if m["role"] == "assistant" and not m.get("tool_calls")]
        said = re.findall(r"-?\d+", replies[-1]["content"] if replies else "")
        return VerifyResult(env_reward=float(said[:1] == [self.answer]), done=True)

    def close(self):
        self.env.close()


class CalculatorSessions(ResourceSessionFactory):
    """Every `broken_every`-th session's verify raises; every `long_every`-th question is longer than the server's
    context."""

    def __init__(self, broken_every: int = 0, long_every: int = 0):
        self.broken_every, self.long_every, self.made = broken_every, long_every, 0

    def create(self, task, seed=None, episode_id=None):
        self.made += 1
        long = bool(self.long_every and self.made % self.long_every == 0)
        return CalculatorSession(
            seed, "word " * 1200 if long else "", broken=bool(self.broken_every and self.made % self.broken_every == 0)
        )


def logged(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]


@pytest.mark.long  # the harness's parts below run in the default suite; verifiers' run is long as well
def test_an_openenv_environment_trains_through_its_harness_with_the_samplers_own_tokens(tmp_path):
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        num_generations=4,
        max_completion_length=32,
        max_tool_calling_iterations=1,
        max_staleness=0,
        learning_rate=1e-4,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
    )
    sessions = functools.partial(CalculatorSessions, broken_every=5, long_every=7)  # a callable that makes the factory
    trainer = HarnessAsyncGRPOTrainer(
        "tiny", harness_session_factory=sessions, harness_adapter=MCPHarnessAdapter(), args=args
    )
    assert trainer.train().global_step == 2
    rows = logged(tmp_path)
    assert all("rewards/harness_reward/mean" in r for r in rows if "reward" in r), "the environment's reward, by name"
    assert any(r.get("tools/calculator/call_count", 0) > 0 for r in rows), "the model called the environment's tool"
    assert max(r.get("rollout/turns_max", 0) for r in rows) >= 2, "multi-turn: a reply after the tool's result"
    assert any("env/reset_s" in r and "env/reward_s" in r for r in rows)
    assert sum(r.get("env/failure_count", 0) for r in rows) > 0, "a verifier that raises is counted, not fatal"
    assert sum(r.get("rollout/context_exhausted_count", 0) for r in rows) > 0, "a task past max_model_len ends there"
    for r in rows:  # staleness 0: the trainer scores exactly the tokens and log-probs the sampler produced
        assert r["sample/staleness_max"] == 0
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4


def test_the_reward_follows_openenvs_rule_the_last_tool_result_carrying_one_else_verify():
    assert environment_reward(VerifyResult(env_reward=0.5), [ToolResult(data="3")]) == 0.5
    assert environment_reward(VerifyResult(), [ToolResult(metadata={"reward": 1}), ToolResult(data="4")]) == 1.0
    assert environment_reward(VerifyResult(env_reward=1.0), [ToolResult(data={"reward": 1.0})]) == 1.0
    with pytest.raises(ValueError, match="verify must forward"):
        environment_reward(VerifyResult(env_reward=0.0), [ToolResult(metadata={"reward": 1.0})])
    with pytest.raises(ValueError, match="no environment reward"):
        environment_reward(VerifyResult(), [])
    with pytest.raises(TypeError, match="not a number"):
        environment_reward(VerifyResult(env_reward="high"), [])


class RaisingSession(CalculatorSession):
    def call_tool(self, name, arguments):
        raise KeyError(name)  # as OpenEnv's StepEnvSessionAdapter does for a name it does not know


def test_a_tool_call_the_session_raises_on_is_an_error_message_to_the_model_and_counted():
    episode = Episode()
    session = TimedSession(RaisingSession(seed=1, padding="", broken=False), episode)
    assert [tool.name for tool in session.list_tools()] == ["calculator"]
    told = [session.call_tool(name, {"expression": "1 + 2"}) for name in ("calculator", "calculater")]
    assert all(result.error and result.data.startswith("error: ") for result in told)
    assert [(call.name, call.status) for call in episode.tool_calls] == [
        ("calculator", "error"),
        ("calculater", "unknown"),
    ]


def test_a_factory_or_a_callable_that_makes_one_serves_the_sessions():
    made = CalculatorSessions(broken_every=3)
    assert sessions_of(made) is made
    assert isinstance(sessions_of(CalculatorSessions), CalculatorSessions), "a factory class: TRL's convention"
    assert sessions_of(functools.partial(CalculatorSessions, broken_every=3)).broken_every == 3
    with pytest.raises(UsageError, match="returned int, which has no create"):
        sessions_of(lambda: 3)


def test_a_loop_owning_session_is_refused_with_the_fix():
    with pytest.raises(NotImplementedError, match="harness_adapter=MCPHarnessAdapter"):
        HarnessAsyncGRPOTrainer("tiny", harness_session_factory=CalculatorSessions())


def test_without_openenv_installed_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core.harness", None)  # as if openenv were not installed
    with pytest.raises(UsageError, match=r"pip install 'tandem-rl\[openenv\]'"):
        HarnessAsyncGRPOTrainer(
            "tiny", harness_session_factory=CalculatorSessions(), harness_adapter=MCPHarnessAdapter()
        )
