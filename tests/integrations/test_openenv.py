"""OpenEnv environments train unchanged through `HarnessAsyncGRPOTrainer`: an environment built here from OpenEnv's
core (an `MCPEnvironment` whose tool is a FastMCP tool; no container, no download), played by OpenEnv's own
`MCPHarnessAdapter` in the rollout worker, every model call sampled by tandem."""

import json
import sys

import pytest
from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
from openenv.core.env_server.types import Observation, State
from openenv.core.harness import MCPHarnessAdapter, ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult

from tandem import AsyncGRPOConfig, HarnessAsyncGRPOTrainer, UsageError
from tandem.integrations.openenv import environment_reward


class CounterEnvironment(MCPEnvironment):
    """A counter to bring to a target with its `increment` tool; the reward is 1 when it ends there."""

    def __init__(self):
        tools = FastMCP("counter")

        @tools.tool
        def increment(step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            self.counter += step
            return self.counter

        super().__init__(tools)
        self.counter, self.target = 0, 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self.counter, self.target = 0, 1 + (seed or 0) % 9
        return Observation()

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        raise ValueError("tool calls only")

    @property
    def state(self) -> State:
        return State()


class CounterSession(ResourceSession):
    def __init__(self, seed, task_text: str, broken: bool):
        self.env, self.broken = CounterEnvironment(), broken
        self.env.reset(seed=seed)
        self.task = task_text.format(n=self.env.target)

    def initial_messages(self):
        return [{"role": "user", "content": self.task}]

    def list_tools(self):
        return self.env.step(ListToolsAction()).tools

    def call_tool(self, name, arguments):
        observation = self.env.step(CallToolAction(tool_name=name, arguments=arguments))
        if observation.error is not None:
            return ToolResult(error=observation.error.message, data=f"error: {observation.error.message}")
        return ToolResult(data=json.dumps(observation.result.data))

    def verify(self, transcript, final_state=None):
        if self.broken:
            raise RuntimeError("the environment's verifier crashed")
        return VerifyResult(env_reward=float(self.env.counter == self.env.target), done=True)

    def close(self):
        self.env.close()


class CounterSessions(ResourceSessionFactory):
    """Every `broken_every`-th session's verify raises; every `long_every`-th task is longer than the server's context."""

    def __init__(self, broken_every: int = 0, long_every: int = 0):
        self.broken_every, self.long_every, self.made = broken_every, long_every, 0

    def create(self, task, seed=None, episode_id=None):
        self.made += 1
        long = self.long_every and self.made % self.long_every == 0
        return CounterSession(seed, "word " * 1200 + "{n}" if long else "Increment the counter by {n}.",
                              broken=bool(self.broken_every and self.made % self.broken_every == 0))


def logged(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]


@pytest.mark.slow
def test_an_openenv_environment_trains_through_its_harness_with_the_samplers_own_tokens(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=2, num_generations=4, max_completion_length=32,
                           max_tool_calling_iterations=1, max_staleness=0, learning_rate=1e-4,
                           gradient_checkpointing=False, save_strategy="no", logging_steps=1)
    trainer = HarnessAsyncGRPOTrainer("tiny", harness_session_factory=CounterSessions(broken_every=5, long_every=7),
                                      harness_adapter=MCPHarnessAdapter(), args=args)
    assert trainer.train().global_step == 2
    rows = logged(tmp_path)
    assert all("rewards/harness_reward/mean" in r for r in rows if "reward" in r), "the environment's reward, by name"
    assert any(r.get("tools/increment/call_count", 0) > 0 for r in rows), "the model called the environment's tool"
    assert max(r.get("rollout/turns_max", 0) for r in rows) >= 2, "multi-turn: a reply after the tool's result"
    assert any("env/reset_s" in r and "env/reward_s" in r for r in rows)
    assert sum(r.get("env/failure_count", 0) for r in rows) > 0, "a verifier that raises is counted, not fatal"
    assert sum(r.get("rollout/context_exhausted_count", 0) for r in rows) > 0, "a task past max_model_len ends there"
    for r in rows:  # staleness 0: the trainer scores exactly the tokens and log-probs the sampler produced
        assert r["sample/staleness_max"] == 0
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4


def test_the_environments_reward_comes_from_verify_else_from_the_last_tool_result():
    assert environment_reward(VerifyResult(env_reward=0.5), ToolResult(metadata={"reward": 1.0})) == 0.5
    assert environment_reward(VerifyResult(), ToolResult(metadata={"reward": 1})) == 1.0
    assert environment_reward(VerifyResult(), None) is None, "no reward given: the rollout is unscored"
    with pytest.raises(TypeError, match="not a number"):
        environment_reward(VerifyResult(env_reward="high"), None)


def test_a_loop_owning_session_is_refused_with_the_fix():
    with pytest.raises(NotImplementedError, match="harness_adapter=MCPHarnessAdapter"):
        HarnessAsyncGRPOTrainer("tiny", harness_session_factory=CounterSessions())


def test_without_openenv_installed_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(UsageError, match=r"pip install 'tandem\[openenv\]'"):
        HarnessAsyncGRPOTrainer("tiny", harness_session_factory=CounterSessions(), harness_adapter=MCPHarnessAdapter())
