"""`RolloutScheduler`: the machinery under the user's `AsyncRolloutLoop` in the worker process: which prompt
prompt indices start when (the token allowance, the concurrency cap), retries and stale cancellation, evaluation,
scoring, the failure policy, the heartbeat and the reports to the trainer. It calls the loop's hooks and nothing
else of it; a user's subclass sees none of this.
"""

import asyncio
import math
import queue
import sys
import time
import warnings
from collections import defaultdict, deque

import numpy as np

from tandem.contract.algorithms import algorithm_of
from tandem.contract.channels import Channels
from tandem.contract.records import Rollout, RolloutGroup, Sample
from tandem.generation.client import ControlClient, EngineDead, ServerError
from tandem.generation.server_facts import read_facts
from tandem.metrics.window import check_values
from tandem.rollout import scoring
from tandem.rollout.generation import GROUP_VERSION, Generation
from tandem.rollout.group_metrics import group_stds, record_group
from tandem.rollout.pacing import Room, TokenAllowance
from tandem.rollout.prompt_stream import PromptStream
from tandem.rollout.server_watch import REPORT_EVERY_S, ServerWatch
from tandem.rollout.settings import RolloutSettings

SCORE_QUEUE_MAXSIZE = 16
IDLE_POLL_S = 0.05
FAILED_IN_A_ROW = 5
"""Groups dropped in a row for failures (a reward function, or the server twice) before the worker stops the run."""


