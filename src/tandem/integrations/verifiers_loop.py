"""The worker's side of verifiers training (integrations/verifiers.py makes the rows): `VerifiersRolloutLoop` plays
each rollout as one verifiers episode of its row's task, every model call sampled by tandem through `Capture`."""

import asyncio
import contextlib
import contextvars
import os
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.contract.records import Rollout, TurnRecord
from tandem.generation.client import ServerError, ServerGone
from tandem.integrations.episodes import EpisodeFailures, completion_of
from tandem.integrations.verifiers import ENVIRONMENT, TASK, VerifiersHarness, library
from tandem.integrations.verifiers_harness import TOOL_RESULTS, close_connections
from tandem.rollout.loop import AsyncRolloutLoop

if TYPE_CHECKING:
    from aiohttp import web


@dataclass
class Captured:
    """One rollout's model calls: the context they sample in (the rollout's seeds and policy version), the turns, and
    the server's error if one failed (the scheduler's to answer, not the episode's)."""

    context: contextvars.Context
    turns: list[TurnRecord] = field(default_factory=list)
    error: BaseException | None = None


class Capture:
    """The worker's loopback `/inference/v1/generate`, where verifiers' training client samples. Each request names its
    rollout in `model` (the rollout's ModelContext), is sampled by `sample(prompt_ids)` with the trainer's settings
    (temperature, top-k / top-p, max_completion_length a turn; the request's own sampling parameters are not used),
    and is answered as vLLM did up to 0.31 (chat-style log-probs, `token: "token_id:N"`): the shape verifiers'
    client reads. A prompt past `max_model_len` is refused with vLLM's message, which verifiers reads as the end of
    the episode's context."""

    def __init__(self, sample, max_model_len: int | None):
        self.sample, self.max_model_len = sample, max_model_len
        self.rollouts: dict[str, Captured] = {}
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        runner = self.runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def open(self) -> str:
        """A new rollout's name (the model its requests ask for); its requests sample in the caller's context."""
        name = f"tandem-rollout-{uuid.uuid4().hex[:16]}"
        self.rollouts[name] = Captured(contextvars.copy_context())
        return name

    def close(self, name: str) -> Captured:
        return self.rollouts.pop(name)

    async def _generate(self, request):
        from aiohttp import web

        body = await request.json()
        rollout = self.rollouts.get(body.get("model"))
        if rollout is None:
            return error(web, 404, "NotFoundError", f"no rollout named {body.get('model')!r}", "model")
        prompt_ids = list(body["token_ids"])
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            return error(
                web,
                400,
                "BadRequestError",
                f"This model's maximum context length is {self.max_model_len} "
                f"tokens. However, your request has {len(prompt_ids)} input tokens.",
            )
        try:
            turn = await asyncio.create_task(self.sample(prompt_ids), context=rollout.context)
        except (ServerError, ServerGone) as exc:
            rollout.error = exc
            return error(web, 503, "ServiceUnavailableError", f"the generation server failed: {exc}")
        rollout.turns.append(turn)
        rollout.error = None  # a retry that got through
        content = [{"token": f"token_id:{t}", "logprob": p} for t, p in zip(turn.output_ids, turn.output_log_probs)]
        return web.json_response(
            {
                "request_id": f"generate-{uuid.uuid4().hex}",
                "prompt_token_ids": prompt_ids,
                "choices": [
                    {
                        "index": 0,
                        "token_ids": list(turn.output_ids),
                        "finish_reason": turn.finish_reason or "stop",
                        "logprobs": {"content": content},
                        "sampling_mask": turn.output_sampling_mask,
                    }
                ],
            }
        )

    async def _models(self, request):
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "max_model_len": self.max_model_len} for name in self.rollouts
                ],
            }
        )


