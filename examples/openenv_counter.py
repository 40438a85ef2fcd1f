"""Agent training on an OpenEnv environment through its harness: a counter served as MCP tools, played by OpenEnv's
`MCPHarnessAdapter`, every model call sampled by tandem.

    pip install 'tandem-rl[openenv]' && python examples/openenv_counter.py      (about 9 minutes on 2 CPU cores)

`CounterEnvironment` is an OpenEnv `MCPEnvironment` (its tool, `increment`, is a FastMCP tool); `CounterSession` is
the `ResourceSession` the harness drives: the task (a target drawn from the episode's seed, so the rollouts of a
group share it), the tools, their calls, and `verify`, which forwards the environment's own reward. The tiny model
calls an offered integer tool on part of the problems; RL teaches it to call it, with the right number, every time.
Nothing here needs a container or the network: the environment runs inside the rollout worker.
"""

import json
import logging
import random

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
from openenv.core.env_server.types import Observation, State
from openenv.core.harness import MCPHarnessAdapter, ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult

from tandem import AsyncGRPOConfig, HarnessAsyncGRPOTrainer

logging.getLogger("fastmcp").setLevel(logging.ERROR)  # its warning per malformed call would fill the dashboard

PHRASINGS = ["Increment the counter by {n}.", "Increment the counter to {n}.", "Add {n} to the counter."]
"""examples/environment.py's phrasings but "Bring the counter from 0 to {n}.", where the tiny model copies the 0 into its
call: some runs learn it within 100 steps, others stay at ~0.1 on it (measured), which makes the curve a matter of luck."""


class CounterEnvironment(MCPEnvironment):
    """A counter to bring to a target: `increment` is its one tool; the reward is 1 when the counter ends on it."""

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
        self.counter, self.target, self._state = 0, 0, State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        rng = random.Random(seed)
        self.counter, self.target = 0, rng.randint(1, 9)
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(metadata={"task": rng.choice(PHRASINGS).format(n=self.target)})

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        raise ValueError(f"the counter takes tool calls only, not {type(action).__name__}")

    @property
    def state(self) -> State:
        return self._state


class CounterSession(ResourceSession):
    """One episode of the counter, as OpenEnv's harness drives it."""

    def __init__(self, seed: int | None, episode_id: str | None):
        self.env = CounterEnvironment()
        self.task = self.env.reset(seed=seed, episode_id=episode_id).metadata["task"]

    def initial_messages(self) -> list[dict]:
        return [{"role": "user", "content": self.task}]

    def list_tools(self):
        return self.env.step(ListToolsAction()).tools

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        observation = self.env.step(CallToolAction(tool_name=name, arguments=arguments))
        if observation.error is not None:
            return ToolResult(error=observation.error.message, data=f"error: {observation.error.message}")
        return ToolResult(data=json.dumps(observation.result.data))

    def verify(self, transcript: list[dict], final_state=None) -> VerifyResult:
        return VerifyResult(env_reward=float(self.env.counter == self.env.target), done=True)

    def close(self) -> None:
        self.env.close()


class CounterSessions(ResourceSessionFactory):
    """The sessions: the task comes from the seed (the group's, so its rollouts share it): no dataset is needed."""

    def create(self, task, seed=None, episode_id=None) -> CounterSession:
        return CounterSession(seed, episode_id)


def config(**overrides) -> AsyncGRPOConfig:
    """The example's settings (examples/environment.py's, over 100 steps); the vllm tier's test shortens them."""
    values = dict(
        output_dir="runs/openenv_counter",
        max_steps=100,
        learning_rate=2e-4,
        num_generations=8,
        max_completion_length=32,
        max_tool_calling_iterations=1,
        token_budget=1024,
        gradient_checkpointing=False,
        max_staleness=2,
        save_steps=1000,
        logging_steps=1,
    )
    return AsyncGRPOConfig(**{**values, **overrides})


if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    trainer = HarnessAsyncGRPOTrainer(
        model="tiny", harness_session_factory=CounterSessions(), harness_adapter=MCPHarnessAdapter(), args=config()
    )
    output = trainer.train()
    head, tail = trainer.reward_history[:20], trainer.reward_history[-20:]
    print(
        f"\ntrained {output.global_step} steps; mean reward, first {len(head)} steps: {sum(head) / len(head):.3f}   "
        f"last {len(tail)} steps: {sum(tail) / len(tail):.3f}"
    )