class RolloutScheduler:
    def __init__(self, loop, settings: RolloutSettings, processing_class, channels: Channels, whole_groups: bool):
        """`loop`: the user's AsyncRolloutLoop, whose hooks run here. `whole_groups`: its generation hooks are the
        defaults (loop.py's `samples_whole_groups`)."""
        self.loop, self.settings, self.channels = loop, settings, channels
        config = self.config = settings.config
        self.generation = Generation(loop, settings, processing_class, whole_groups, self.record, channels.served)
        self.prompts = PromptStream(
            settings.dataset,
            start=settings.dataset_start_index,
            order_seed=(config.seed if config.data_seed is None else config.data_seed)
            if config.train_sampling_strategy == "random"
            else None,
        )
        """The prompt of each prompt index: the dataset's rows, epoch after epoch (rollout/prompt_stream.py)."""
        self.dataset, self.reward_funcs = settings.dataset, list(settings.reward_funcs)
        self.eos_token_ids, self.adapter_name = list(settings.eos_token_ids), settings.adapter_name
        self.control = ControlClient(settings.base_url, api_key=settings.api_key, timeout_s=30)
        self.server = ServerWatch(self.control, self.generation, config, self.record, self.emit)
        """The server's load and outages, watched while the worker runs (server_watch.py)."""
        self.staleness = config.staleness_policy
        self.room = Room(TokenAllowance(self.staleness, settings.full_step_tokens), settings.queued_tokens, channels)
        """The allowance's books: what groups in flight reserve, what is queued, and the wait for room (pacing.py)."""
        self.algorithm = algorithm_of(config)
        self.score_queue: asyncio.Queue = asyncio.Queue(maxsize=SCORE_QUEUE_MAXSIZE)
        self.failure: BaseException | None = None
        self.records: dict[str, list] = defaultdict(list)
        self.retries: deque[int] = deque()
        """Prompt indices to generate again: groups the trainer dropped as stale, or whose LoRA version was unloaded."""
        self.unscored = 0
        """Groups generated and not yet scored."""
        self.generating: dict[asyncio.Task, tuple[int, int]] = {}
        """Groups being generated: their task -> (policy version they sample from, prompt index)."""
        self.failed_once: set[int] = set()
        """Prompt indices whose group failed on the server once and is being generated again."""
        self.failed_in_a_row: dict[str, int] = defaultdict(int)
        """Groups dropped in a row, by cause: a reward function's name, or "the server"."""

    # ---- setup ------------------------------------------------------------------------------------
    async def _server_returns_sampling_masks(self) -> bool:
        """Top-k / top-p need each token's kept set to renormalise the trainer's log-probs over it. Without
        `--return-sampling-mask` (and `--enable-scale-out`) the server cannot send it: warn, and train on the
        full-vocabulary distribution, whose ratios are then biased by the mass the sampler cut off."""
        server = self.settings.server or await read_facts(self.control)
        if server.returns_sampling_masks:
            return True
        warnings.warn(
            "top_k / top_p / min_p are set but the server does not return sampling masks: start it with "
            "--return-sampling-mask --enable-scale-out --logprobs-mode processed_logprobs. Training goes on "
            "with full-vocabulary log-probs, so every importance ratio is biased by the truncated mass.",
            stacklevel=2,
        )
        return False

    # ---- records and messages ----------------------------------------------------------------------
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
        background = [
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._report()),
            asyncio.create_task(self.server.say_outages()),
        ]
        self.channels.room.listen(self.room.changed)
        try:
            await self.loop.setup()
            self.generation.sampling_masks = (
                self.config.uses_truncated_sampling and await self._server_returns_sampling_masks()
            )
            await self.server.init_cap()
            background.append(asyncio.create_task(self.server.poll()))
            background.append(self._watch(asyncio.create_task(self._scorer())))
            if self.staleness.cancels_running_groups:
                background.append(self._watch(asyncio.create_task(self._cancel_doomed())))
            background.append(self._watch(asyncio.create_task(self._evaluations())))
            await self._dispatch_all()
            self._flush_records()
        finally:
            self.channels.room.stop_listening()
            for task in background:
                task.cancel()
            self.generation.runner.close()
            await self.loop.close()
            await self.generation.client.close()
            await self.control.close()

    async def _dispatch_all(self) -> None:
        """Start a group for each prompt index, as the allowance permits, then for each prompt index the trainer sends
        back to be generated again (a group it dropped as stale). Sends "end" whenever nothing is left to do, and
        returns only when told to stop (or when the endless stream of a max_steps run is stopped)."""
        groups: set[asyncio.Task] = set()
        prompt_index, end = self.settings.dataset_start_index, self.settings.num_prompts
        accepted_in_epoch = group_id = 0
        ended = False
        while not self.channels.stop.is_set():
            self._raise_failure()
            self._collect_retries()
            self.prompts.forget_below(self.channels.watermark.value)
            if self.retries:
                retry = self.retries.popleft()
                task = await self._start_group(self.prompts.at(retry).row, retry, group_id)
            elif end is None or prompt_index < end:
                prompt = self.prompts.at(prompt_index)
                accepted_in_epoch = 0 if prompt.epoch_start else accepted_in_epoch
                task = None
                if (
                    prompt_index in self.settings.received
                ):  # the trainer holds it already (a resumed run, a restarted worker)
                    accepted_in_epoch += 1
                elif self.loop.filter_prompt(prompt.row_index, prompt.row, prompt.epoch):
                    accepted_in_epoch += 1
                    task = await self._start_group(prompt.row, prompt_index, group_id)
                else:
                    self.emit("skip", prompt_index)
                prompt_index += 1
                if self.dataset is not None and self.prompts.at(prompt_index).epoch_start and accepted_in_epoch == 0:
                    raise ValueError(
                        f"filter_prompt rejected every prompt of epoch {prompt.epoch}: no sample can reach the trainer"
                    )
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

    async def _start_group(self, row: dict, prompt_index: int, group_id: int) -> asyncio.Task:
        """Wait for room in the allowance, reserve the group's tokens and start it."""
        prompt = row.get("prompt")
        single_turn = self.config.num_generations * (
            (len(self.generation.render(prompt)) if prompt else 0) + self.config.max_completion_length
        )
        reservation = self.room.reservation(single_turn)
        waited, used = await self.room.wait(reservation, self._raise_failure)
        self.record("rollout/backpressure_s", waited)
        if used is not None:
            self.record("rollout/allowance_used_max", used)
        return self._watch(asyncio.create_task(self._run_group(row, prompt_index, group_id, reservation)))

    async def _run_group(self, row: dict, prompt_index: int, group_id: int, reservation: float) -> None:
        version = self.channels.model_version.value  # read as it runs: its first request goes out under this version
        GROUP_VERSION.set(version)  # this group's requests (its own task) sample from this policy version
        task = asyncio.current_task()
        assert task is not None, "a group runs as a task of its own"
        self.generating[task] = (version, prompt_index)  # only a running group is cancelled: its finally runs
        try:
            episodes = await self.generation.episodes(row, prompt_index, group_id)
        except EngineDead:
            raise  # no retry helps: the worker stops and says so
        except ServerError as exc:
            # LoRA: the trainer unloads the versions only stale groups use; a group that started on one can no
            # longer be sampled, and its samples would be dropped as stale anyway: generate it again.
            stale_adapter = self.staleness.adapter_may_be_gone(self.channels.model_version.value, version)
            if self.adapter_name and exc.status == 404 and stale_adapter:
                self.record("rollout/stale_adapter_count", 1)
                self.retries.append(prompt_index)
            elif prompt_index not in self.failed_once:  # one failed request: the group is generated again, once
                self.failed_once.add(prompt_index)
                self.retries.append(prompt_index)
            else:
                self.failed_once.discard(prompt_index)
                self._drop_failed(
                    "the server",
                    prompt_index,
                    f"a request of the group failed, and again when the group was generated anew: {exc}",
                )
            return
        finally:
            self.room.group_ended(reservation)
            self.generating.pop(task, None)
        if not episodes:  # each of its episodes failed (another library's: counted where they failed)
            self.emit("skip", prompt_index)
            return
        group = self.generation.group(
            row,
            self.prompts.at(prompt_index).row_index,
            group_id,
            version,
            episodes,
            self.generation.reconciled(episodes, version),
        )
        block = time.monotonic()
        self.unscored += 1
        await self.score_queue.put((group, [e.rollout for e in episodes], prompt_index))
        self.record("rollout/score_block_s", time.monotonic() - block)

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
        rows = self.settings.eval_dataset
        assert rows is not None, "the trainer asks for evaluations only with an eval_dataset"
        outcomes = await asyncio.gather(
            *[self._evaluate_row(dict(row), index, step, version, records) for index, row in enumerate(rows)]
        )
        records["eval/failed_count"].append(outcomes.count(False))
        self.emit("eval", (step, dict(records)))

    async def _evaluate_row(self, row: dict, index: int, step: int, version: int, records: dict) -> bool:
        """One eval prompt's group, recorded as eval/<the group's metric>; False when it failed (twice, as in training)."""
        try:
            episodes = await self.generation.episodes(row, f"eval:{step}:{index}", group_id=-1)
            if not episodes:
                return False
            group = self.generation.group(row, index, -1, version, episodes, sequences=[])
            columns, rewards = await self._reward(group)
        except EngineDead:
            raise
        except (ServerError, scoring.RewardFailed) as exc:
            print(f"tandem: evaluation at step {step}: eval_dataset row {index} failed ({exc})", file=sys.stderr)
            return False
        record_group(
            lambda name, *values: records[f"eval/{name}"].extend(values),
            group,
            columns,
            self.algorithm.keeps(rewards.tolist()),
            self.eos_token_ids,
            log_completions=False,
        )
        return True

    async def _scorer(self) -> None:
        while True:
            group, rollouts, prompt_index = await self.score_queue.get()
            try:
                await self._score(group, rollouts, prompt_index)
            finally:
                self.unscored -= 1
                self.score_queue.task_done()

    async def _score(self, group: RolloutGroup, rollouts: list[Rollout], prompt_index: int) -> None:
        """Reward the group, compute its advantages, and send its samples to the trainer (or drop it)."""
        self.record("rollout/score_wait_s", time.monotonic() - group.queued_at)
        start = time.monotonic()
        self.failed_once.discard(prompt_index)
        try:
            columns, _ = await self._reward(group)
        except scoring.RewardFailed as failed:
            self._drop_failed(
                f"reward function {failed.name!r}",
                prompt_index,
                f"it failed on the group, and again when called once more: {failed.traceback.splitlines()[-1]}",
                failed.traceback,
            )
            return
        self.failed_in_a_row.clear()
        advantages = np.asarray(self.loop.compute_advantages(group), dtype=np.float64)
        if advantages.shape != (len(rollouts),):
            raise ValueError(
                f"compute_advantages returned shape {advantages.shape}; it must return one advantage per "
                f"rollout ({len(rollouts)})"
            )
        self.record("rollout/score_s", time.monotonic() - start)
        rewards = group.rewards  # as compute_advantages left them (a hook may set them anew)
        assert rewards is not None, "scored above"
        kept = self.algorithm.keeps(rewards.tolist())
        record_group(self.record, group, columns, kept, self.eos_token_ids, self.config.log_completions)
        stds = group_stds(rewards, columns)
        samples = training_samples(group, rollouts, advantages, rewards, prompt_index, stds) if kept else []
        self._flush_records()  # the group's metrics travel ahead of its samples
        self.room.group_scored(sum(s.num_tokens for s in samples) if samples else None)
        if samples:
            self.emit("samples", samples)
        else:
            self.emit("skip", prompt_index)

    async def _reward(self, group: RolloutGroup) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Every reward source of the group, summed into `group.rewards`; returns each source's column and the sums."""
        g = len(group.completions)
        kwargs = {
            "prompts": group.prompts,
            "completions": group.completions,
            "completion_ids": group.completions_ids,
            **group.reward_kwargs,
        }
        columns = await scoring.score(
            self.reward_funcs, kwargs, g, self.config.reward_timeout
        ) | scoring.environment_columns(group.env_rewards)
        if any(r is not None for r in group.rollout_rewards):
            columns[self.loop.rollout_reward_name] = np.array(
                [math.nan if r is None else float(r) for r in group.rollout_rewards]
            )
        group.rewards = rewards = scoring.total_reward(list(columns.values()), g)
        return columns, rewards

    def _drop_failed(self, cause: str, prompt_index: int, reason: str, details: str = "") -> None:
        """Drop a group that failed (counted in rollout/failed_count), say so and go on; FAILED_IN_A_ROW groups in a
        row failing for the same cause stop the run with the reason and `details` (a traceback)."""
        self.failed_in_a_row[cause] += 1
        if self.failed_in_a_row[cause] >= FAILED_IN_A_ROW:
            raise RuntimeError(
                f"{FAILED_IN_A_ROW} groups in a row were dropped because {cause} failed; the last time "
                f"{reason}\n{details}".rstrip()
            )
        print(f"tandem: dropped the group of prompt {prompt_index}: {cause} failed ({reason})", file=sys.stderr)
        self.record("rollout/failed_count", 1)
        self._flush_records()
        self.emit("skip", prompt_index)

    async def _cancel_doomed(self) -> None:
        """Cancel the groups still generating under a policy more than max_staleness versions old: they can only arrive
        stale, to be dropped. Cancelling closes their requests (the server aborts a request whose client left), and the
        prompt index is generated again under the current policy (rollout/cancelled_stale_count)."""
        while True:
            await asyncio.sleep(IDLE_POLL_S)
            current = self.channels.model_version.value
            for task, (version, prompt_index) in list(self.generating.items()):
                if self.staleness.is_stale(current, version):
                    del self.generating[task]
                    task.cancel()
                    self.retries.append(prompt_index)
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
            self.record("rollout/generated_tokens_per_s", (self.generation.generated_tokens - last_tokens, now - last))
            self.record("rollout/concurrency", self.generation.rollouts_in_flight)
            self.record("rollout/concurrency_cap", self.generation.cap.value)
            self.record("rollout/score_queue_size", self.score_queue.qsize())
            self.record("rollout/vllm_retry_count", self.generation.client.retries - last_retries)
            last, last_tokens, last_retries = now, self.generation.generated_tokens, self.generation.client.retries
            self._flush_records()

    def _flush_records(self) -> None:
        if self.records:
            records, self.records = dict(self.records), defaultdict(list)
            self.emit("metrics", records)


