"""OpenEnv harness training: each rollout is one episode of an OpenEnv `ResourceSession`, driven by a white-box
`HarnessAdapter` (`MCPHarnessAdapter`: the tool loop) in the rollout worker. The adapter owns the conversation;
tandem owns every model call (`model_step`): it renders the messages with the training chat template, samples
through the loop's `generate_one_turn` (the sampler's ids and log-probs, never a re-tokenisation) and parses the
reply's tool calls, so the turns reconcile into samples by the same extend-or-fork rule as tandem's own tools.

The reward is the environment's, by OpenEnv's own rule: the last tool result that carries one, else `verify()`'s
`env_reward` (the two must agree; neither is an error). It is the reward source `harness_reward`, summed with any
reward functions. An episode that raises is a counted failure (`env/failure_count`), left out of its group.
"""

import asyncio
import contextvars
import json
import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, cast

from tandem.contract.records import Rollout, TurnRecord
from tandem.errors import UsageError
from tandem.generation.client import ServerError, ServerGone
from tandem.integrations import extras
from tandem.integrations.episodes import EpisodeFailures, completion_of
from tandem.rollout.loop import AsyncRolloutLoop
from tandem.rollout.tools import ToolResult


def library():
    """openenv's harness module."""
    return extras.library(
        "openenv.core.harness", "HarnessAsyncGRPOTrainer needs OpenEnv (the openenv package)", "openenv"
    )


class SessionFactory(Protocol):
    """OpenEnv's ResourceSessionFactory: makes each episode's session."""

    def create(self, task: Any, *, seed: int, episode_id: str) -> Any: ...


class WhiteBoxAdapter(Protocol):
    """OpenEnv's white-box HarnessAdapter: runs an episode's conversation, asking `model_step` for each model call."""

    def run_white_box(self, model_step: Callable[..., Any], session: Any, limits: Any) -> Any: ...


@dataclass
class OpenEnvHarness:
    """What the worker needs to play episodes: the session factory (or a picklable callable that makes one, as TRL's
    `harness_session_factory`), the white-box adapter, and the adapter's turn limit."""

    session_factory: SessionFactory | Callable[[], SessionFactory]
    adapter: WhiteBoxAdapter
    max_turns: int

    @property
    def loop_cls(self) -> type:
        return HarnessRolloutLoop


def check_harness(session_factory, adapter) -> None:
    """The harness's pieces, checked when the trainer is built: a factory (or what makes one), a white-box adapter."""
    harness = library()
    if adapter is None:
        raise NotImplementedError(
            "loop-owning OpenEnv sessions (no harness_adapter: an agent that runs its own loop "
            "behind a capture proxy) are not supported: tandem samples every model call itself. "
            "Pass harness_adapter=MCPHarnessAdapter() or another white-box HarnessAdapter."
        )
    if not isinstance(adapter, harness.HarnessAdapter):
        raise UsageError(
            f"harness_adapter is {type(adapter).__name__}, not an openenv HarnessAdapter "
            "(e.g. openenv.core.harness.MCPHarnessAdapter())"
        )
    if not callable(getattr(session_factory, "create", None)) and not callable(session_factory):
        raise UsageError(
            f"harness_session_factory is {type(session_factory).__name__}: pass a ResourceSessionFactory, "
            "or a picklable callable (a factory class) that returns one"
        )


def sessions_of(session_factory: SessionFactory | Callable[[], SessionFactory]) -> SessionFactory:
    """The factory itself, or what a callable (a factory class, TRL's convention) returns."""
    if is_factory(session_factory):
        return session_factory
    made: object = cast(Callable[[], SessionFactory], session_factory)()
    if not is_factory(made):
        raise UsageError(f"harness_session_factory() returned {type(made).__name__}, which has no create()")
    return made


def is_factory(value: object) -> TypeGuard[SessionFactory]:
    return not isinstance(value, type) and callable(getattr(value, "create", None))


