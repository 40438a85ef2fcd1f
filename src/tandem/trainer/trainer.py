"""`AsyncGRPOTrainer`: trains on rollouts while the worker keeps generating them.

`train()` starts a `Runtime` (runtime/runtime.py: the generation server, the rollout worker, the queue between them
and the weight sync), then runs one loop, read top to bottom in `_loop`: take the step's rows from the runtime,
forward and backward them through the objective, step the optimizer, sync the new weights, log, maybe checkpoint —
until `max_steps` or the last epoch. The trainer calls the runtime; the runtime never calls the trainer.
"""

import gc
import sys
import time
import warnings
from collections.abc import Sized
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import AsyncGRPOConfig, mapping
from tandem.contract.agents import Harness
from tandem.metrics.window import MetricWindow
from tandem.model import distributed
from tandem.packing import PackedRow
from tandem.runtime.rollout_inputs import check_sendable, loop_class
from tandem.runtime.runtime import Runtime, RuntimeSpec, unless_preempted
from tandem.trainer import checkpoint
from tandem.trainer.batch_size import check_auto_find_batch_size, halved
from tandem.trainer.callbacks import CallbackMethods, Callbacks, callback_handler
from tandem.trainer.checkpoint import TrainerState
from tandem.trainer.evaluation import evaluate
from tandem.trainer.flops import StepFlops
from tandem.trainer.hub import HubUploader
from tandem.trainer.model import (
    autocast_dtype,
    check_precision,
    enable_checkpointing,
    eos_ids,
    instrument,
    load_policy,
    served_dtype,
)
from tandem.trainer.objectives import make_objective
from tandem.trainer.optimization import make_optimizer, make_scheduler, step_optimizer
from tandem.trainer.row_passes import RowPasses, StepLoss
from tandem.trainer.run_log import RunLog
from tandem.trainer.run_setup import (
    attention_kernel,
    check_inputs,
    empty_device_cache,
    rollout_chat_template,
    router_coefficient,
    run_log_level,
    seed_run,
    set_log_level,
    warn_train_arguments,
)
from tandem.trainer.saving import restore, save_model, uploader
from tandem.trainer.step_metrics import StepTimes, input_tokens, record_memory, record_samples
from tandem.trainer.trial import trial_args


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    metrics: dict


