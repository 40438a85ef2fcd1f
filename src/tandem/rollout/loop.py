"""`AsyncRolloutLoop`: generates and scores rollouts in the worker process (spec: 롤아웃 루프 사용자 정의).

For each prompt, in dataset order from `dataset_start_index`: `filter_prompt`, then `num_generations`
rollouts (`generate_one`: the multi-turn tool loop, which calls `generate_one_turn` per sampling request;
with environments, each rollout's instance is reset first and scores it after), then the group is
scored (reward functions + environment / rollout rewards, summed), `compute_advantages` runs, groups
without reward variance are dropped, and the rest become samples on the trainer's queue. Subclass it
and override the hooks; set the subclass as the trainer's `loop_cls`.
"""

import asyncio
import contextvars
import inspect
import json
import math
import queue
import random
import sys
import time
import warnings
from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np

from tandem.generation.client import ControlClient, EngineDead, GenerationClient, ServerError
from tandem.metrics.window import check_values
from tandem.prompts import render_chat
from tandem.rollout import rewards as scoring
from tandem.channels import Channels
from tandem.rollout.environments import ROUTE_COLUMN, EnvironmentPool, environment_tools, factories_of, reset_prompt, route
from tandem.rollout.group_metrics import record_group
from tandem.rollout.pacing import METRICS_POLL_S, ConcurrencyCap, TokenAllowance
from tandem.rollout.prompt_stream import PromptStream
from tandem.rollout.reconcile import reconcile
from tandem.records import Rollout, RolloutGroup, Sample, TurnRecord
from tandem.rollout.settings import RolloutSettings
from tandem.rollout.tools import ToolResult, ToolRunner, Toolbox
from tandem.tool_calls import ToolCall, parse_reply, tool_schema

SCORE_QUEUE_MAXSIZE = 16
RENDER_CACHE_SIZE = 4096
REPORT_EVERY_S = 1.0
OUTAGE_SAY_S, OUTAGE_SAY_AGAIN_S = 10.0, 60.0
"""A server silent this long is said to be (and again as often while it lasts): its requests retry without a word."""
IDLE_POLL_S = 0.05
RECENT_GROUPS = 16
FAILED_IN_A_ROW = 5
"""Groups dropped in a row for failures (a reward function, or the server twice) before the worker stops the run."""
GROUP_VERSION: contextvars.ContextVar[int] = contextvars.ContextVar("group_version", default=0)
SEEDS: contextvars.ContextVar[random.Random] = contextvars.ContextVar("seeds", default=random.Random(0))
"""The sampling seeds of the rollout (or whole group) being generated: drawn from a generator seeded by the run's seed,
the prompt position and the rollout's index, so a group generated again (after a restart) is sampled alike."""


@dataclass
class Episode:
    """One rollout as the loop keeps it until scoring: the prompt it started from (an environment's reset may have
    changed it) and its environment's reward, if the environment owns one."""

    prompt: list[dict]
    rollout: Rollout
    env_reward: tuple[type, float] | None = None