@dataclass
class Episode:
    """What one episode's thread hands back to the worker's event loop."""

    turns: list[TurnRecord] = field(default_factory=list)
    transcript: list[dict] = field(default_factory=list)
    """The conversation: the adapter's, or as the last model call saw it when the context ran out."""
    tool_calls: list[ToolResult] = field(default_factory=list)
    reward: float | None = None
    context_exhausted: bool = False
    reset_s: float = 0.0
    reward_s: float = 0.0
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when the rollout's task is cancelled (a stale group): the thread stops at its next call."""
    sampling: Future | None = None
    """The model call in flight, cancelled with the rollout."""


class ContextExhausted(Exception):
    """The adapter's next prompt leaves no room to generate in the server's max_model_len: the episode ends there."""


class HarnessRolloutLoop(AsyncRolloutLoop):
    """`generate_one` plays one OpenEnv episode on a tool thread; the other hooks are AsyncRolloutLoop's. A subclass may
    override `generate_one_turn` (each of the adapter's model calls) or `compute_advantages` as usual."""

    rollout_reward_name = "harness_reward"

    async def setup(self) -> None:
        harness = self.settings.harness
        assert isinstance(harness, OpenEnvHarness)  # this loop is the OpenEnvHarness's own
        self.sessions, self.adapter = sessions_of(harness.session_factory), harness.adapter
        self.limits = library().HarnessRunLimits(max_turns=harness.max_turns)
        self.failures = EpisodeFailures("OpenEnv", self.record)

    async def generate_one(self, prompt: list[dict], tools: list, group_id: int = 0) -> Rollout:
        """One episode: a session made for the row's prompt and the group's seed (its rollouts share their task), the
        adapter's run with tandem sampling each turn, the environment's reward. The server's errors are the
        scheduler's to answer (a group generated again); the environment's are counted."""
        episode = Episode()
        play = self._scheduler.generation.runner.run_in_pool(
            self._play, episode, prompt, self.group_seed(), contextvars.copy_context(), asyncio.get_running_loop()
        )
        try:
            await play
        except asyncio.CancelledError:
            episode.cancelled.set()
            if episode.sampling is not None:
                episode.sampling.cancel()
            raise
        except (ServerError, ServerGone):
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's, the session's or the adapter's own error
            self.failures.failed(exc)
            return Rollout(completion=[], completion_ids=[], turns=[])
        self.failures.succeeded()
        self._record(episode)
        return Rollout(
            completion=[normal_message(m) for m in completion_of(episode.transcript)],
            turns=episode.turns,
            completion_ids=[t for turn in episode.turns for t in turn.output_ids],
            tool_call_count=len(episode.tool_calls),
            tool_failure_count=sum(call.failed for call in episode.tool_calls),
            reward=episode.reward,
        )

    def _play(self, episode: Episode, prompt: list[dict], seed: int, context: contextvars.Context, loop) -> None:
        """The episode, on a tool thread (the adapter and the session are synchronous); `context` is the rollout's
        (its sampling seeds and policy version), in which each model call is sampled on the event loop `loop`."""
        start = time.monotonic()
        session = TimedSession(self.sessions.create(prompt, seed=seed, episode_id=uuid.uuid4().hex), episode)
        try:
            episode.reset_s = time.monotonic() - start

            def model_step(messages, tools, sampling):
                if episode.cancelled.is_set():
                    raise asyncio.CancelledError("the rollout was cancelled")
                episode.sampling = context.run(
                    asyncio.run_coroutine_threadsafe, self._sample(episode, messages, tools), loop
                )
                return episode.sampling.result()

            try:
                episode.transcript = self.adapter.run_white_box(model_step, session, self.limits).messages
            except ContextExhausted:  # the transcript stays as the last model call saw it
                episode.context_exhausted = True
            start = time.monotonic()
            verdict = session.verify(episode.transcript)
            episode.reward_s = time.monotonic() - start
            episode.reward = environment_reward(verdict, session.results)
        finally:
            session.close()

    async def _sample(self, episode: Episode, messages: list[dict], tools: list):
        """One model call: the messages rendered with the tools' schemas, sampled, the reply parsed into OpenEnv's
        response (its well-formed tool calls; a malformed one is a failed call); the turn is kept for the rollout."""
        from openenv.core.llm_client import LLMResponse, ToolCall

        schemas = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in tools
        ]
        prompt_ids = self.render(messages, schemas or None)
        episode.transcript = list(messages)
        if not self._scheduler.generation.room_after(prompt_ids):
            raise ContextExhausted()
        turn = await self.generate_one_turn(prompt_ids)
        episode.turns.append(turn)
        message, calls = self.reply(turn.output_ids, parse=bool(tools))
        episode.transcript.append(message)
        episode.tool_calls += [ToolResult(call.name, "", "malformed") for call in calls if call.error is not None]
        response = LLMResponse(
            content=message.get("content") or "",
            tool_calls=[
                ToolCall(id=f"call_{len(episode.turns)}_{i}", name=c.name, args=c.arguments)
                for i, c in enumerate(calls)
                if c.error is None
            ],
        )
        return library().ModelStepResult(
            response=response,
            prompt_ids=prompt_ids,
            completion_ids=list(turn.output_ids),
            logprobs=list(turn.output_log_probs),
        )

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
    """A session whose tool calls are timed and kept (tools/* metrics), everything else passed through. A call the
    session raises on is an error message to the model, as in tandem's own tool loop (a name it never listed: an
    unknown tool, a policy error); `results` are the calls' results, in order."""

    def __init__(self, session, episode: Episode):
        self._session, self._episode = session, episode
        self.results: list = []
        self.names: set[str] = set()

    def __getattr__(self, name):
        return getattr(self._session, name)

    def list_tools(self):
        tools = self._session.list_tools()
        self.names = {tool.name for tool in tools}
        return tools

    def call_tool(self, name: str, arguments: dict):
        if self._episode.cancelled.is_set():
            raise asyncio.CancelledError("the rollout was cancelled")
        start = time.monotonic()
        try:
            result = self._session.call_tool(name, arguments)
        except Exception as exc:  # noqa: BLE001 - the session's error on this call: the model is told
            result = library().ToolResult(error=str(exc), data=f"error: {exc}")
        status = "unknown" if name not in self.names else "error" if getattr(result, "error", None) else "ok"
        self._episode.tool_calls.append(ToolResult(name, "", status, time.monotonic() - start))
        self.results.append(result)
        return result


