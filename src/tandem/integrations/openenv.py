"""OpenEnv harness training: each rollout is one episode of an OpenEnv `ResourceSession`, driven by a white-box
`HarnessAdapter` (`MCPHarnessAdapter`: the tool loop) in the rollout worker. The adapter owns the conversation;
tandem owns every model call (`model_step`): it renders the messages with the training chat template, samples
through the loop's `generate_one_turn` (the sampler's ids and log-probs, never a re-tokenisation) and parses the
reply's tool calls, so the turns reconcile into samples by the same extend-or-fork rule as tandem's own tools.

The reward is the environment's (`verify().env_reward`, else the last tool result's `metadata["reward"]`), a reward
source named `harness_reward`, summed with any reward functions. An episode that raises is a counted failure
(`env/failure_count`): its rollout is left unscored, the rest of its group goes on.
"""

import asyncio
import contextvars
import json
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

from tandem.errors import UsageError
from tandem.records import Rollout, TurnRecord
from tandem.rollout.loop import AsyncRolloutLoop
from tandem.rollout.tools import ToolResult

INSTALL = "pip install 'tandem[openenv]'"
FAILED_IN_A_ROW = 20
"""Episodes failing in a row (every rollout of several groups) before the worker stops the run with the last error."""


def library():
    """openenv's harness module, or a one-line error naming the extra."""
    try:
        from openenv.core import harness
    except ImportError:
        raise UsageError(f"HarnessAsyncGRPOTrainer needs OpenEnv (the openenv package): {INSTALL}") from None
    return harness


@dataclass
class OpenEnvHarness:
    """What the worker needs to play episodes: the session factory (or a picklable callable that makes one, as TRL's
    `harness_session_factory`), the white-box adapter, and the adapter's turn limit."""

    session_factory: object
    adapter: object
    max_turns: int

    @property
    def loop_cls(self) -> type:
        return HarnessRolloutLoop


def check_harness(session_factory, adapter) -> None:
    """The harness's pieces, checked when the trainer is built: a factory with create(), a white-box adapter."""
    harness = library()
    if adapter is None:
        raise NotImplementedError("loop-owning OpenEnv sessions (no harness_adapter: an agent that runs its own loop "
                                  "behind a capture proxy) are not supported: tandem samples every model call itself. "
                                  "Pass harness_adapter=MCPHarnessAdapter() or another white-box HarnessAdapter.")
    if not isinstance(adapter, harness.HarnessAdapter):
        raise UsageError(f"harness_adapter is {type(adapter).__name__}, not an openenv HarnessAdapter "
                         "(e.g. openenv.core.harness.MCPHarnessAdapter())")
    if not (isinstance(session_factory, harness.ResourceSessionFactory) or callable(session_factory)):
        raise UsageError(f"harness_session_factory is {type(session_factory).__name__}: pass a ResourceSessionFactory, "
                         "or a picklable callable that returns one")


@dataclass
class Episode:
    """What one episode's thread hands back to the worker's event loop."""

    turns: list[TurnRecord] = field(default_factory=list)
    transcript: list[dict] = field(default_factory=list)
    """The conversation as the adapter last passed it to the model, with each reply appended."""
    tool_calls: list[ToolResult] = field(default_factory=list)
    reward: float | None = None
    context_exhausted: bool = False
    reset_s: float = 0.0
    reward_s: float = 0.0
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when the rollout's task is cancelled (a stale group): the thread stops at its next model call."""


class ContextExhausted(Exception):
    """The adapter's next prompt leaves no room to generate in the server's max_model_len: the episode ends there."""