def error(web, status: int, kind: str, message: str, param: str | None = None):
    """vLLM's error body."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


class VerifiersRolloutLoop(AsyncRolloutLoop):
    """`generate_one` plays one verifiers episode of the row's task; the other hooks are AsyncRolloutLoop's. A subclass
    may override `generate_one_turn` (each model call of the episode) or `compute_advantages` as usual."""

    rollout_reward_name = "verifiers_reward"

    async def setup(self) -> None:
        vf = library()
        # verifiers starts each tool server as `python -m <its module>`: the worker's import path makes a taskset
        # beside the training script importable there too, as it is here
        os.environ["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys(
                [path for path in sys.path if path]
                + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            )
        )
        self.stack = contextlib.AsyncExitStack()
        self.stack.push_async_callback(close_connections)
        harness = self.settings.harness
        assert isinstance(harness, VerifiersHarness)  # this loop is the VerifiersHarness's own
        self.envs = {key: vf.load_environment(config) for key, config in harness.configs.items()}
        self.tasks = {key: list(env.taskset) for key, env in self.envs.items()}
        for env in self.envs.values():
            await self.stack.enter_async_context(env.serving())  # shared tool servers start once
        self.capture = Capture(self.generate_one_turn, self.settings.max_model_len)
        await self.capture.start()
        self.stack.push_async_callback(self.capture.stop)
        self.client = vf.TrainClientConfig(
            base_url=self.capture.url, renderer_model_name=self.settings.tokenizer_path, renderer=self._renderer()
        )
        self.failures = EpisodeFailures("verifiers", self.record)

    async def close(self) -> None:
        await self.stack.aclose()

    def _renderer(self):
        """The renderer verifiers' client renders prompts with: the model's own chat template, its tool calls read as
        Hermes <tool_call> blocks (Qwen's format; `renderers`' parser for the tiny model and Qwen-family models)."""
        from renderers import DefaultRendererConfig

        return DefaultRendererConfig(tool_parser="qwen3")

    async def generate_one(self, prompt: list[dict], tools: list, group_id: int = 0) -> Rollout:
        """One episode of the row's task, every model call sampled by tandem. The server's errors are the scheduler's to
        answer (a group generated again); a failed episode is counted (env/failure_count) and left out of its group."""
        vf, row = library(), self.row()
        env, task = self.envs[row[ENVIRONMENT]], self.tasks[row[ENVIRONMENT]][row[TASK]]
        results: list = []
        TOOL_RESULTS.set(results)
        name = self.capture.open()
        context = vf.ModelContext(
            model=name,
            client=self.client,
            sampling=vf.SamplingConfig(
                temperature=self.config.temperature, max_tokens=self.config.max_completion_length
            ),
        )
        try:
            episode = await env.run_episode(task, context)
        finally:
            captured = self.capture.close(name)
        if captured.error is not None:
            raise captured.error
        traces = [trace for trace in episode.traces if trace.agent.trainable]
        if not episode.ok or len(traces) != 1:
            errors = [e.message for e in episode.errors] + [e.message for t in episode.traces for e in t.errors]
            self.failures.failed(errors[-1] if errors else f"the episode had {len(traces)} trainable traces, not one")
            return Rollout(completion=[], completion_ids=[], turns=[])
        self.failures.succeeded()
        self._record(traces[0], results)
        return Rollout(
            completion=completion_of([m.model_dump(exclude_none=True) for m in traces[0].messages]),
            completion_ids=[t for turn in captured.turns for t in turn.output_ids],
            turns=captured.turns,
            tool_call_count=len(results),
            tool_failure_count=sum(r.failed for r in results),
            reward=float(traces[0].reward) if traces[0].rewards else None,
        )

    def _record(self, trace, results: list) -> None:
        """The episode's metrics under the catalogue's names: its setup as env/reset_s, its scoring as env/reward_s,
        each of its rewards, its tool calls (each result when tandem's harness reported them), a context it outgrew."""
        generation = self._scheduler.generation
        self.record("env/reset_s", trace.timing.boot.duration + trace.timing.setup.duration)
        self.record("env/reward_s", trace.timing.scoring.duration)
        for name, reward in trace.rewards.items():
            if reward is not None:
                self.record(f"rewards/{name}/mean", float(reward.score))
        calls = [call for message in trace.messages if message.role == "assistant" for call in message.tool_calls or []]
        self.record("tools/call_frequency", len(calls))
        for result in results:
            generation.record_call(result)
        if trace.stop_condition == "context_length":  # the capture refused a prompt past max_model_len
            self.record("rollout/context_exhausted_count", 1)