def environment_reward(verdict, results: list) -> float:
    """The episode's reward by OpenEnv's rule (openenv.core.harness.rollout): the last tool result that carries one
    (`metadata["reward"]`, or `data["reward"]`), else `verify()`'s `env_reward`; the two must agree, and an episode with
    neither, or with a reward that is not a number, is an error (a counted failure)."""
    from_tools = next((value for value in map(carried_reward, reversed(results)) if value is not None), None)
    verified = getattr(verdict, "env_reward", None)
    for value in (from_tools, verified):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"the environment's reward is {type(value).__name__} {value!r}, not a number")
    if (
        from_tools is not None
        and verified is not None
        and not math.isclose(from_tools, verified, rel_tol=1e-9, abs_tol=1e-6)
    ):
        raise ValueError(
            f"verify() gave env_reward {verified}, but the last tool result carried {from_tools}: "
            "verify must forward the environment's reward"
        )
    reward = verified if from_tools is None else from_tools
    if reward is None:
        raise ValueError(
            "the episode produced no environment reward (verify().env_reward, or a tool result's metadata['reward'])"
        )
    return float(reward)


def carried_reward(result):
    """The reward a tool result carries, if any."""
    reward = (getattr(result, "metadata", None) or {}).get("reward")
    data = getattr(result, "data", None)
    return data.get("reward") if reward is None and isinstance(data, dict) else reward


def normal_message(message: dict) -> dict:
    """A message as reward functions read it: tool-call arguments as objects (OpenEnv writes them as JSON text)."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    return {
        **message,
        "tool_calls": [{**c, "function": {**c["function"], "arguments": arguments(c["function"])}} for c in calls],
    }


def arguments(function: dict):
    value = function.get("arguments")
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value
