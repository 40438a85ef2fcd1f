"""How a group's rollouts are generated in the worker: the requests to the server (one with n = num_generations for
a single-turn group under the default hooks, else the loop's `generate_one` per rollout), the concurrency slots, the
sampling seeds, environment instances and tools, and the training sequences each rollout's turns become. The
`RolloutScheduler` asks it for a group; the loop's helpers (`render`, `toolbox`) and default hooks use it too.
"""

import asyncio
import contextvars
import inspect
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

from tandem.chat.prompts import render_chat
from tandem.chat.tool_calls import tool_schema
from tandem.contract.algorithms import algorithm_of
from tandem.contract.channels import ServedVersions, versions_at
from tandem.contract.records import Rollout, RolloutGroup, TurnRecord
from tandem.generation.client import Completion, GenerationClient
from tandem.rollout.environments import (
    ROUTE_COLUMN,
    EnvironmentPool,
    environment_tools,
    factories_of,
    reset_prompt,
    route,
)
from tandem.rollout.pacing import ConcurrencyCap
from tandem.rollout.reconcile import reconcile
from tandem.rollout.settings import RolloutSettings
from tandem.rollout.tools import Toolbox, ToolResult, ToolRunner

RENDER_CACHE_SIZE = 4096
GROUP_VERSION: contextvars.ContextVar[int] = contextvars.ContextVar("group_version", default=0)
"""The policy version the group being generated samples from (its requests name that LoRA adapter version)."""
ROW: contextvars.ContextVar[dict] = contextvars.ContextVar("row", default={})  # noqa: B039 (read, never changed)
"""The dataset row of the rollout being generated: the hooks get its prompt, `AsyncRolloutLoop.row()` the rest."""
GROUP_SEED: contextvars.ContextVar[int] = contextvars.ContextVar("group_seed", default=0)
"""A seed of the group being generated, from the run's seed and its prompt index: the same for its rollouts and for
the group generated again (`AsyncRolloutLoop.group_seed()`: an environment draws the group's task from it)."""
SEEDS: contextvars.ContextVar[random.Random] = contextvars.ContextVar(
    "seeds",
    default=random.Random(0),  # noqa: B039 (outside a group, e.g. a direct call in a test: one shared stream)
)
"""The sampling seeds of the rollout (or whole group) being generated: drawn from a generator seeded by the run's seed,
the prompt index and the rollout's index, so a group generated again (after a restart) is sampled alike."""


@dataclass
class Episode:
    """One rollout as the scheduler keeps it until scoring: the prompt it started from (an environment's reset may
    have changed it) and its environment's reward, if the environment owns one."""

    prompt: list[dict]
    rollout: Rollout
    env_reward: tuple[type, float] | None = None