class AsyncRolloutLoop:
    def __init__(self, settings: RolloutSettings, *, processing_class, channels: Channels):
        config = self.config = settings.config
        self.settings = settings
        self.model_name, self.adapter_name = settings.model_name, settings.adapter_name
        self.dataset = settings.dataset
        self.prompts = PromptStream(settings.dataset, start=settings.dataset_start_index,
                                    order_seed=(config.seed if config.data_seed is None else config.data_seed)
                                    if config.train_sampling_strategy == "random" else None)
        """The prompt of each position: the dataset's rows, epoch after epoch (rollout/prompt_stream.py)."""
        self.reward_funcs = list(settings.reward_funcs)
        self.tokenizer = processing_class
        self.eos_token_ids = list(settings.eos_token_ids)
        self.tools = list(settings.tools or [])
        """The trainer's tools; a rollout with an environment also gets that instance's public methods."""
        self.factories = factories_of(settings.environment_factory)
        self.environments = EnvironmentPool(self.factories)
        self.runner = ToolRunner(config.max_concurrent_rollouts, config.tool_call_timeout)
        self.schemas: dict[object, dict] = {}
        self.channels = channels
        self.base_url, self.api_key = settings.base_url, settings.api_key
        """The generation server the hooks may call too (e.g. a client of their own made in `setup`)."""
        self.client = GenerationClient(settings.base_url, api_key=settings.api_key, timeout_s=config.vllm_server_timeout,
                                       retry_for_s=config.vllm_server_timeout)
        """Requests wait up to vllm_server_timeout for a server that went away (restarting) to answer again."""
        self.control = ControlClient(settings.base_url, api_key=settings.api_key, timeout_s=30)
        self.allowance = TokenAllowance(config.max_staleness, settings.full_step_tokens)
        self.cap = ConcurrencyCap(config.max_concurrent_rollouts)
        """Rollouts allowed in flight; driven by the server's KV-cache usage once /metrics answers (see run)."""
        self.server_metrics = False
        self.max_model_len: int | None = None
        """The server's context length (from /v1/models): a conversation ends before its prompt would pass it."""
        self.last_preemptions: float | None = None
        self.flash = config.algorithm == "flash_reinforce"
        self.vocab_size = len(processing_class)
        self.sampling_masks = False
        """Whether requests go to /inference/v1/generate for each token's kept set (top-k / top-p; see run)."""
        self.top_logprobs = config.num_sampler_logprobs if config.score_centering and not self.flash else 0
        """How many of the sampler's most likely tokens to ask for at each position (score centering needs them)."""
        self.score_queue: asyncio.Queue = asyncio.Queue(maxsize=SCORE_QUEUE_MAXSIZE)
        self.slot = asyncio.Condition()
        self.failure: BaseException | None = None
        self.records: dict[str, list] = defaultdict(list)
        self.produced_tokens, self.in_flight_tokens = settings.queued_tokens, 0.0
        self.groups_in_flight = self.groups_finished = self.rollouts_in_flight = 0
        self.generated_tokens = 0
        self.kept_tokens: deque[int] = deque(maxlen=RECENT_GROUPS)
        """Tokens each recent kept group put on the queue, forks included: what a group really produces."""
        self.retries: deque[int] = deque()
        """Positions to generate again: groups the trainer dropped as stale, or whose LoRA version was unloaded."""
        self.unscored = 0
        """Groups generated and not yet scored."""
        self.generating: dict[asyncio.Task, tuple[int, int]] = {}
        """Groups being generated: their task -> (policy version they sample from, prompt position)."""
        self.failed_once: set[int] = set()
        """Positions whose group failed on the server once and is being generated again."""
        self.failed_in_a_row: dict[str, int] = defaultdict(int)
        """Groups dropped in a row, by cause: a reward function's name, or "the server"."""
        self.rendered: dict[str, list[int]] = {}

    # ---- hooks ------------------------------------------------------------------------------------
    def filter_prompt(self, row_index: int, row: dict, epoch: int) -> bool:
        """Whether to generate for this prompt (default: all). Rejected prompts count as consumed."""
        return True

    async def setup(self) -> None:
        """Create resources the other hooks need (runs on the loop's event loop before the first prompt)."""

    async def close(self) -> None:
        """Release what setup() created (runs when the loop ends, failures included)."""

    async def generate_one(self, prompt: list[dict], tools: list, group_id: int = 0) -> Rollout:
        """One rollout, the multi-turn tool loop: each turn renders the whole conversation, samples a reply and runs
        its tool calls in the order written. It ends on a reply without calls, at `max_tool_calling_iterations`
        (the rollout is trained all the same), or when the next prompt would leave no room in `max_model_len`."""
        toolbox = self.toolbox(tools)
        rollout = Rollout(completion=[], completion_ids=[], turns=[])
        cap, exhausted = self.config.max_tool_calling_iterations, False
        while True:
            prompt_ids = self.render(list(prompt) + rollout.completion, toolbox.schemas)
            if not self._room_after(prompt_ids) and not rollout.turns:
                raise ValueError(f"a rollout's first prompt renders to {len(prompt_ids)} tokens (the tools' schemas "
                                 f"included), leaving no room to generate in max_model_len={self.max_model_len}: "
                                 "shorten the prompt or the text reset() adds, offer fewer tools, or start the server "
                                 "with a larger --max-model-len")
            if not self._room_after(prompt_ids):
                self.record("rollout/context_exhausted_count", 1)
                break
            turn = await self.generate_one_turn(prompt_ids)
            rollout.turns.append(turn)
            rollout.completion_ids += turn.output_ids
            message, calls = self.reply(turn.output_ids, parse=bool(tools))
            rollout.completion.append(message)
            if not calls:
                break
            if cap is not None and len(rollout.turns) > cap:
                exhausted = True
                break
            self.record("tools/parallel_calls_mean", len(calls))
            for call in calls:  # in order: they may share an environment's state
                result = await self.runner.call(toolbox, call)
                self._record_call(result)
                rollout.tool_call_count += 1
                rollout.tool_failure_count += result.failed
                rollout.completion.append({"role": "tool", "name": result.name, "content": result.content})
        if tools:
            self.record("tools/call_frequency", rollout.tool_call_count)
            self.record("tools/loop_exhausted_frac", float(exhausted))
        return rollout

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One request to the server with the config's sampling settings."""
        [turn] = await self._sample(prompt_ids, n=1)
        return turn

    async def _sample(self, prompt_ids: list[int], n: int) -> list[TurnRecord]:
        """`n` samples of one prompt in one request; the server seeds child i with seed + i. With top-k / top-p /
        min-p the request goes to `/inference/v1/generate`, which also returns each token's kept set."""
        c = self.config
        max_tokens = c.max_completion_length  # per turn; never past the server's context
        if self.max_model_len is not None:
            max_tokens = max(1, min(max_tokens, self.max_model_len - len(prompt_ids)))
        if self.sampling_masks:
            # The server replays a sampling mask only with top_k > 0; top_k = vocabulary size truncates nothing.
            completions = await self.client.generate(prompt_ids, model=self._served_model(), sampling_params={
                "max_tokens": max_tokens, "n": n, "temperature": c.temperature, "top_p": c.top_p,
                "top_k": c.top_k or self.vocab_size, "min_p": c.min_p or 0.0, "repetition_penalty": c.repetition_penalty,
                "seed": SEEDS.get().getrandbits(62), "logprobs": self.top_logprobs, "stop_token_ids": self.eos_token_ids,
                "skip_special_tokens": False})
        else:
            completions = await self.client.complete(
                prompt_ids, model=self._served_model(), max_tokens=max_tokens, n=n, temperature=c.temperature,
                top_p=c.top_p, top_k=c.top_k, min_p=c.min_p or 0.0, repetition_penalty=c.repetition_penalty,
                seed=SEEDS.get().getrandbits(62), logprobs=self.top_logprobs, stop_token_ids=self.eos_token_ids,
            )
        self.generated_tokens += sum(len(x.token_ids) for x in completions)
        return [TurnRecord(prompt_ids=list(prompt_ids), output_ids=x.token_ids, output_log_probs=x.logprobs,
                           output_sampler_logprobs=sampler_top(x.top_logprobs, self.top_logprobs),
                           output_sampling_mask=x.sampling_mask, finish_reason=x.finish_reason) for x in completions]

    def _served_model(self) -> str:
        return self.adapter_name.format(version=GROUP_VERSION.get()) if self.adapter_name else self.model_name

    async def _server_returns_sampling_masks(self) -> bool:
        """Top-k / top-p need each token's kept set to renormalise the trainer's log-probs over it. Without
        `--return-sampling-mask` (and `--enable-scale-out`) the server cannot send it: warn, and train on the
        full-vocabulary distribution, whose ratios are then biased by the mass the sampler cut off."""
        info = await self.control.server_info()
        config = info.get("vllm_config")
        model_config = config.get("model_config", {}) if isinstance(config, dict) else {}
        if model_config.get("return_sampling_mask"):
            return True
        warnings.warn("top_k / top_p / min_p are set but the server does not return sampling masks: start it with "
                      "--return-sampling-mask --enable-scale-out --logprobs-mode processed_logprobs. Training goes on "
                      "with full-vocabulary log-probs, so every importance ratio is biased by the truncated mass.", stacklevel=2)
        return False

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards standardised within the group (unscored rollouts get 0)."""
        return scoring.group_advantages(group.rewards)

    # ---- helpers ----------------------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation (with the tools' schemas) and the generation prompt; renderings are cached,
        so a group's rollouts share the first one."""
        key = json.dumps([messages, tools], sort_keys=True, default=str)
        if key not in self.rendered:
            if len(self.rendered) > RENDER_CACHE_SIZE:
                self.rendered.clear()
            self.rendered[key] = render_chat(self.tokenizer, messages, tools=tools or None,
                                             chat_template_kwargs=self.config.chat_template_kwargs)
        return self.rendered[key]

    def reply(self, output_ids: list[int], parse: bool) -> tuple[dict, list[ToolCall]]:
        """A sampled reply as an assistant message, and its tool calls. With tools they are parsed out of the text
        (their markers may be special tokens, so those are kept in decoding); without, the text is the reply."""
        ids = list(output_ids)
        while ids and ids[-1] in self.eos_token_ids:
            ids.pop()
        if not parse:
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}, []
        parsed = parse_reply(self.tokenizer.decode(ids, skip_special_tokens=False), self.tokenizer)
        return parsed.message(), parsed.tool_calls

    def toolbox(self, tools: list) -> Toolbox:
        """The rollout's tools by name with their schemas (made once per function, whatever instance it is bound to)."""
        for tool in tools:
            key = getattr(tool, "__func__", tool)
            if key not in self.schemas:
                self.schemas[key] = tool_schema(tool)
        return Toolbox({tool.__name__: tool for tool in tools}, [self.schemas[getattr(t, "__func__", t)] for t in tools])

    def _room_after(self, prompt_ids: list[int]) -> bool:
        return self.max_model_len is None or len(prompt_ids) < self.max_model_len

    def _record_call(self, result: ToolResult) -> None:
        self.record("tools/failure_frequency", float(result.failed))
        self.record("tools/unknown_name_count", int(result.status == "unknown"))
        if not result.invoked:
            return
        self.record("tools/latency_s", result.latency_s)
        self.record(f"tools/{result.name}/latency_s", result.latency_s)
        self.record(f"tools/{result.name}/call_count", 1)
        self.record(f"tools/{result.name}/failure_count", int(result.failed))

    def record(self, name: str, *values) -> None:
        """Add values of metric `name` to the trainer's next log (reduced by the name's window rule)."""
        check_values(name, values)
        self.records[name].extend(values)

    def emit(self, kind: str, payload) -> None:
        self.channels.out.put((kind, payload))

    # ---- failures ---------------------------------------------------------------------------------
    def _watch(self, task: asyncio.Task) -> asyncio.Task:
        """A failed group or scorer task must stop the worker, not vanish."""
        task.add_done_callback(self._note_failure)
        return task

    def _note_failure(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ---- the loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        background = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._report()),
                      asyncio.create_task(self._say_outages())]
        try:
            await self.setup()
            self.sampling_masks = self.config.uses_truncated_sampling and await self._server_returns_sampling_masks()
            await self._init_cap()
            background.append(asyncio.create_task(self._poll_server()))
            background.append(self._watch(asyncio.create_task(self._scorer())))
            background.append(self._watch(asyncio.create_task(self._cancel_doomed())))
            background.append(self._watch(asyncio.create_task(self._evaluations())))
            await self._dispatch_all()
            self._flush_records()
        finally:
            for task in background:
                task.cancel()
            self.runner.close()
            await self.close()
            await self.client.close()
            await self.control.close()

    async def _dispatch_all(self) -> None:
        """Start a group for each prompt position, as the allowance permits, then for each position the trainer sends
        back to be generated again (a group it dropped as stale). Sends "end" whenever nothing is left to do, and
        returns only when told to stop (or when the endless stream of a max_steps run is stopped)."""
        groups: set[asyncio.Task] = set()
        position, end = self.settings.dataset_start_index, self.settings.num_positions
        accepted_in_epoch = group_id = 0
        ended = False
        while not self.channels.stop.is_set():
            self._raise_failure()
            self._collect_retries()
            self.prompts.forget_below(self.channels.watermark.value)
            if self.retries:
                retry = self.retries.popleft()
                task = await self._start_group(self.prompts.at(retry).row, retry, group_id)
            elif end is None or position < end:
                prompt = self.prompts.at(position)
                accepted_in_epoch = 0 if prompt.epoch_start else accepted_in_epoch
                task = None
                if position in self.settings.received:  # the trainer holds it already (a resumed run, a restarted worker)
                    accepted_in_epoch += 1
                elif self.filter_prompt(prompt.index, prompt.row, prompt.epoch):
                    accepted_in_epoch += 1
                    task = await self._start_group(prompt.row, position, group_id)
                else:
                    self.emit("skip", position)
                position += 1
                if self.dataset is not None and self.prompts.at(position).epoch_start and accepted_in_epoch == 0:
                    raise ValueError(f"filter_prompt rejected every prompt of epoch {prompt.epoch}: no sample can reach "
                                     "the trainer")
            else:  # everything dispatched: wait for the last groups, then for retries
                if not ended and not groups and not self.unscored:
                    self.emit("end", None)
                    ended = True
                await asyncio.sleep(IDLE_POLL_S)
                continue
            if task is not None:
                group_id, ended = group_id + 1, False
                groups.add(task)
                task.add_done_callback(groups.discard)
            await asyncio.sleep(0)  # let started groups run before deciding on the next prompt
        self._raise_failure()

    def _collect_retries(self) -> None:
        while True:
            try:
                self.retries.append(self.channels.retry.get_nowait())
            except queue.Empty:
                return


    async def _start_group(self, row: dict, position: int, group_id: int) -> asyncio.Task:
        """Wait for room in the allowance, reserve the group's tokens and start it."""
        reservation = self._reservation(row.get("prompt"))
        await self._wait_for_allowance(reservation)
        self.groups_in_flight += 1  # counted now, not when the task first runs
        self.in_flight_tokens += reservation
        return self._watch(asyncio.create_task(self._run_group(row, position, group_id, reservation)))

    def _reservation(self, prompt: list[dict] | None) -> float:
        """The tokens a group may put on the queue: single-turn, at most G × (prompt + max_completion_length);
        multi-turn rollouts and forks can produce more, so never less than the largest recent kept group."""
        single_turn = self.config.num_generations * ((len(self.render(prompt)) if prompt else 0) + self.config.max_completion_length)
        return max(single_turn, max(self.kept_tokens, default=0))

    def _queued_tokens(self) -> float:
        return self.produced_tokens - self.channels.consumed_tokens.value

    async def _wait_for_allowance(self, reservation: float) -> None:
        start = time.monotonic()
        while not self.allowance.may_start(self._queued_tokens(), self.in_flight_tokens, reservation,
                                           self.channels.tokens_per_step.value, self.groups_in_flight, self.groups_finished):
            self._raise_failure()
            await asyncio.sleep(0.01)  # the trainer frees tokens from another process: polled
        self.record("rollout/backpressure_s", time.monotonic() - start)
        limit = self.allowance.limit(self.channels.tokens_per_step.value)
        used = self._queued_tokens() + self.in_flight_tokens + reservation
        if self.groups_finished:  # the allowance binds once the first group has finished
            self.record("rollout/allowance_used_max", used / limit)

    async def _run_group(self, row: dict, position: int, group_id: int, reservation: float) -> None:
        version = self.channels.model_version.value  # read as it runs: its first request goes out under this version
        GROUP_VERSION.set(version)  # this group's requests (its own task) sample from this policy version
        self.generating[asyncio.current_task()] = (version, position)  # only a running group is cancelled: its finally runs
        try:
            episodes = await self._episodes(row, position, group_id)
        except EngineDead:
            raise  # no retry helps: the worker stops and says so
        except ServerError as exc:
            # LoRA: the trainer unloads versions older than max_staleness allows; a group that started on one
            # can no longer be sampled, and its samples would be dropped as stale anyway: generate it again.
            if self.adapter_name and exc.status == 404 and version < self.channels.model_version.value:
                self.record("rollout/stale_adapter_count", 1)
                self.retries.append(position)
            elif position not in self.failed_once:  # one failed request: the group is generated again, once
                self.failed_once.add(position)
                self.retries.append(position)
            else:
                self.failed_once.discard(position)
                self._drop_failed("the server", position, f"a request of the group failed, and again when the group was "
                                  f"generated anew: {exc}")
            return
        finally:
            self.groups_in_flight -= 1
            self.in_flight_tokens -= reservation
            self.generating.pop(asyncio.current_task(), None)
        group = self._group(row, self.prompts.at(position).index, group_id, version, episodes, self._reconciled(episodes))
        block = time.monotonic()
        self.unscored += 1
        await self.score_queue.put((group, [e.rollout for e in episodes], position))
        self.record("rollout/score_block_s", time.monotonic() - block)

    async def _episodes(self, row: dict, position: int | str, group_id: int) -> list[Episode]:
        """The group's rollouts: one request with n = num_generations when the hooks allow it, else one rollout each."""
        SEEDS.set(self._seeds(position))
        if self._single_request_groups():
            return await self._whole_group(row["prompt"])
        return await self._rollouts(row, position, group_id)

    def _seeds(self, position: int | str, rollout: int | None = None) -> random.Random:
        """The seeds of a group's requests (or of one of its rollouts): from the run's seed and the prompt position
        (an evaluation's positions are named 'eval:STEP:ROW')."""
        return random.Random(f"{self.config.seed}:{position}" + ("" if rollout is None else f":{rollout}"))

    async def _rollouts(self, row: dict, position: int | str, group_id: int) -> list[Episode]:
        """The group's rollouts, concurrently; when one fails the others are cancelled (their slots and environments
        go back at once)."""
        tasks = [asyncio.ensure_future(self._one_rollout(row, group_id, self._seeds(position, index)))
                 for index in range(self.config.num_generations)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _single_request_groups(self) -> bool:
        """Single-turn rollouts with the default hooks: the whole group is one request with n = num_generations
        (one prefill and one HTTP round trip instead of G). Tools, environments or a subclass overriding a
        generation hook keep one call per rollout."""
        cls = type(self)
        return (cls.generate_one is AsyncRolloutLoop.generate_one and cls.generate_one_turn is AsyncRolloutLoop.generate_one_turn
                and not self.tools and not self.factories)

    async def _whole_group(self, prompt) -> list[Episode]:
        g = self.config.num_generations
        await self._acquire(g)
        start = time.monotonic()
        try:
            turns = await self._sample(self.render(prompt), n=g)
        finally:
            await self._release(g, time.monotonic() - start)
        return [Episode(prompt, Rollout(completion=[self.reply(t.output_ids, parse=False)[0]], completion_ids=list(t.output_ids),
                                        turns=[t])) for t in turns]

    async def _one_rollout(self, row: dict, group_id: int, seeds: random.Random | None = None) -> Episode:
        """One rollout of the row's prompt (its requests seeded from `seeds`); with environments, on an instance reset
        from the row, which scores it (get_reward) before going back to the pool."""
        if seeds is not None:
            SEEDS.set(seeds)  # this rollout's own task
        if not self.factories:
            return Episode(row["prompt"], await self._generate(row["prompt"], self.tools, group_id))
        name = route(row, self.factories)
        env = self.environments.take(name) or await self._environment_call(f"environment_factory {name or ''}".strip(),
                                                                           self.factories[name])
        try:
            start = time.monotonic()
            text = await self._environment_call(f"{type(env).__name__}.reset()", env.reset,
                                                **{k: v for k, v in row.items() if k != ROUTE_COLUMN})
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
            return await self.generate_one(prompt, tools, group_id)
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
        except asyncio.TimeoutError:
            raise TimeoutError(f"{label} did not return within tool_call_timeout={self.config.tool_call_timeout:g}s") from None

    async def _acquire(self, slots: int) -> None:
        async with self.slot:
            await self.slot.wait_for(lambda: self.rollouts_in_flight == 0 or self.rollouts_in_flight + slots <= self.cap.value)
            self.rollouts_in_flight += slots

    async def _release(self, slots: int, duration_s: float) -> None:
        self.record("rollout/duration_s", *[duration_s] * slots)
        for _ in range(slots):
            self.cap.rollout_finished()
        async with self.slot:
            self.rollouts_in_flight -= slots
            self.slot.notify_all()

    def _reconciled(self, episodes: list[Episode]) -> list[list]:
        """Each rollout's turns as training sequences (forks where a re-rendered turn drifted), recorded."""
        sequences = []
        for episode in episodes:
            turns = episode.rollout.turns
            seqs, stats = reconcile(turns)
            sequences.append(seqs)
            self.record("rollout/samples_per_rollout", len(seqs))
            self.record("rollout/turns_mean", len(turns))
            self.record("rollout/turns_max", len(turns))
            if stats.transitions:
                self.record("rollout/fork_frac", *([1.0] * stats.forks + [0.0] * (stats.transitions - stats.forks)))
                self.record("rollout/drift_tokens_mean", *stats.drift_tokens)
                self.record("rollout/drift_tokens_max", *stats.drift_tokens)
        return sequences

    def _group(self, row: dict, row_index: int, group_id: int, version: int, episodes: list[Episode],
               sequences: list[list]) -> RolloutGroup:
        g = len(episodes)
        extra = {k: [v] * g for k, v in row.items() if k not in ("prompt", ROUTE_COLUMN)}
        rollouts = [e.rollout for e in episodes]
        return RolloutGroup(
            prompts=[e.prompt for e in episodes], reward_kwargs=extra, completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts], completions_sequences=sequences,
            tool_call_counts=[r.tool_call_count for r in rollouts], tool_failure_counts=[r.tool_failure_count for r in rollouts],
            model_version=version, group_id=group_id, row_index=row_index,
            env_rewards=[e.env_reward for e in episodes], rollout_rewards=[r.reward for r in rollouts], queued_at=time.monotonic(),
        )

    # ---- evaluation -----------------------------------------------------------------------------------
    async def _evaluations(self) -> None:
        """Start each evaluation the trainer asks for, (its step, the policy version the server serves now), at once:
        the trainer waits for it, so it must not wait behind the allowance as training groups do."""
        while True:
            try:
                step, version = self.channels.evaluate.get_nowait()
            except queue.Empty:
                await asyncio.sleep(IDLE_POLL_S)
                continue
            self._watch(asyncio.create_task(self._evaluate(step, version)))

    async def _evaluate(self, step: int, version: int) -> None:
        """Generate every eval prompt under `version` and score it with the reward functions; send the eval/* records.
        Nothing is trained, and the allowance is untouched: evaluation is not paced with training."""
        GROUP_VERSION.set(version)
        records: dict[str, list] = defaultdict(list)
        outcomes = await asyncio.gather(*[self._evaluate_row(dict(row), index, step, version, records)
                                          for index, row in enumerate(self.settings.eval_dataset)])
        records["eval/failed_count"].append(outcomes.count(False))
        self.emit("eval", (step, dict(records)))

    async def _evaluate_row(self, row: dict, index: int, step: int, version: int, records: dict) -> bool:
        """One eval prompt's group, recorded as eval/<the group's metric>; False when it failed (twice, as in training)."""
        try:
            episodes = await self._episodes(row, f"eval:{step}:{index}", group_id=-1)
            group = self._group(row, index, -1, version, episodes, sequences=[])
            columns = await self._reward(group)
        except EngineDead:
            raise
        except (ServerError, scoring.RewardFailed) as exc:
            print(f"tandem: evaluation at step {step}: eval_dataset row {index} failed ({exc})", file=sys.stderr)
            return False
        record_group(lambda name, *values: records[f"eval/{name}"].extend(values), group, columns,
                     scoring.keeps_signal(group.rewards), self.eos_token_ids, log_completions=False)
        return True

    async def _scorer(self) -> None:
        while True:
            group, rollouts, position = await self.score_queue.get()
            try:
                await self._score(group, rollouts, position)
            finally:
                self.unscored -= 1
                self.score_queue.task_done()

    async def _score(self, group: RolloutGroup, rollouts: list[Rollout], position: int) -> None:
        """Reward the group, compute its advantages, and send its samples to the trainer (or drop it)."""
        self.record("rollout/score_wait_s", time.monotonic() - group.queued_at)
        start = time.monotonic()
        self.failed_once.discard(position)
        try:
            columns = await self._reward(group)
        except scoring.RewardFailed as failed:
            self._drop_failed(f"reward function {failed.name!r}", position, f"it failed on the group, and again when "
                              f"called once more: {failed.traceback.splitlines()[-1]}", failed.traceback)
            return
        self.failed_in_a_row.clear()
        advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
        if advantages.shape != (len(rollouts),):
            raise ValueError(f"compute_advantages returned shape {advantages.shape}; it must return one advantage per "
                             f"rollout ({len(rollouts)})")
        self.record("rollout/score_s", time.monotonic() - start)
        self.groups_finished += 1
        # GRPO learns only from groups whose rewards differ; FlashREINFORCE's baseline is the batch, not the group.
        kept = bool(np.isfinite(group.rewards).any()) if self.flash else scoring.keeps_signal(group.rewards)
        record_group(self.record, group, columns, kept, self.eos_token_ids, self.config.log_completions)
        samples = self._samples(group, rollouts, advantages, position) if kept else []
        self._flush_records()  # the group's metrics travel ahead of its samples
        if not samples:
            self.emit("skip", position)
            return
        tokens = sum(s.num_tokens for s in samples)
        self.produced_tokens += tokens
        self.kept_tokens.append(tokens)
        self.emit("samples", samples)

    async def _reward(self, group: RolloutGroup) -> dict[str, np.ndarray]:
        """Every reward source of the group, summed into `group.rewards`; returns the reward functions' columns."""
        g = len(group.completions)
        kwargs = {"prompts": group.prompts, "completions": group.completions, "completion_ids": group.completions_ids,
                  **group.reward_kwargs}
        columns = (await scoring.score(self.reward_funcs, kwargs, g, self.config.reward_timeout)
                   | scoring.environment_columns(group.env_rewards))
        sources = list(columns.values())
        if any(r is not None for r in group.rollout_rewards):
            sources.append(np.array([math.nan if r is None else float(r) for r in group.rollout_rewards]))
        group.rewards = scoring.total_reward(sources, g)
        return columns

    def _drop_failed(self, cause: str, position: int, reason: str, details: str = "") -> None:
        """Drop a group that failed (counted in rollout/failed_count), say so and go on; FAILED_IN_A_ROW groups in a
        row failing for the same cause stop the run with the reason and `details` (a traceback)."""
        self.failed_in_a_row[cause] += 1
        if self.failed_in_a_row[cause] >= FAILED_IN_A_ROW:
            raise RuntimeError(f"{FAILED_IN_A_ROW} groups in a row were dropped because {cause} failed; the last time "
                               f"{reason}\n{details}".rstrip())
        print(f"tandem: dropped the group of prompt position {position}: {cause} failed ({reason})", file=sys.stderr)
        self.record("rollout/failed_count", 1)
        self._flush_records()
        self.emit("skip", position)

    @staticmethod
    def _samples(group: RolloutGroup, rollouts: list[Rollout], advantages: np.ndarray, position: int) -> list[Sample]:
        """The group's training samples: each rollout's sequences, with the rollout's advantage and reward."""
        group_samples = sum(len(seqs) for seqs in group.completions_sequences)
        return [Sample(input_ids=s.input_ids, trained=s.trained, logprobs=s.logprobs, advantage=float(a),
                       model_version=group.model_version, group_id=group.group_id, position=position,
                       group_samples=group_samples, rollout_id=rollout.rollout_id, created_at=time.time(),
                       sampler_top=s.sampler_top, sampling_mask=s.sampling_mask, reward=float(r))
                for rollout, seqs, a, r in zip(rollouts, group.completions_sequences, advantages, group.rewards)
                for s in seqs]

    # ---- background tasks -------------------------------------------------------------------------
    async def _init_cap(self) -> None:
        try:
            self.max_model_len = await self.control.max_model_len()
            metrics = await self.control.metrics()
        except Exception:  # a server without /metrics: the cap stays at max_concurrent_rollouts
            return
        self.cap = ConcurrencyCap(self.config.max_concurrent_rollouts, metrics.kv_capacity_tokens, self.max_model_len)
        self.server_metrics = True

    async def _poll_server(self) -> None:
        while self.server_metrics:
            await asyncio.sleep(METRICS_POLL_S)
            try:
                metrics = await self.control.metrics()
            except Exception:
                continue
            async with self.slot:
                self.cap.update(metrics.kv_cache_usage, metrics.waiting)
                self.slot.notify_all()
            self.record("rollout/vllm_kv_cache_usage_frac", metrics.kv_cache_usage)
            self.record("rollout/vllm_running_requests", metrics.running)
            self.record("rollout/vllm_queued_requests", metrics.waiting)
            previous = metrics.preemptions if self.last_preemptions is None else self.last_preemptions
            self.record("rollout/vllm_preemption_count", metrics.preemptions - previous)
            self.last_preemptions = metrics.preemptions

    async def _cancel_doomed(self) -> None:
        """Cancel the groups still generating under a policy more than max_staleness versions old: they can only arrive
        stale, to be dropped. Cancelling closes their requests (the server aborts a request whose client left), and the
        position is generated again under the current policy (rollout/cancelled_stale_count)."""
        while True:
            await asyncio.sleep(IDLE_POLL_S)
            oldest = self.channels.model_version.value - self.config.max_staleness
            for task, (version, position) in list(self.generating.items()):
                if version < oldest:
                    del self.generating[task]
                    task.cancel()
                    self.retries.append(position)
                    self.record("rollout/cancelled_stale_count", 1)

    async def _heartbeat(self) -> None:
        while True:
            self.channels.heartbeat.value = time.time()
            await asyncio.sleep(0.5)

    async def _report(self) -> None:
        last, last_tokens, last_retries = time.monotonic(), 0, 0
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            now = time.monotonic()
            self.record("rollout/generated_tokens_per_s", (self.generated_tokens - last_tokens, now - last))
            self.record("rollout/concurrency", self.rollouts_in_flight)
            self.record("rollout/concurrency_cap", self.cap.value)
            self.record("rollout/score_queue_size", self.score_queue.qsize())
            self.record("rollout/vllm_retry_count", self.client.retries - last_retries)
            last, last_tokens, last_retries = now, self.generated_tokens, self.client.retries
            self._flush_records()

    async def _say_outages(self) -> None:
        """Tell the trainer's user when the server stops answering at all (its requests are retried meanwhile, for
        up to vllm_server_timeout): OUTAGE_SAY_S into the outage, then every OUTAGE_SAY_AGAIN_S while it lasts."""
        said = None
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            down, now = self.client.down_since, time.monotonic()
            if down is None:
                said = None
            elif now - down >= OUTAGE_SAY_S and (said is None or now - said >= OUTAGE_SAY_AGAIN_S):
                said = now
                self.emit("say", f"the generation server {self.base_url} has not answered for {now - down:.0f}s "
                                 f"({self.client.down_reason}); waiting for it up to vllm_server_timeout="
                                 f"{self.config.vllm_server_timeout:g}s (its log says why it stopped)")

    def _flush_records(self) -> None:
        if self.records:
            records, self.records = dict(self.records), defaultdict(list)
            self.emit("metrics", records)


def sampler_top(entries: list[dict[int, float]] | None, k: int) -> list[dict[int, float]] | None:
    """The sampler's top-k {token: log-prob} at each position. The server lists the sampled token first, then the
    top-k, merged: k + 1 entries mean the sampled token is not among the top k, so it is dropped."""
    if not k or entries is None:
        return None
    return [dict(list(e.items())[1:]) if len(e) > k else e for e in entries]