class AsyncGRPOTrainer(CallbackMethods):
    loop_cls: type | None = None
    """The rollout loop the worker runs: set an AsyncRolloutLoop subclass on a trainer subclass (None: AsyncRolloutLoop)."""
    runtime_cls: type = Runtime
    """What serves the trainer its rows and takes its weights: the generation server, the rollout worker and the
    queue (`Runtime`); `tandem.testing.scripted` gives a test rows of its own instead."""
    harness: Harness | None = None
    """Another library's episodes the worker plays instead of the tool loop: HarnessAsyncGRPOTrainer's OpenEnv harness,
    or a verifiers environment passed as train_dataset (its loop class runs it)."""
    halved_budget: int | None = None
    """auto_find_batch_size: the token budget a step out of memory was packed again in, for the runtime to keep."""
    hub: HubUploader | None = None
    """push_to_hub's uploads (rank 0), started with the first one."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        eval_dataset=None,
    ):
        self.args = args = args or AsyncGRPOConfig()
        inputs = check_inputs(args, train_dataset, eval_dataset, reward_funcs, tools, environment_factory, self.harness)
        self.dataset, self.eval_dataset, self.reward_funcs = inputs.dataset, inputs.eval_dataset, inputs.reward_funcs
        self.tools, self.environment_factory, self.harness = inputs.tools, inputs.environment_factory, inputs.harness
        self.ranks = distributed.join(args.ddp_timeout)  # this process's place among the torchrun ranks (or one of one)
        self.lora = peft_config is not None
        self.model_name, self.model, self.layout, self.tokenizer = load_policy(
            model, args, peft_config, processing_class, self.ranks
        )
        """`layout`: the rows this model trains on, tree-packed or padded for models a tree row would change."""
        self.rollout_template = rollout_chat_template(self.tokenizer, inputs, args)
        """A training-safe chat template the worker renders rollouts with, when the model's is not prefix-preserving."""
        self.optimizer_given = optimizers[0] is not None
        self.optimizer, self.scheduler = optimizers
        self.device = next(self.model.parameters()).device  # the scaler below: fp16's gradient scaler, or None
        self.scaler = check_precision(args, self.device, self.ranks.several, next(self.model.parameters()).dtype)
        self.kernel = attention_kernel(args, self.device)
        instrument(self.model, args, self.ranks.several)
        self.passes = RowPasses(
            self.model, self.kernel, args.temperature, autocast_dtype(args, self.device), self.ranks
        )
        """This rank's passes of a step's rows through the model, and their clock (trainer/row_passes.py)."""
        self.flops = StepFlops.of(self.model, self.device, self.passes.autocast is not None, self.ranks.world_size)
        """The `perf/*_mfu` metrics' meter; None on CPU or an unknown GPU (trainer/flops.py)."""
        self.output_dir = Path(args.output_dir)
        self.compute_dtype = str(self.passes.autocast or next(self.model.parameters()).dtype).removeprefix("torch.")
        """The dtype of the trainer's forward: the rounding it expects between its log-probs and the server's."""
        handler = callback_handler(callbacks or [], self.model, self.tokenizer, self.optimizer, self.scheduler)
        self.callbacks = Callbacks(handler, args, TrainerState(), self.ranks)
        """transformers' TrainerCallback objects, called with (args, state, control) at each event of the loop, and
        the flags they set (should_log, should_save, should_training_stop), read by the loop."""
        self._configure(args)
        self.callbacks.event("on_init_end")

    def _configure(self, args: AsyncGRPOConfig, trial: bool = False) -> None:
        """Build what comes from the settings training reads: the optimizer and its schedule (unless given), the
        objective, fresh counters and log, and the runtime. Done again for each hyperparameter-search trial, as
        transformers' train() does; the model trains on from where it is (transformers reloads it only through
        model_init, which tandem does not take)."""
        self.args = self.callbacks.args = args
        self.state = self.callbacks.state = TrainerState()
        """transformers' TrainerState, filled in place (from a checkpoint when resuming): callbacks hold it."""
        self.run_log = RunLog(args, self.epoch_size, self.agent)
        """The metric window, each step's loss and each log's mean reward (trainer/run_log.py)."""
        if not self.optimizer_given:
            self.optimizer = make_optimizer(self.model, args)
        if self.scheduler is None or (trial and not self.optimizer_given):  # a given schedule is kept at first
            self.scheduler = make_scheduler(self.optimizer, args)
        self.callbacks.handler.optimizer, self.callbacks.handler.lr_scheduler = self.optimizer, self.scheduler
        self.passes.temperature = args.temperature
        self.objective = make_objective(args, router_coefficient(args, self.model))
        self.runtime = self.runtime_cls(self._runtime_spec())
        """The generation server, the rollout worker, the queue and the weight sync: started by train()."""

    # ---- public ---------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None) -> TrainOutput:
        """Train until max_steps or the end of the data. Under torchrun every rank calls it; rank 0 owns the server,
        the rollout worker and the logs, and sends every rank its rows. `trial`, as in transformers, is a dict of
        config fields set for this run (a hyperparameter search's trial, trainer/trial.py). `ignore_keys_for_eval`
        (model outputs left out of evaluation) does not apply here."""
        if trial is not None:
            self._configure(trial_args(self.args, trial, optimizer_given=self.optimizer_given), trial=True)
        warn_train_arguments(ignore_keys_for_eval, self.device)
        check_sendable(self.reward_funcs, self.loop_cls)
        seed_run(self.args)
        set_log_level(run_log_level(self.args, self.ranks.main, distributed.local_main()))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        checkpoint.check_save_on_each_node(self.args.save_on_each_node, self.ranks.world_size)
        check_auto_find_batch_size(self.args.auto_find_batch_size, self.ranks)
        resume = checkpoint.resolve(resume_from_checkpoint, self.output_dir)
        point = restore(resume, self.model, self.optimizer, self.scheduler, self.callbacks, self.args)
        self.callbacks.event("on_train_begin")
        if self.args.gradient_checkpointing:
            enable_checkpointing(
                self.model, mapping(self.args.gradient_checkpointing_kwargs) or {"use_reentrant": False}
            )
        self.model.train()
        with self.runtime as runtime:
            runtime.start(self.state.model_version, point, resumed=resume is not None)
            gc.collect()  # what earlier work left as garbage goes now, not into the frozen heap
            gc.freeze()  # the model, the imports and the data live as long as the run: no collection need walk them
            try:
                if self.args.eval_on_start and self.eval_dataset is not None and self.ranks.main:
                    self._evaluate(runtime)  # the policy the server serves now: the starting one
                output = self._loop(runtime)
            finally:
                gc.unfreeze()  # a notebook's or a sweep's next run must be able to free this one
        if self.hub is not None:  # the checkpoints' uploads still running or waiting to be tried again
            self.hub.wait()
        if runtime.preempted.is_set():
            print(
                f"tandem: stopped on SIGTERM after a checkpoint at step {self.state.step}; resume with "
                "train(resume_from_checkpoint=True), or tandem train with --resume_from_checkpoint true",
                file=sys.stderr,
            )
        self.callbacks.event("on_train_end")
        return output

    @property
    def reward_history(self) -> list[float]:
        """Each logged window's mean reward, in order."""
        return self.run_log.reward_history

    @property
    def agent(self) -> bool:
        """The rollouts call tools or play environments."""
        return bool(self.tools) or self.environment_factory is not None or self.harness is not None

    @property
    def epoch_size(self) -> int | None:
        """The prompts in one pass over the dataset; None for a stream or environments' own tasks."""
        return len(self.dataset) if isinstance(self.dataset, Sized) else None

    def training_step(self, micro_batches: list[list[PackedRow]]) -> StepLoss:
        """Forward and backward this rank's rows of one optimizer step through the objective (gradients accumulate).
        `micro_batches` are every rank's rows: rank r trains row r of each (one process trains them all); a rank
        with no row in a micro-batch forwards its first one with weight 0, so every rank runs the same passes. With
        auto_find_batch_size, a step out of device memory runs again in rows of half the tokens (batch_size.py)."""
        while True:
            records = MetricWindow()
            try:
                step = self.passes.forward_backward(micro_batches, self.objective, self.scaler, records)
                break
            except torch.OutOfMemoryError as error:
                if not self.args.auto_find_batch_size:
                    raise
                micro_batches, self.halved_budget = halved(
                    micro_batches, self.layout, self.args.per_device_train_batch_size, error
                )
            # out of the except block, whose traceback held the failed passes' activations: now they can be freed
            self.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            empty_device_cache(self.device)
        self.run_log.window.extend(records.take())
        return step

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False, merged: bool = False) -> None:
        """The model (or the LoRA adapter) and tokenizer as a folder transformers, vLLM and `tandem serve` load.
        `merged=True` writes a LoRA model as `tandem export` does: its adapter merged into a fresh copy of the base
        model, read again from the base's folder into host memory (one more copy of the base there, none on the
        GPU), so the trained model is left as it is; a full-weight model is saved as it is. Under torchrun every rank
        calls it; rank 0 merges. `_internal_call` is transformers' Trainer argument, taken so that code written for it
        runs: there it only decides a push to the Hub, which tandem's save_model never makes (push_to_hub does)."""
        target = Path(output_dir or self.args.output_dir)
        save_model(self.model, self.tokenizer, target, self.ranks, merge_adapter=merged and self.lora)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        **kwargs,
    ) -> None:
        """Save the model (or the LoRA adapter) and tokenizer to output_dir and upload that folder, its checkpoints left
        out, to hub_model_id (created if missing). `token` / `revision` stand in for hub_token / hub_revision. Under
        torchrun every rank calls it; rank 0 uploads."""
        if kwargs:
            warnings.warn(
                f"push_to_hub: {sorted(kwargs)} are model-card fields in transformers; tandem writes no model "
                "card, so they are left out",
                stacklevel=2,
            )
        self.save_model(self.args.output_dir)
        if self.ranks.main:
            self._uploader(token, revision).push(self.output_dir, commit_message or "End of training", blocking)
        self.ranks.barrier()

    def _uploader(self, token: str | None = None, revision: str | None = None) -> HubUploader:
        self.hub = uploader(self.hub, self.args, self.output_dir, token, revision)
        return self.hub

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self, runtime: Runtime) -> TrainOutput:
        args, state, metrics, main = self.args, self.state, {}, self.ranks.main
        eval_pending, saved_step = False, None  # an evaluation runs after the next sync; the last checkpoint's step
        while args.max_steps <= 0 or state.step < args.max_steps:
            start, waited = time.perf_counter(), runtime.rollout_wait_s if main else 0.0
            micro_batches = self.ranks.broadcast(runtime.next_micro_batches(state.model_version) if main else None)
            if not micro_batches:
                break
            self.callbacks.event("on_step_begin")
            eval_pending, epoch_ended = self._step(runtime, micro_batches, eval_pending, start, waited)
            self.callbacks.event("on_step_end")
            self.callbacks.plan(epoch_ended)
            if runtime.preempted_everywhere():  # SIGTERM with enable_jit_checkpoint: save this step, then stop
                self.callbacks.control.should_save = self.callbacks.control.should_training_stop = True
            control = self.callbacks.agreed()
            if control.should_log:
                metrics = self._log(runtime)
            if control.should_save:
                saved_step = self._checkpoint(runtime)
            if control.should_training_stop or self.callbacks.agreed().should_training_stop:  # asked in on_log/on_save
                break
        with unless_preempted(runtime.preempted):  # the run stopped after the step's log (a callback, the data's end)
            runtime.wait_sync(record=False)
        if main:  # what came in after the last log (drops while the worker finished)
            self.run_log.window.extend(runtime.take_metrics())
        if self.ranks.broadcast(bool(self.run_log.window.values)):
            metrics = self._log(runtime)
        if (args.save_strategy in ("steps", "epoch") or runtime.preempted.is_set()) and state.step not in (
            0,
            saved_step,
        ):
            self._checkpoint(runtime)
        if args.load_best_model_at_end and not runtime.preempted_everywhere():  # every rank decides alike
            self._load_best(runtime)
        return TrainOutput(state.step, self.run_log.training_loss, metrics)

    def _step(
        self, runtime: Runtime, micro_batches: list[list[PackedRow]], eval_pending: bool, start: float, waited: float
    ) -> tuple[bool, bool]:
        """One optimizer step on `micro_batches` (taken at `start`; the worker had been waited for `waited` seconds
        before): trained, counted, synced and recorded. Returns whether an evaluation is still pending, and whether
        the step ended a pass over the dataset."""
        rows = [row for micro_batch in micro_batches for row in micro_batch]
        step_start = self.passes.clock()
        step = self.training_step(micro_batches)
        step_end = self.passes.clock()
        with unless_preempted(runtime.preempted):  # the last step's overlapped sync reads the weights stepped next
            runtime.wait_sync()
        optimizer_start = self.passes.clock()
        grad_norm = self.optimizer_step()
        optimizer_s, forward_backward_s = self.passes.clock() - optimizer_start, step_end - step_start
        epoch_ended = self._step_done(rows, runtime)
        if self.args.torch_empty_cache_steps and self.state.step % self.args.torch_empty_cache_steps == 0:
            empty_device_cache(self.device)
        eval_pending, eval_s = self._sync(runtime, eval_pending or self.callbacks.eval_due(epoch_ended))
        if self.ranks.main:
            runtime.publish(tokens_per_step=sum(row.raw_tokens for row in rows))  # after the sync, or its start
            times = StepTimes(
                total=time.perf_counter() - start - eval_s,
                rollout_wait=runtime.rollout_wait_s - waited,
                forward=step.forward_s,
                forward_backward=forward_backward_s,
                optimizer=optimizer_s,
            )
            lr = self.scheduler.get_last_lr()[0]
            self.run_log.record_step(rows, len(micro_batches), step.loss, grad_norm, lr, times)
            if self.flops:
                self.flops.record(self.run_log.window, rows, times)
        if not self.args.skip_memory_metrics:  # every rank's: the window is gathered, the largest logged
            record_memory(self.run_log.window, self.device)
        return eval_pending, epoch_ended

    def _load_best(self, runtime: Runtime) -> None:
        """load_best_model_at_end: the best checkpoint's weights into the model (every rank; rank 0 ranked them)."""
        best = self.ranks.broadcast(self.state.best_model_checkpoint)
        if best:
            checkpoint.load_weights(Path(best), self.model)
            if self.ranks.main:
                runtime.session.say(
                    f"loaded the best checkpoint, {best} ({self.args.metric_for_best_model} "
                    f"{self.state.best_metric:.4g})"
                )

    def _sync(self, runtime: Runtime, eval_pending: bool) -> tuple[bool, float]:
        """Every weight_sync_steps steps: the server gets the new weights as the next policy version, then a pending
        evaluation runs under them. Returns whether an evaluation is still pending, and the seconds it took."""
        state = self.state
        if state.step % self.args.weight_sync_steps or runtime.preempted_everywhere():  # a preempted run checkpoints
            return eval_pending, 0.0  # first: its server may be ending too (a SIGTERM to the whole job)
        last = 0 < self.args.max_steps <= state.step  # no next step to overlap: its log carries the sync
        with unless_preempted(runtime.preempted):
            runtime.sync(state.model_version + 1, overlap=not (eval_pending or last))  # an evaluation samples from them
            state.model_version += 1
        eval_s = self._evaluate(runtime).get("eval/runtime_s", 0.0) if eval_pending and self.ranks.main else 0.0
        return False, eval_s

    def optimizer_step(self) -> float:
        """Clip the accumulated gradients, step the optimizer and the schedule, zero the gradients; returns the
        gradient norm before clipping (optimization.step_optimizer, callbacks called as in transformers)."""
        return step_optimizer(
            self.model, self.optimizer, self.scheduler, self.scaler, self.args.max_grad_norm, self.callbacks.event
        )

    def _step_done(self, rows: list[PackedRow], runtime: Runtime) -> bool:
        """Count the step; its samples are trained, and the worker may generate what they consumed again. Returns
        whether the step finished a pass over the dataset (rank 0 knows; an epoch strategy's event)."""
        state = self.state
        state.step += 1
        state.num_tokens += sum(row.num_tokens for row in rows)
        state.num_input_tokens_seen += input_tokens(rows, self.args.include_num_input_tokens_seen)
        if not self.ranks.main:
            return False
        if self.halved_budget is not None:  # auto_find_batch_size: later steps are packed in the smaller rows
            runtime.limit_token_budget(self.halved_budget)
            runtime.session.say(f"out of device memory: token_budget halved to {self.halved_budget}")
            self.halved_budget = None
        # their staleness against the policy they trained; no token is mixed where the server recomputes its cache
        record_samples(self.run_log.window, rows, state.model_version, not runtime.recomputes_kv_cache)
        before, state.dataset_start_index = state.dataset_start_index, runtime.trained(rows, state.step)
        epochs = self.epoch_size
        return epochs is not None and state.dataset_start_index // epochs > before // epochs

    def _log(self, runtime: Runtime) -> dict:
        """Every rank's window, reduced together by each name's rule and written by rank 0."""
        others = self.ranks.gather(None if self.ranks.main else dict(self.run_log.window.values))
        if others is None:  # not rank 0
            self.run_log.window.flush()
            return {}
        for records in others[1:]:
            self.run_log.window.extend(records)
        self.run_log.window.extend(runtime.take_metrics())
        metrics, examples = self.run_log.flush(self.state)
        if "epoch" in metrics:  # a dataset with a length (a stream has no epochs to count)
            self.state.epoch = metrics["epoch"]
        self.state.log_history.append({**metrics, "step": self.state.step})
        self.callbacks.event("on_log", logs=metrics)
        runtime.session.log(self.state.step, metrics)
        runtime.session.update(self.state.step, metrics)
        if examples:
            runtime.session.log_completions(self.state.step, examples, self.args.num_completions_to_print)
        return metrics

    def _evaluate(self, runtime: Runtime) -> dict:
        assert self.eval_dataset is not None, "evaluations run with an eval_dataset"
        return evaluate(runtime, self.state, self.args, self.callbacks, len(self.eval_dataset), self.output_dir)

    def _checkpoint(self, runtime: Runtime) -> int:
        """A checkpoint of this step, with where the prompt stream goes on; returns the step."""
        checkpoint.share_rank0_state(self.state, self.ranks)
        # transformers annotates this field with the list its __post_init__ turns into such a dict
        self.state.stateful_callbacks = self.callbacks.exported()  # type: ignore[assignment]
        model_only = self.args.save_only_model and not runtime.preempted_everywhere()  # a preempted run resumes
        path = checkpoint.save(
            self.output_dir,
            self.model,
            self.tokenizer,
            self.optimizer,
            self.scheduler,
            self.state,
            self.args.save_total_limit,
            self.ranks,
            runtime.resume_point() if self.ranks.main else None,
            model_only=model_only,
        )
        if self.args.push_to_hub and self.ranks.main:
            self._uploader().checkpoint_saved(path, self.state.step, self.args.hub_strategy)
        self.callbacks.event("on_save")
        return self.state.step

    # ---- setup ----------------------------------------------------------------------------------
    def _runtime_spec(self) -> RuntimeSpec:
        return RuntimeSpec(
            args=self.args,
            model=self.model,
            tokenizer=self.tokenizer,
            ranks=self.ranks,
            model_name=self.model_name,
            output_dir=self.output_dir,
            layout=self.layout,
            kernel=self.kernel,
            compute_dtype=self.compute_dtype,
            served_dtype=served_dtype(self.model),
            eos_token_ids=eos_ids(self.tokenizer, self.model),
            lora_rank=self.model.peft_config["default"].r if self.lora else None,
            dataset=self.dataset,
            eval_dataset=self.eval_dataset,
            reward_funcs=self.reward_funcs,
            tools=self.tools,
            environment_factory=self.environment_factory,
            harness=self.harness,
            loop_cls=loop_class(self.loop_cls, self.harness),
            rollout_template=self.rollout_template,
        )