class Generation:
    def __init__(
        self, loop, settings: RolloutSettings, processing_class, whole_groups: bool, record, served: ServedVersions
    ):
        """`loop`: the user's AsyncRolloutLoop (its `generate_one` and `reply`); `whole_groups`: its generation hooks are
        the defaults (loop.py's `samples_whole_groups`); `record(name, *values)`: the scheduler's metric records;
        `served`: when each policy version began to be served (the trainer's syncs write it)."""
        config = self.config = settings.config
        self.loop, self.record = loop, record
        self.model_name, self.adapter_name = settings.model_name, settings.adapter_name
        self.tokenizer = processing_class
        self.eos_token_ids = list(settings.eos_token_ids)
        self.tools = list(settings.tools or [])
        """The trainer's tools; a rollout with an environment also gets that instance's public methods."""
        self.factories = factories_of(settings.environment_factory)
        self.environments = EnvironmentPool(self.factories)
        self.whole_groups = whole_groups and not self.tools and not self.factories
        """A single-turn group is one request with n = num_generations: one prefill and one round trip instead of G."""
        self.runner = ToolRunner(config.max_concurrent_rollouts, config.tool_call_timeout)
        self.schemas: dict[object, dict] = {}
        self.rendered: dict[str, list[int]] = {}
        self.client = GenerationClient(
            settings.base_url,
            api_key=settings.api_key,
            timeout_s=config.vllm_server_timeout,
            retry_for_s=config.vllm_server_timeout,
        )
        """Requests wait up to vllm_server_timeout for a server that went away (restarting) to answer again."""
        self.cap = ConcurrencyCap(config.max_concurrent_rollouts)
        """Rollouts allowed in flight; driven by the server's KV-cache usage once /metrics answers (the scheduler's)."""
        self.slot = asyncio.Condition()
        self.rollouts_in_flight = self.generated_tokens = 0
        self.max_model_len = settings.max_model_len
        """The server's context length: a conversation ends before its prompt would pass it."""
        self.sampling_masks = False
        """Whether requests go to /inference/v1/generate for each token's kept set (top-k / top-p)."""
        self.top_logprobs = algorithm_of(config).sampler_top_logprobs(config)
        """How many of the sampler's most likely tokens to ask for at each position (score centering needs them)."""
        labels = settings.server is not None and settings.server.labels_token_versions
        self.labels_versions = labels and not self.adapter_name
        """Whether to ask which weights sampled each token (a LoRA request names its adapter's version instead)."""
        self.served = served
        self.streams_versions = config.in_flight_weight_updates and not self.labels_versions and not self.adapter_name
        """A server that cannot say which weights sampled each token (vLLM) streams them instead, each token labelled
        with the version served when it arrived (`ServedVersions`)."""

    async def sample(self, prompt_ids: list[int], n: int) -> list[TurnRecord]:
        """`n` samples of one prompt in one request; the server seeds child i with seed + i. With top-k / top-p /
        min-p the request goes to `/inference/v1/generate`, which also returns each token's kept set."""
        model = self._served_model()
        settings = self._sampling_settings(len(prompt_ids), n)
        if self.sampling_masks:
            sampling_params = {**settings, "skip_special_tokens": False}
            completions = await self.client.generate(prompt_ids, model=model, sampling_params=sampling_params)
        else:
            completions = await self.client.complete(
                prompt_ids,
                model=model,
                **settings,
                return_weight_versions=self.labels_versions,
                stream=self.streams_versions,
            )
        self.generated_tokens += sum(len(x.token_ids) for x in completions)
        version = GROUP_VERSION.get()
        timeline = self.served.timeline() if self.streams_versions else []
        return [
            TurnRecord(
                prompt_ids=list(prompt_ids),
                output_ids=x.token_ids,
                output_log_probs=x.logprobs,
                output_sampler_logprobs=top_entries(x.top_logprobs, self.top_logprobs),
                output_sampling_mask=x.sampling_mask,
                finish_reason=x.finish_reason,
                output_token_versions=self._token_versions(x, version, timeline),
            )
            for x in completions
        ]

    def _token_versions(self, completion: Completion, version: int, timeline: list) -> list[int] | None:
        """The policy version of each token: the server's labels, or by when it arrived; None: the request's."""
        if self.labels_versions:
            return completion.token_versions(version)
        if completion.arrivals is not None:
            return versions_at(timeline, completion.arrivals, floor=version)
        return None

    def _sampling_settings(self, prompt_tokens: int, n: int) -> dict[str, Any]:
        """A request's sampling settings, as both endpoints name them: the config's, a seed drawn from the rollout's
        seeds, and at most max_completion_length new tokens (per turn; never past the server's context)."""
        c = self.config
        max_tokens = c.max_completion_length
        if self.max_model_len is not None:
            max_tokens = max(1, min(max_tokens, self.max_model_len - prompt_tokens))
        return {
            "max_tokens": max_tokens,
            "n": n,
            "temperature": c.temperature,
            "top_p": c.top_p,
            "top_k": c.top_k,
            "min_p": c.min_p or 0.0,
            "repetition_penalty": c.repetition_penalty,
            "seed": SEEDS.get().getrandbits(62),
            "logprobs": self.top_logprobs,
            "stop_token_ids": self.eos_token_ids,
        }

    def _served_model(self) -> str:
        return self.adapter_name.format(version=GROUP_VERSION.get()) if self.adapter_name else self.model_name

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation (with the tools' schemas) and the generation prompt; renderings are cached,
        so a group's rollouts share the first one."""
        key = json.dumps([messages, tools], sort_keys=True, default=str)
        if key not in self.rendered:
            if len(self.rendered) > RENDER_CACHE_SIZE:
                self.rendered.clear()
            template_kwargs = self.config.chat_template_kwargs
            assert not isinstance(template_kwargs, str)  # the config parsed its JSON string
            self.rendered[key] = render_chat(
                self.tokenizer, messages, tools=tools or None, chat_template_kwargs=template_kwargs
            )
        return self.rendered[key]

    def toolbox(self, tools: list) -> Toolbox:
        """The rollout's tools by name with their schemas (made once per function, whatever instance it is bound to)."""
        for tool in tools:
            key = getattr(tool, "__func__", tool)
            if key not in self.schemas:
                self.schemas[key] = tool_schema(tool)
        return Toolbox(
            {tool.__name__: tool for tool in tools}, [self.schemas[getattr(t, "__func__", t)] for t in tools]
        )

    def room_after(self, prompt_ids: list[int]) -> bool:
        """Whether a prompt leaves room to generate in the server's context."""
        return self.max_model_len is None or len(prompt_ids) < self.max_model_len

    def record_call(self, result: ToolResult) -> None:
        """One tool call's metrics."""
        self.record("tools/failure_frequency", float(result.failed))
        self.record("tools/unknown_name_count", int(result.status == "unknown"))
        if not result.invoked:
            return
        self.record("tools/latency_s", result.latency_s)
        self.record(f"tools/{result.name}/latency_s", result.latency_s)
        self.record(f"tools/{result.name}/call_count", 1)
        self.record(f"tools/{result.name}/failure_count", int(result.failed))

    async def episodes(self, row: dict, prompt_index: int | str, group_id: int) -> list[Episode]:
        """The group's rollouts: one request with n = num_generations when the hooks allow it, else one rollout each."""
        SEEDS.set(self._seeds(prompt_index))
        ROW.set(row)
        GROUP_SEED.set(random.Random(f"{self.config.seed}:{prompt_index}:group").getrandbits(31))
        if self.whole_groups:
            return await self._whole_group(row["prompt"])
        episodes = await self._rollouts(row, prompt_index, group_id)
        return [episode for episode in episodes if episode.rollout.turns]  # one that sampled nothing (another
        # library's episode that failed): nothing to train or score, left out of its group

    def _seeds(self, prompt_index: int | str, rollout: int | None = None) -> random.Random:
        """The seeds of a group's requests (or of one of its rollouts): from the run's seed and the prompt index
        (an evaluation's prompt indices are named 'eval:STEP:ROW')."""
        return random.Random(f"{self.config.seed}:{prompt_index}" + ("" if rollout is None else f":{rollout}"))

    async def _rollouts(self, row: dict, prompt_index: int | str, group_id: int) -> list[Episode]:
        """The group's rollouts, concurrently; when one fails the others are cancelled (their slots and environments
        go back at once)."""
        tasks = [
            asyncio.ensure_future(self.one_rollout(row, group_id, self._seeds(prompt_index, index)))
            for index in range(self.config.num_generations)
        ]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _whole_group(self, prompt) -> list[Episode]:
        g = self.config.num_generations
        await self._acquire(g)
        start = time.monotonic()
        try:
            turns = await self.sample(self.render(prompt), n=g)
        finally:
            await self._release(g, time.monotonic() - start)
        return [
            Episode(
                prompt,
                Rollout(
                    completion=[self.loop.reply(t.output_ids, parse=False)[0]],
                    completion_ids=list(t.output_ids),
                    turns=[t],
                ),
            )
            for t in turns
        ]

    async def one_rollout(self, row: dict, group_id: int, seeds: random.Random | None = None) -> Episode:
        """One rollout of the row's prompt (its requests seeded from `seeds`); with environments, on an instance reset
        from the row, which scores it (get_reward) before going back to the pool."""
        if seeds is not None:
            SEEDS.set(seeds)  # this rollout's own task
        if not self.factories:  # no prompt: a harness's sessions make their own tasks
            prompt = row.get("prompt") or []
            return Episode(prompt, await self._generate(prompt, self.tools, group_id))
        name = route(row, self.factories)
        env = self.environments.take(name) or await self._environment_call(
            f"environment_factory {name or ''}".strip(), self.factories[name]
        )
        try:
            start = time.monotonic()
            text = await self._environment_call(
                f"{type(env).__name__}.reset()", env.reset, **{k: v for k, v in row.items() if k != ROUTE_COLUMN}
            )
            self.record("env/reset_s", time.monotonic() - start)
            prompt = reset_prompt(row.get("prompt"), text)
            rollout = await self._generate(prompt, self.tools + environment_tools(env), group_id)
            return Episode(prompt, rollout, await self._environment_reward(env))
        finally:
            self.environments.give_back(name, env)

    async def _generate(self, prompt: list[dict], tools: list, group_id: int) -> Rollout:
        await self._acquire(1)
        start = time.monotonic()
        try:
            return await self.loop.generate_one(prompt, tools, group_id)
        finally:
            await self._release(1, time.monotonic() - start)

    async def _environment_reward(self, env) -> tuple[type, float] | None:
        """(the environment's class, its get_reward()) when it owns a reward; sync get_reward runs on the tool threads."""
        get_reward = getattr(env, "get_reward", None)
        if get_reward is None:
            return None
        start = time.monotonic()
        value = await self._environment_call(f"{type(env).__name__}.get_reward()", get_reward)
        self.record("env/reward_s", time.monotonic() - start)
        return type(env), math.nan if value is None else float(value)

    async def _environment_call(self, label: str, func, **kwargs):
        """An environment's own call (made, reset, scored): awaited when async, on the tool threads when sync, and at most
        `tool_call_timeout` seconds — a hung environment stops the run with its name instead of holding it forever."""
        call = func(**kwargs) if inspect.iscoroutinefunction(func) else self.runner.run_in_pool(func, **kwargs)
        try:
            return await asyncio.wait_for(call, self.config.tool_call_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{label} did not return within tool_call_timeout={self.config.tool_call_timeout:g}s"
            ) from None

    async def _acquire(self, slots: int) -> None:
        async with self.slot:
            await self.slot.wait_for(
                lambda: self.rollouts_in_flight == 0 or self.rollouts_in_flight + slots <= self.cap.value
            )
            self.rollouts_in_flight += slots

    async def _release(self, slots: int, duration_s: float) -> None:
        self.record("rollout/duration_s", *[duration_s] * slots)
        for _ in range(slots):
            self.cap.rollout_finished()
        async with self.slot:
            self.rollouts_in_flight -= slots
            self.slot.notify_all()

    def reconciled(self, episodes: list[Episode], version: int) -> list[list]:
        """Each rollout's turns as training sequences (forks where a re-rendered turn drifted), recorded; `version`:
        the group's, for tokens whose turn does not say which weights sampled them."""
        sequences = []
        for episode in episodes:
            turns = episode.rollout.turns
            seqs, stats = reconcile(turns, version)
            sequences.append(seqs)
            self.record("rollout/samples_per_rollout", len(seqs))
            self.record("rollout/turns_mean", len(turns))
            self.record("rollout/turns_max", len(turns))
            if stats.transitions:
                self.record("rollout/fork_frac", *([1.0] * stats.forks + [0.0] * (stats.transitions - stats.forks)))
                self.record("rollout/drift_tokens_mean", *stats.drift_tokens)
                self.record("rollout/drift_tokens_max", *stats.drift_tokens)
        return sequences

    def group(
        self, row: dict, row_index: int, group_id: int, version: int, episodes: list[Episode], sequences: list[list]
    ) -> RolloutGroup:
        g = len(episodes)
        extra = {k: [v] * g for k, v in row.items() if k not in ("prompt", ROUTE_COLUMN)}
        rollouts = [e.rollout for e in episodes]
        return RolloutGroup(
            prompts=[e.prompt for e in episodes],
            reward_kwargs=extra,
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=sequences,
            tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts],
            model_version=version,
            group_id=group_id,
            row_index=row_index,
            env_rewards=[e.env_reward for e in episodes],
            rollout_rewards=[r.reward for r in rollouts],
            queued_at=time.monotonic(),
        )


def top_entries(entries: list[dict[int, float]] | None, k: int) -> list[dict[int, float]] | None:
    """The sampler's top-k {token: log-prob} at each position. The server lists the sampled token first, then the
    top-k, merged: k + 1 entries mean the sampled token is not among the top k, so it is dropped."""
    if not k or entries is None:
        return None
    return [dict(list(e.items())[1:]) if len(e) > k else e for e in entries]