class HarnessRolloutLoop(AsyncRolloutLoop):
    """`generate_one` plays one OpenEnv episode on a tool thread; the other hooks are AsyncRolloutLoop's. A subclass may
    override `generate_one_turn` (each of the adapter's model calls) or `compute_advantages` as usual."""

    rollout_reward_name = "harness_reward"

    async def setup(self) -> None:
        harness: OpenEnvHarness = self.settings.harness
        factory = harness.session_factory
        self.sessions = factory if hasattr(factory, "create") else factory()
        if not callable(getattr(self.sessions, "create", None)):
            raise UsageError(f"harness_session_factory() returned {type(self.sessions).__name__}, which has no create()")
        self.adapter, self.limits = harness.adapter, library().HarnessRunLimits(max_turns=harness.max_turns)
        self.failed_in_a_row = 0

    async def generate_one(self, prompt: list[dict], tools: list, group_id: int = 0) -> Rollout:
        """One episode: a session made for the row's prompt (seed = the group, so a group shares its task), the
        adapter's run with tandem sampling each turn, the environment's reward; failures are counted, not raised."""
        episode = Episode()
        play = self._scheduler.generation.runner.run_in_pool(self._play, episode, prompt, group_id,
                                                             contextvars.copy_context(), asyncio.get_running_loop())
        try:
            await play
        except asyncio.CancelledError:
            episode.cancelled.set()  # the thread stops at its next model call
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's or the adapter's own error: counted, not fatal
            self._failed(exc)
            return Rollout(completion=[], completion_ids=[], turns=[])
        self.failed_in_a_row = 0
        self._record(episode)
        return rollout_of(episode)

    def _play(self, episode: Episode, prompt: list[dict], group_id: int, context: contextvars.Context, loop) -> None:
        """The episode, on a tool thread (the adapter and the session are synchronous); `context` is the rollout's
        (its sampling seeds and policy version), in which each model call is sampled on the event loop `loop`."""
        start = time.monotonic()
        session = TimedSession(self.sessions.create(prompt, seed=group_id, episode_id=uuid.uuid4().hex), episode.tool_calls)
        try:
            episode.reset_s = time.monotonic() - start

            def model_step(messages, tools, sampling):
                if episode.cancelled.is_set():
                    raise asyncio.CancelledError("the rollout was cancelled")
                return context.run(asyncio.run_coroutine_threadsafe, self._sample(episode, messages, tools), loop).result()

            try:
                episode.transcript = self.adapter.run_white_box(model_step, session, self.limits).messages
            except ContextExhausted:  # the transcript stays as the last model call saw it
                episode.context_exhausted = True
            start = time.monotonic()
            verdict = session.verify(episode.transcript)
            episode.reward_s = time.monotonic() - start
            episode.reward = environment_reward(verdict, session.last)
        finally:
            session.close()

    async def _sample(self, episode: Episode, messages: list[dict], tools: list):
        """One model call: the messages rendered with the tools' schemas, sampled, the reply parsed into OpenEnv's
        response (its well-formed tool calls); the turn is kept for the rollout's training sequences."""
        from openenv.core.llm_client import LLMResponse, ToolCall

        schemas = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": t.input_schema}} for t in tools]
        prompt_ids = self.render(messages, schemas or None)
        episode.transcript = list(messages)
        if not self._scheduler.generation.room_after(prompt_ids):
            raise ContextExhausted()
        turn = await self.generate_one_turn(prompt_ids)
        episode.turns.append(turn)
        message, calls = self.reply(turn.output_ids, parse=bool(tools))
        episode.transcript.append(message)
        response = LLMResponse(content=message.get("content") or "", tool_calls=[
            ToolCall(id=f"call_{len(episode.turns)}_{i}", name=c.name, args=c.arguments)
            for i, c in enumerate(calls) if c.error is None])
        return library().ModelStepResult(response=response, prompt_ids=prompt_ids, completion_ids=list(turn.output_ids),
                                       logprobs=list(turn.output_log_probs))

    def _failed(self, exc: BaseException) -> None:
        """An episode that raised: counted (env/failure_count) and said; too many in a row stop the run."""
        self.record("env/failure_count", 1)
        self.failed_in_a_row += 1
        text = "".join(traceback.format_exception(exc)).rstrip()
        if self.failed_in_a_row >= FAILED_IN_A_ROW:
            raise RuntimeError(f"{FAILED_IN_A_ROW} OpenEnv episodes in a row failed; the last one:\n{text}")
        print(f"tandem: an OpenEnv episode failed and is left unscored: {text.splitlines()[-1]}", file=sys.stderr)

    def _record(self, episode: Episode) -> None:
        generation = self._scheduler.generation
        self.record("env/reset_s", episode.reset_s)
        self.record("env/reward_s", episode.reward_s)
        for result in episode.tool_calls:
            generation.record_call(result)
        self.record("tools/call_frequency", len(episode.tool_calls))
        if episode.context_exhausted:
            self.record("rollout/context_exhausted_count", 1)


class TimedSession:
    """A session whose tool calls are timed and kept (tools/* metrics), everything else passed through: a call to a
    name the session never listed is an unknown tool (a policy error, as in tandem's own tool loop); `last` is the last
    tool result, whose metadata may carry the reward."""

    def __init__(self, session, calls: list[ToolResult]):
        self._session, self._calls, self.last, self.names = session, calls, None, set()

    def __getattr__(self, name):
        return getattr(self._session, name)

    def list_tools(self):
        tools = self._session.list_tools()
        self.names = {tool.name for tool in tools}
        return tools

    def call_tool(self, name: str, arguments: dict):
        start = time.monotonic()
        result = self._session.call_tool(name, arguments)
        status = "unknown" if name not in self.names else "error" if getattr(result, "error", None) else "ok"
        self._calls.append(ToolResult(name, "", status, time.monotonic() - start))
        self.last = result
        return result


def environment_reward(verdict, last_tool) -> float | None:
    """The episode's reward as the environment gave it: verify()'s env_reward, else the last tool result's
    metadata["reward"]; None when it gave none (the rollout is unscored). A value that is not a number raises."""
    value = getattr(verdict, "env_reward", None)
    if value is None and last_tool is not None:
        value = (getattr(last_tool, "metadata", None) or {}).get("reward")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the environment's reward is {type(value).__name__} {value!r}, not a number")
    return float(value)


def rollout_of(episode: Episode) -> Rollout:
    """The episode as tandem's Rollout: the replies and tool results after the prompt, the sampled turns, the reward."""
    first = next((i for i, m in enumerate(episode.transcript) if m.get("role") == "assistant"), len(episode.transcript))
    return Rollout(completion=[normal_message(m) for m in episode.transcript[first:]],
                   completion_ids=[t for turn in episode.turns for t in turn.output_ids], turns=episode.turns,
                   tool_call_count=len(episode.tool_calls),
                   tool_failure_count=sum(call.failed for call in episode.tool_calls), reward=episode.reward)


def normal_message(message: dict) -> dict:
    """A message as reward functions read it: tool-call arguments as objects (OpenEnv writes them as JSON text)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    return {**message, "tool_calls": [{**c, "function": {**c["function"], "arguments": arguments(c["function"])}}
                                      for c in calls]}


def arguments(function: dict):
    value = function.get("arguments")
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value