def training_samples(
    group: RolloutGroup,
    rollouts: list[Rollout],
    advantages: np.ndarray,
    rewards: np.ndarray,
    prompt_index: int,
    stds: tuple[float, dict[str, float]],
) -> list[Sample]:
    """The group's training samples: each rollout's sequences, with the rollout's advantage and reward, and the
    group's reward stds (metrics averaged over trained samples)."""
    group_samples = sum(len(seqs) for seqs in group.completions_sequences)
    samples = [
        Sample(
            input_ids=s.input_ids,
            trained=s.trained,
            behavior_log_probs=s.behavior_log_probs,
            advantage=float(a),
            model_version=group.model_version,
            group_id=group.group_id,
            prompt_index=prompt_index,
            group_samples=group_samples,
            rollout_id=rollout.rollout_id,
            created_at=time.time(),
            sampler_logprobs=s.sampler_logprobs,
            sampling_mask=s.sampling_mask,
            reward=float(r),
            group_reward_std=stds[0],
            source_group_stds=stds[1],
            token_versions=s.token_versions,
        )
        for rollout, seqs, a, r in zip(rollouts, group.completions_sequences, advantages, rewards)
        for s in seqs
    ]
    versions = [version for sample in samples for version in sample.trained_versions()]
    for sample in samples:  # the group is judged as one (staleness.StalenessPolicy.version_of)
        sample.group_token_version = sum(versions) / len(versions) if versions else None
    return samples
