"""`AsyncGRPOTrainer`: trains on rollouts while the worker keeps generating them.

`train()` connects to (or starts) the generation server, starts the rollout worker, then runs one loop,
read top to bottom in `_loop`: take rows from the sample source, forward and backward them through the
objective, step the optimizer, maybe push the new weights to the server, log, maybe checkpoint — until
`max_steps` or the last epoch. The server, the worker and the metric sinks belong to a `Session`, which
stops them however the run ends. The worker and the trainer share only the queue and a few numbers.
"""

import copy
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerControl
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import enable_full_determinism
from transformers.utils import logging as hf_logging

from tandem import distributed
from tandem.config import AsyncGRPOConfig
from tandem.generation.client import EngineDead, ServerProblem, engine_died, server_gone
from tandem.metrics.doctor import OFF_POLICY_BOUND
from tandem.metrics.window import MetricWindow
from tandem.model_folder import save_model_folder
from tandem.packing import PackedRow
from tandem.packing import attention as tree_attention
from tandem.packing.logprobs import TokenLogprobs, row_logprobs
from tandem.prompts import check_prefix_preserving, render_chat, render_prompt, training_chat_template
from tandem.rollout.environments import factories_of, validate_environments
from tandem.rollout.loop import AsyncRolloutLoop
from tandem.rollout.prompt_stream import first_rows, is_iterable
from tandem.rollout.settings import RolloutSettings
from tandem.rollout.tools import validate_tools
from tandem.rollout.worker import WorkerSpec, check_picklable
from tandem.tool_calls import tool_schema
from tandem.runtime import server_checks, sync_check
from tandem.trainer import OPENMP_POLICY_TOO_LATE, checkpoint, export
from tandem.packing.batching import TokenBudgetBatcher
from tandem.trainer.checkpoint import TrainerState
from tandem.trainer.flops import model_shape, peak_flops, rows_flops
from tandem.trainer.model import (autocast_dtype, check_dataset, check_precision, drop_unused_columns, eos_ids,
                                  enable_checkpointing, load_model, served_dtype, use_bf16, with_adapter)
from tandem.trainer.objectives import LossShare, make_objective
from tandem.trainer.optimization import clip_gradients, make_optimizer, make_scheduler
from tandem.runtime.sample_source import ResumePoint, SampleSource, Stall
from tandem.runtime.session import DYING_S, Session
from tandem.trainer.step_metrics import StepTimes, record_micro_batch, record_samples, record_step
from tandem.runtime.weight_sync import ADAPTER_NAME, LoraSync, choose_sync, follower_sync, lora_server_flags, publish

PROMPTS_MEASURED = 1000
"""An IterableDataset's first rows whose prompts are checked against the server's context length (a streamed dataset
is not read through before training)."""
SERVER_RESTARTS = 3
RECONNECT_POLL_S = 5.0
"""While waiting for an external server after a failed sync, how often the worker is asked whether it stopped."""
FORCED_PROBES = 2
"""Against an external server the first syncs are always probed: the connect push (same weights) and the first trained
weights (a reload that misses a layer shows only once the weights differ from the server's own)."""
SERVER_RESTART_WINDOW_S = 600.0
"""The embedded server is restarted when it dies, unless it died SERVER_RESTARTS times in the last 10 minutes."""


def callback_handler(callbacks: list, model, tokenizer, optimizer, scheduler) -> CallbackHandler:
    """transformers' CallbackHandler, without its warning that no DefaultFlowCallback is present: tandem's loop decides
    when to log and save (`logging_steps`, `save_steps`) and honours the flags callbacks set in `control`."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return CallbackHandler(callbacks, model, tokenizer, optimizer, scheduler)
    finally:
        hf_logging.set_verbosity(verbosity)


def seed_run(args: AsyncGRPOConfig) -> None:
    """The trainer's random state from `seed`; with full_determinism also deterministic algorithms (transformers')."""
    if args.full_determinism:
        enable_full_determinism(args.seed)
    else:
        torch.manual_seed(args.seed)


def run_log_level(args: AsyncGRPOConfig, main: bool) -> str:
    return args.log_level if main else args.log_level_replica


def set_log_level(level: str) -> None:
    """transformers' logging verbosity for the run, as its Trainer sets it (`passive` leaves it alone)."""
    if level != "passive":
        hf_logging.set_verbosity(hf_logging.log_levels[level])


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    metrics: dict


@dataclass
class StepLoss:
    """What `training_step` did: the step's loss and the seconds its forward passes took."""

    loss: float
    forward_s: float


class AsyncGRPOTrainer:
    loop_cls = AsyncRolloutLoop

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None, eval_dataset=None):
        self.args = args = args or AsyncGRPOConfig()
        self.tools, self.environment_factory = list(tools or []), environment_factory
        self.dataset = check_dataset(train_dataset, environments=environment_factory is not None, max_steps=args.max_steps)
        self.reward_funcs = _reward_list(reward_funcs, self._check_agents())
        self.eval_dataset = check_eval_dataset(eval_dataset, args, environments=environment_factory is not None)
        if is_iterable(self.dataset) and args.train_sampling_strategy == "random":
            raise ValueError("train_sampling_strategy='random' shuffles a dataset by its indices, and an IterableDataset "
                             "has none: shuffle the stream itself (dataset.shuffle(seed=..., buffer_size=...)).")
        if args.remove_unused_columns and self.dataset is not None:
            self.dataset = drop_unused_columns(self.dataset, self.reward_funcs, environment_factory is not None)
        self.ranks = distributed.join(args.vllm_server_timeout)
        """This process's place among the torchrun ranks (one rank of one without torchrun)."""
        self.model_name, self.model, self.layout = load_model(model, args)
        """The rows this model trains on: tree-packed, or padded for models a tree row would change (packing/trie.py)."""
        self.lora = peft_config is not None
        if self.lora:
            self.model = with_adapter(self.model, peft_config)
        if self.ranks.several:
            distributed.shard(self.model, self.ranks, args.fsdp_config, use_bf16(args, next(self.model.parameters()).device))
        self.tokenizer = processing_class or AutoTokenizer.from_pretrained(
            self.model_name if isinstance(model, str) else model.name_or_path, trust_remote_code=args.trust_remote_code)
        self.rollout_template: str | None = None
        """A training-safe chat template the worker renders rollouts with, when the model's is not prefix-preserving."""
        if self.tools or environment_factory is not None:
            self._use_training_template()
        self.optimizer = optimizers[0] or make_optimizer(self.model, args)
        self.scheduler = optimizers[1] or make_scheduler(self.optimizer, args)
        self.device = next(self.model.parameters()).device
        self.scaler = check_precision(args, self.device, self.ranks.several, next(self.model.parameters()).dtype)
        """fp16's gradient scaler (None without fp16)."""
        self.kernel = args.tree_attention_kernel or tree_attention.default_kernel(self.device)
        if self.kernel == "flex" and self.device.type != "cuda":
            raise ValueError("tree_attention_kernel='flex' needs a GPU: FlexAttention has no backward pass on CPU. "
                             "Use 'exact' or 'sdpa'.")
        self.peak_flops = peak_flops(self.device, autocast_dtype(args, self.device) is not None)
        """One GPU's peak FLOP/s for perf/*_mfu; None on CPU or an unknown GPU (trainer/flops.py)."""
        self.flops_shape = model_shape(self.model) if self.peak_flops else None
        text_config = self.model.config.get_text_config()
        if args.router_aux_loss_coef is not None and not hasattr(text_config, "router_aux_loss_coef"):
            raise ValueError(f"AsyncGRPOConfig.router_aux_loss_coef={args.router_aux_loss_coef}: the model is not a "
                             "Mixture-of-Experts model (its config has no router), so there is no balancing loss to weigh. "
                             "Leave it None.")
        model_coef = getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0
        self.objective = make_objective(args, args.router_aux_loss_coef if args.router_aux_loss_coef is not None else model_coef)
        self.output_dir = Path(args.output_dir)
        self.state = TrainerState()
        self.window = MetricWindow()
        self.session: Session | None = None
        self.source: SampleSource | None = None
        self.batcher: TokenBudgetBatcher | None = None
        self.token_budget = args.token_budget
        self.sync = None
        """How weights reach the server (weight_sync.choose_sync), chosen when train() connects."""
        self.probe = None
        """The client of the sync probe, opened at the first checked sync."""
        self.probe_prompt = render_prompt(self.tokenizer, self._first_prompt(), args.chat_template_kwargs)
        self.probe_tokens = sync_check.PROBE_TOKENS
        """How long the probe's completion is: shorter when the server's context has no room for the full probe."""
        self.compute_dtype = str(autocast_dtype(args, self.device) or next(self.model.parameters()).dtype).removeprefix("torch.")
        """The dtype of the trainer's forward: the rounding it expects between its log-probs and the server's."""
        self.probe_bound = (OFF_POLICY_BOUND.get(self.compute_dtype, OFF_POLICY_BOUND["float32"]), self.compute_dtype)
        """The largest probe gap that rounding explains, and the dtype it is that of: the coarser of the trainer's and
        the server's, which the trainer learns at connect."""
        self.pushes = 0
        """Weight syncs pushed since the server was reached: against an external server the first FORCED_PROBES are
        always probed (the connect push, then the first trained weights; again after a reconnect)."""
        self.losses: list[float] = []
        self.reward_history: list[float] = []
        self.callback_handler = callback_handler(callbacks or [], self.model, self.tokenizer, self.optimizer, self.scheduler)
        """transformers' TrainerCallback objects, called with (args, state, control) at each event of the loop."""
        self.control = TrainerControl()
        self.preempted = threading.Event()
        """Set by SIGTERM while training with enable_jit_checkpoint: the step in progress ends with a checkpoint."""
        self.resume_point = ResumePoint(0)
        """Where this run's prompt stream starts: a checkpoint's, or the beginning."""
        self.served_path: str | None = None
        """The folder the embedded server was started from (None with an external server)."""
        self.served_url: str | None = None
        self.served_name: str | None = None
        """The server the worker generates from, and the model name it is asked for."""
        self.server_restarts: list[float] = []
        """When the embedded server was restarted (monotonic seconds): one that keeps dying stops the run."""
        self.eval_pending = False
        """An evaluation is due: it runs right after the next weight sync, on the policy just synced."""
        self.saved_step: int | None = None
        """The step of the last checkpoint written, so the end of a run does not write the same one again."""
        self._callback_event("on_init_end")

    # ---- public ---------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None) -> TrainOutput:
        """Train until max_steps or the end of the data. Under torchrun every rank calls it; rank 0 owns the server,
        the rollout worker and the logs, and sends every rank its rows."""
        if OPENMP_POLICY_TOO_LATE and self.device.type == "cpu" and torch.get_num_threads() > 1:
            warnings.warn("torch was imported before tandem, so its OpenMP threads spin while they wait and slow the "
                          "embedded server and the rollout worker (the demo ran 1.4x slower). Start Python with "
                          "OMP_WAIT_POLICY=PASSIVE, or import tandem before torch.", stacklevel=2)
        check_picklable({f"reward function {i}": f for i, f in enumerate(self.reward_funcs)} | {"loop_cls": self.loop_cls})
        self.preempted.clear()
        seed_run(self.args)
        set_log_level(run_log_level(self.args, self.ranks.main))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        resume = checkpoint.resolve(resume_from_checkpoint, self.output_dir)
        self._restore(resume)
        self._callback_event("on_train_begin")
        if self.args.gradient_checkpointing:
            enable_checkpointing(self.model, self.args.gradient_checkpointing_kwargs or {"use_reentrant": False})
        self.model.train()
        try:
            with Session(self.args.vllm_server_timeout, self.args.vllm_server_api_key) as self.session, \
                    on_sigterm(self.args.enable_jit_checkpoint, self.preempted):
                self._connect(resumed=resume is not None)
                self.eval_pending = self.args.eval_on_start and self.eval_dataset is not None
                if self.eval_pending and self.ranks.main:  # the policy the server serves now: the starting one
                    self._evaluate()
                output = self._loop()
        finally:
            self.sync = None  # its transfer group (sockets, threads) joined the server the session stopped
        if self.preempted.is_set():
            print(f"tandem: stopped on SIGTERM after a checkpoint at step {self.state.step}; resume with "
                  "train(resume_from_checkpoint=True), or tandem train with --resume_from_checkpoint true", file=sys.stderr)
        self._callback_event("on_train_end")
        return output

    def add_callback(self, callback) -> None:
        """Add a transformers `TrainerCallback` (an instance, or a class to instantiate)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove a callback (an instance, or the first of a class) and return it; None when absent."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        """Remove a callback (an instance, or the first of a class)."""
        self.callback_handler.remove_callback(callback)

    def training_step(self, micro_batches: list[list[PackedRow]]) -> StepLoss:
        """Forward and backward this rank's rows of one optimizer step through the objective (gradients accumulate).
        `micro_batches` are every rank's rows: rank r trains row r of each (one process trains them all); a rank
        with no row in a micro-batch forwards its first one with weight 0, so every rank runs the same passes."""
        rows = [row for micro_batch in micro_batches for row in micro_batch]
        records = self.objective.begin_step(rows, lambda: self._score_all(micro_batches))
        if self.ranks.main:
            self.window.extend(records)
        loss, forward_s = 0.0, 0.0
        for micro_batch in micro_batches:
            share = LossShare.of(micro_batch, len(micro_batches))
            for row, real in self._my_rows(micro_batch):
                start = self._clock()
                scored = self._forward(row)
                forward_s += self._clock() - start
                row_loss = self.objective.row_loss(row, scored, share)
                self._backward(row_loss.loss if real else row_loss.loss * 0.0)
                if real:
                    self.window.extend(row_loss.metrics)
                    loss += row_loss.loss.item()
        return StepLoss(self.ranks.total(loss), forward_s)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def save_model(self, output_dir: str | None = None, merged: bool = False) -> None:
        """The model (or the LoRA adapter) and tokenizer as a folder transformers, vLLM and `tandem serve` load.
        `merged=True` writes a LoRA model as `tandem export` does: its adapter merged into a fresh copy of the base
        model, read again from the base's folder into host memory (one more copy of the base there, none on the
        GPU), so the trained model is left as it is; a full-weight model is saved as it is. Under torchrun every rank
        calls it; rank 0 merges."""
        target = Path(output_dir or self.args.output_dir)
        if merged and self.lora:
            with tempfile.TemporaryDirectory() as adapter:
                save_model_folder(self.model, Path(adapter), self.ranks)  # gathered whole, on rank 0
                if self.ranks.main:
                    model = export.merge_adapter(Path(adapter), checkpoint.base_model_name(self.model), served_dtype(self.model))
                    export.write(model, self.tokenizer, target)
            self.ranks.barrier()
            return
        save_model_folder(self.model, target, self.ranks)
        if self.ranks.main:
            self.tokenizer.save_pretrained(target)

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> TrainOutput:
        args, state, metrics, main = self.args, self.state, {}, self.ranks.main
        while args.max_steps <= 0 or state.step < args.max_steps:
            start, waited = time.perf_counter(), self.source.wait_s if main else 0.0
            micro_batches = self.ranks.broadcast(self._take_micro_batches() if main else None)
            if not micro_batches:
                break
            rows = [row for micro_batch in micro_batches for row in micro_batch]
            self._callback_event("on_step_begin")
            step_start = self._clock()
            step = self.training_step(micro_batches)
            optimizer_start = self._clock()
            grad_norm = self.optimizer_step()
            optimizer_s, forward_backward_s = self._clock() - optimizer_start, optimizer_start - step_start
            self._step_done(rows)
            self.eval_pending, eval_s = self.eval_pending or self._eval_due(), 0.0
            if state.step % args.weight_sync_steps == 0 and not self._preempted():  # a preempted run checkpoints
                try:  # first: its server may be ending too (a SIGTERM to the whole job)
                    self._sync(state.model_version + 1)
                except Exception:
                    if not self.preempted.is_set():
                        raise  # a SIGTERM during the sync: the server went with it; the trained step is still saved
                if self.eval_pending and main:
                    eval_s = self._evaluate().get("eval/runtime_s", 0.0)
            if main:
                self.source.publish(tokens_per_step=sum(row.raw_tokens for row in rows))  # after the sync (sample_source.py)
                times = StepTimes(total=time.perf_counter() - start - eval_s, rollout_wait=self.source.wait_s - waited,
                                  forward=step.forward_s, forward_backward=forward_backward_s, optimizer=optimizer_s)
                self._record(rows, len(micro_batches), step.loss, grad_norm, times)
            self._callback_event("on_step_end")
            if self._preempted():  # SIGTERM with enable_jit_checkpoint: save this step, then stop
                self.control.should_save = self.control.should_training_stop = True
            control = self._agreed_control()
            if self._log_now() or control.should_log:
                metrics = self._log()
            if (args.save_strategy == "steps" and state.step % args.save_steps == 0) or control.should_save:
                self._checkpoint()
            if control.should_training_stop or self._agreed_control().should_training_stop:  # asked in on_log/on_save
                break
        leftover = self.window.values or (main and self.source.worker_metrics.values)
        if self.ranks.broadcast(bool(leftover)):  # what came in after the last log (drops while the worker finished)
            metrics = self._log()
        if (args.save_strategy != "no" or self.preempted.is_set()) and state.step > 0 and self.saved_step != state.step:
            self._checkpoint()
        return TrainOutput(state.step, sum(self.losses) / len(self.losses) if self.losses else 0.0, metrics)

    def _take_micro_batches(self) -> list[list[PackedRow]]:
        """Up to gradient_accumulation_steps micro-batches of up to one row per rank, each closed by the token-budget
        batcher when the next sample fits nowhere; fewer (or none) once the worker has finished. A sample is
        consumed once placed. Rank 0 only."""
        self.window.add("rollout/queue_size", self.source.drain())
        micro_batches = []
        for index in range(self.args.gradient_accumulation_steps):
            self._fill_micro_batch(last=index == self.args.gradient_accumulation_steps - 1)
            rows = self.batcher.close()
            if not rows:
                break
            record_micro_batch(self.window, rows, self.token_budget, self.ranks.world_size)
            micro_batches.append(rows)
        return micro_batches

    def _fill_micro_batch(self, last: bool) -> None:
        """Offer samples to the batcher until one fits nowhere. The step's last micro-batch takes whole units: groups
        (GRPO: a group split across two steps would have its second part trained a policy version later, past
        max_staleness for a group that was just in bounds) or rollouts (FlashREINFORCE trains a trajectory in one
        step). A group larger than a whole micro-batch fills it; a rollout larger than one is dropped as oversize."""
        version, source, batcher = self.state.model_version, self.source, self.batcher
        flash = self.args.algorithm == "flash_reinforce"
        same = (lambda s: s.rollout_id) if flash else (lambda s: s.position)
        while (unit := source.peek_unit(version, same if last else None)) is not None:
            if batcher.offer_together(unit):
                for _ in unit:
                    source.take()
            elif not batcher.empty:
                return
            elif flash:
                source.discard_oversize(len(unit))
            else:  # one group overfills the micro-batch: as much of it as fits
                for sample in unit:
                    if not batcher.offer(sample):
                        return
                    source.take()

    def _my_rows(self, micro_batch: list[PackedRow]) -> list[tuple[PackedRow, bool]]:
        """(row, real) pairs this rank forwards: all rows on one process, row `rank` under torchrun, or the first row
        as a weight-0 filler when the micro-batch has fewer rows than ranks (FSDP needs the same passes everywhere)."""
        if not self.ranks.several:
            return [(row, True) for row in micro_batch]
        rank = self.ranks.rank
        return [(micro_batch[rank], True)] if rank < len(micro_batch) else [(micro_batch[0], False)]

    def optimizer_step(self) -> float:
        """Clip the accumulated gradients, step the optimizer and the schedule, zero the gradients; returns the
        gradient norm before clipping."""
        if self.scaler:  # fp16: the gradients are clipped and measured unscaled; a step with inf/NaN ones is skipped
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.model, self.args.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _step_done(self, rows: list[PackedRow]) -> None:
        """Count the step; its samples are trained, and the worker may generate what they consumed again."""
        state = self.state
        state.step += 1
        state.num_tokens += sum(row.num_tokens for row in rows)
        if self.ranks.main:
            record_samples(self.window, rows, state.model_version)  # their staleness against the policy they trained
            self.source.trained([s for row in rows for s in row.samples])
            state.dataset_start_index = self.source.ledger.watermark

    def _log_now(self) -> bool:
        """logging_strategy 'steps': every logging_steps steps, and after the first with logging_first_step."""
        args, step = self.args, self.state.step
        return args.logging_strategy == "steps" and (step % args.logging_steps == 0 or (args.logging_first_step and step == 1))

    def _record(self, rows: list[PackedRow], num_micro_batches: int, loss: float, grad_norm: float, times: StepTimes) -> None:
        if math.isfinite(loss):  # logging_nan_inf_filter, always on: a NaN or infinite loss is left out of `loss`
            self.losses.append(loss)
            self.window.add("loss", loss)
        self.window.add("grad_norm", grad_norm)
        self.window.add("learning_rate", self.scheduler.get_last_lr()[0])
        record_step(self.window, rows, num_micro_batches, times)
        if self.peak_flops:  # the step's FLOPs over what its GPUs could do in the time
            flops, capacity = rows_flops(rows, self.flops_shape), self.peak_flops * self.ranks.world_size
            self.window.add("perf/fwd_bwd_mfu", flops / (times.forward_backward * capacity))
            self.window.add("perf/wall_clock_mfu", flops / (times.total * capacity))

    def _log(self) -> dict:
        """Every rank's window, reduced together by each name's rule and written by rank 0."""
        others = self.ranks.gather(None if self.ranks.main else dict(self.window.values))
        if not self.ranks.main:
            self.window.flush()
            return {}
        for records in others[1:]:
            self.window.extend(records)
        self.window.extend(self.source.worker_metrics.values)
        self.source.worker_metrics = MetricWindow()
        examples = self.window.values.get("completions/examples")
        metrics = self.window.flush()
        metrics["num_tokens"] = self.state.num_tokens
        metrics["model_version"] = self.state.model_version
        if self.dataset is not None and not is_iterable(self.dataset):
            metrics["epoch"] = self.source.ledger.watermark / len(self.dataset)
        if self.tools or self.environment_factory is not None:
            metrics.setdefault("tools/failure_frequency", math.nan)  # no call in the window (reference/metrics.md)
        if "reward" in metrics:
            self.reward_history.append(metrics["reward"])
        self.state.epoch = metrics.get("epoch")
        self.state.log_history.append({**metrics, "step": self.state.step})
        self._callback_event("on_log", logs=metrics)
        self.session.log(self.state.step, metrics)
        self.session.progress.update(self.state.step, metrics)
        if examples:
            self.session.progress.print_completions(examples, self.args.num_completions_to_print)
        return metrics

    def _eval_due(self) -> bool:
        """eval_strategy 'steps': every eval_steps steps (logging_steps when unset), from eval_delay on."""
        args, step = self.args, self.state.step
        return (args.eval_strategy == "steps" and step >= args.eval_delay
                and step % (args.eval_steps or args.logging_steps) == 0)

    def _evaluate(self) -> dict:
        """The eval prompts generated by the server under the policy version it serves now, scored by the reward
        functions and logged as eval/* under this step; never trained. Rank 0 (the worker's owner) only."""
        state, start = self.state, time.perf_counter()
        self.eval_pending = False
        records = self.source.evaluate(state.step, state.model_version)
        if records is None:  # the run is stopping (SIGTERM)
            return {}
        window = MetricWindow()
        window.extend(records)
        metrics = window.flush() | {"eval/runtime_s": time.perf_counter() - start, "eval/model_version": state.model_version,
                                    "eval/num_prompts": len(self.eval_dataset)}
        state.log_history.append({**metrics, "step": state.step})
        self._callback_event("on_evaluate", metrics=metrics)
        self.session.log(state.step, metrics)
        self.session.progress.say(f"eval at step {state.step} (policy version {state.model_version}): reward "
                                  f"{metrics.get('eval/reward', math.nan):.3f} over {len(self.eval_dataset)} prompts")
        return metrics

    def _log_stalled(self, stall: Stall) -> None:
        """While no step is possible, the worker's metrics still reach the sinks every minute, under the last step and
        with `stalled_s` (the seconds waited): what generation and scoring do while nothing trains."""
        metrics = self.source.worker_metrics.flush()
        if metrics:
            self.session.log(self.state.step, {**metrics, "stalled_s": stall.waited})

    def _checkpoint(self) -> Path:
        self.state.dataset_start_index = self.ranks.broadcast(self.state.dataset_start_index)
        folder = checkpoint.save(self.output_dir, self.model, self.tokenizer, self.optimizer, self.scheduler, self.state,
                                 self.args.save_total_limit, self.ranks, self.source.resume_point() if self.ranks.main else None)
        self.saved_step = self.state.step
        self._callback_event("on_save")
        return folder

    # ---- callbacks ------------------------------------------------------------------------------
    def _callback_event(self, event: str, **kwargs) -> None:
        """Call every callback's `event` with (args, state, control); what they set in `control` is read by the loop."""
        self.state.is_world_process_zero = self.ranks.main
        self.state.is_local_process_zero = int(os.environ.get("LOCAL_RANK", 0)) == 0
        self.state.max_steps, self.state.logging_steps, self.state.save_steps = (
            self.args.max_steps, self.args.logging_steps, self.args.save_steps)
        self.control = getattr(self.callback_handler, event)(self.args, self.state, self.control, **kwargs)

    def _preempted(self) -> bool:
        """Whether any rank got SIGTERM (with enable_jit_checkpoint): every rank stops at the same step."""
        if not self.args.enable_jit_checkpoint:
            return False
        if self.ranks.several:
            return self.ranks.total(float(self.preempted.is_set())) > 0
        return self.preempted.is_set()

    def _agreed_control(self) -> TrainerControl:
        """This step's `should_log` / `should_save` / `should_training_stop` as rank 0's callbacks set them, on every
        rank (logging and saving are collective); `on_step_begin` clears the first two, as in transformers."""
        flags = ("should_log", "should_save", "should_training_stop")
        return TrainerControl(**self.ranks.broadcast({f: getattr(self.control, f) for f in flags} if self.ranks.main else None))

    # ---- forward passes -------------------------------------------------------------------------
    def _clock(self) -> float:
        """Now, once the device has finished the work queued so far (GPU kernels run asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, row: PackedRow) -> TokenLogprobs:
        """The row's log-probs at its trained positions (bf16 autocast where configured)."""
        dtype = autocast_dtype(self.args, self.device)
        with torch.autocast(self.device.type, dtype=dtype) if dtype else nullcontext():
            return row_logprobs(self.model, row, self.kernel, self.args.temperature)

    def _score(self, row: PackedRow) -> TokenLogprobs:
        """The row's log-probs without gradients, in the model's own dtype (objectives that score the whole step first)."""
        with torch.no_grad():
            return row_logprobs(self.model, row, self.kernel, self.args.temperature)

    def _score_all(self, micro_batches: list[list[PackedRow]]) -> list[TokenLogprobs]:
        """Every row of the step scored without gradients, in order: each rank scores its own rows, then the ranks
        exchange their log-probs and entropies (what an objective that decides per trajectory needs)."""
        mine = [self._score(row) for micro_batch in micro_batches for row, _ in self._my_rows(micro_batch)]
        if not self.ranks.several:
            return mine
        exchanged = self.ranks.all_gather([(s.logprobs.cpu(), s.entropy.cpu()) for s in mine])
        return [TokenLogprobs(*(t.to(self.device) for t in exchanged[rank][index]))
                for index, micro_batch in enumerate(micro_batches) for rank in range(len(micro_batch))]

    # ---- weight sync ----------------------------------------------------------------------------
    def _sync(self, version: int) -> None:
        start = time.perf_counter()
        self.ranks.barrier()  # the gathers of the sync start when the slowest rank has finished its step
        waited = time.perf_counter() - start
        try:
            timings = self._push(version)
        except ServerProblem:
            raise  # the server answers but serves other weights, or refuses: syncing again would not change that
        except EngineDead as error:
            raise ServerProblem(f"the weight sync failed: {engine_died(error)}") from None
        except Exception as error:
            if not self._reconnect(version, error):  # the server brought back serves this version
                raise
            timings = {}
        if self.ranks.several:
            timings["perf/weight_sync_barrier_s"] = waited
        if self.ranks.main:
            for name, value in timings.items():
                self.window.add(name, value)
        self.state.model_version = version

    def _push(self, version: int) -> dict[str, float]:
        """Sync the weights as `version` (every rank takes part), then, when `_probe_limit` says so, check that the server
        now samples from them."""
        timings = self.sync.push(self.model, version, announce=self._announce)
        self.pushes += 1
        limit = self._probe_limit()
        if limit is not None:
            name = self.sync.name_for(version)
            served = None
            if self.ranks.main:
                self.probe = self.probe or self.session.generation_client()
                served = self.session.run(sync_check.probe(self.probe, name, self.probe_prompt, self.probe_tokens))
            served = self.ranks.broadcast(served)
            ours = sync_check.policy_logprobs(self.model, self.probe_prompt, served.token_ids, self.kernel, self.layout)
            if self.ranks.main:
                gap = sync_check.compare(name, served, ours)
                sync_check.check(gap, *limit)
                timings["weight_sync/served_logprob_gap"] = gap.max_abs
        return timings

    def _probe_limit(self) -> tuple[float, str] | None:
        """How far the probe after this sync may land from the trainer's log-probs, and where that bound comes from; None
        for no probe. The user's weight_sync_check_atol; against an external server also the dtype's rounding bound,
        probed after the first FORCED_PROBES syncs whatever the settings."""
        atol = self.args.weight_sync_check_atol
        user = (atol, "weight_sync_check_atol") if atol is not None else None
        if self.args.vllm_server_base_url is None:
            return user
        bound = (self.probe_bound[0], f"{self.probe_bound[1]} rounding bound")
        if user is None:
            return bound if self.pushes <= FORCED_PROBES else None
        return min(user, bound)

    def _check_server(self) -> None:
        """The embedded server's health, checked at every read of the worker's queue: one that died is restarted with
        the trainer's current weights, unless it died too often (then the run stops with its log's tail)."""
        server = self.session.server
        if server is not None and not server.alive() and self._may_restart():
            self._restart_server(self.state.model_version)
        self.session.check_server()

    def _reconnect(self, version: int, error: Exception) -> bool:
        """After a failed sync: restart an embedded server that died, or wait (up to vllm_server_timeout) for an external
        one to answer, join its transfer group anew (a restarted server has a new one) and sync `version` again.
        False when there is nothing to try (an embedded server alive, several ranks)."""
        session, args = self.session, self.args
        if self.ranks.several:
            return False
        if session.server is not None:
            if session.server.alive(wait_s=DYING_S):
                return False
            if not self._may_restart():
                session.check_server()  # it died too often: stop with its exit code and log
            self._restart_server(version)
            return True
        session.progress.say(f"the weight sync to {session.control.base_url} failed ({error}); syncing again once it "
                             f"answers (waiting up to vllm_server_timeout={args.vllm_server_timeout:g}s)")
        deadline = time.monotonic() + args.vllm_server_timeout
        while True:
            session.worker.raise_if_stopped()  # a worker that saw vLLM's engine die says so: no server will come back
            try:
                session.run(session.control.wait_healthy(min(RECONNECT_POLL_S, max(0.0, deadline - time.monotonic()))))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise ServerProblem(f"the weight sync failed: {server_gone(error, args.vllm_server_timeout)}") from None
        self.sync = choose_sync(session.control, session, self.served_name, self.model, args, self.lora, self.ranks)
        self.pushes = 0  # the server that came back may serve other weights: probe it as a new one
        self._push(version)
        self.window.add("rollout/server_reconnect_count", 1)
        return True

    def _may_restart(self) -> bool:
        """On one process, and fewer than SERVER_RESTARTS restarts in the last SERVER_RESTART_WINDOW_S."""
        now = time.monotonic()
        self.server_restarts = [t for t in self.server_restarts if now - t < SERVER_RESTART_WINDOW_S]
        return not self.ranks.several and len(self.server_restarts) < SERVER_RESTARTS

    def _restart_server(self, version: int) -> None:
        """Start the embedded server again where it was, serving the model as it is now under `version`: full weights
        from a folder they are written to, a LoRA adapter loaded on the base model. Requests in flight retry until
        it answers; a group that failed meanwhile is generated again."""
        session, start = self.session, time.perf_counter()
        self.server_restarts.append(time.monotonic())
        session.progress.say(f"the embedded tandem serve exited (code {session.server.process.poll()}); restarting it with "
                             f"the weights of step {self.state.step} (log: {session.server.log_path})")
        folder = self.served_path if self.lora else str(publish(self.model, self.output_dir / ".weights", "current", self.ranks))
        session.restart_server(folder)
        self.sync = choose_sync(session.control, session, self.served_name, self.model, self.args, self.lora, self.ranks)
        if self.lora:
            self.sync.push(self.model, version, announce=self._announce)
        else:
            self._announce(version)
        self.window.add("rollout/server_restart_count", 1)
        self.window.add("perf/server_restart_s", time.perf_counter() - start)

    def _announce(self, version: int) -> None:
        """Called by the sync once the server serves `version`: the groups started from now on sample from it."""
        if self.session.worker is not None:
            self.session.worker.channels.model_version.value = version

    # ---- setup ----------------------------------------------------------------------------------
    def _restore(self, resume: Path | None) -> None:
        """Weights, optimizer, schedule and counters from the checkpoint `resume` (resharded to this run's ranks), or
        fresh counters."""
        self.state = checkpoint.load(resume, self.model, self.optimizer, self.scheduler) if resume is not None else TrainerState()
        self.resume_point = checkpoint.load_resume_point(resume) if resume is not None else ResumePoint(0)
        self.window, self.losses, self.reward_history = MetricWindow(), [], []

    def _connect(self, resumed: bool) -> None:
        """Reach the server, check the data fits it, bring it to our weights, then start the worker. Rank 0 talks to
        the server and owns the worker; every rank takes part in the saves and syncs."""
        args, session, main = self.args, self.session, self.ranks.main
        self.served_path = self._served_path() if args.vllm_server_base_url is None else None
        if main:
            url = args.vllm_server_base_url or session.start_server(self.served_path, self.output_dir / "server.log",
                                                                    self._server_args())
            control = session.connect(url)
            facts = session.run(server_checks.read_facts(control))
            server_checks.check(facts, url, served_dtype(self.model))
            self.probe_bound = max(self.probe_bound, (OFF_POLICY_BOUND.get(facts.dtype, 0.0), facts.dtype))
            max_model_len = session.run(control.max_model_len())
            served_name = self._served_name()
            self.sync = choose_sync(control, session, served_name, self.model, args, self.lora, self.ranks)
        kind, max_model_len, served_name = self.ranks.broadcast((type(self.sync), max_model_len, served_name) if main else None)
        if not main:
            self.sync = follower_sync(kind, self.output_dir, served_name, args.max_staleness, self.ranks)
        self.token_budget = args.token_budget or max_model_len
        self.probe_tokens = max(1, min(sync_check.PROBE_TOKENS, max_model_len - len(self.probe_prompt)))
        self.batcher = TokenBudgetBatcher(self.token_budget, num_rows=self.ranks.world_size, layout=self.layout,
                                          max_samples=args.per_device_train_batch_size)
        self._check_prompt_lengths(max_model_len)
        if resumed or args.vllm_server_base_url is not None or self.lora:
            self._push(self.state.model_version)  # the server must sample from our weights
        if not main:
            return
        config = args.to_dict() | {"compute_dtype": self.compute_dtype}  # tandem doctor's rounding bound
        session.open_sinks(args.report_to, self.output_dir, config, args.max_steps if args.max_steps > 0 else None,
                           dashboard=not args.disable_tqdm)
        self.served_url, self.served_name = url, served_name
        worker = self._start_worker(self.resume_point)
        self.source = SampleSource(worker, worker.channels, self.window, resume=self.resume_point,
                                   max_staleness=args.max_staleness, token_budget=self.token_budget,
                                   end_position=self._num_positions(), regenerate=self._regenerate,
                                   health_check=self._check_server, stall_timeout=args.stall_timeout,
                                   say=session.progress.say, stop=self.preempted.is_set, restart_worker=self._restart_worker,
                                   on_stall=self._log_stalled)

    def _start_worker(self, point: ResumePoint):
        """The rollout worker, generating from `point` on (its start, leaving out what the trainer holds past it)."""
        spec = self._worker_spec(self.served_url, self.served_name, point)
        return self.session.start_worker(spec, self.args.rollout_worker_timeout, self.state.model_version)

    def _restart_worker(self, point: ResumePoint):
        """A new worker where a lost one left off (the sample source asks once); returns its inbox and counters."""
        lost = self.session.worker
        lost.stop()
        worker = self._start_worker(point)
        worker.channels.tokens_per_step.value = lost.channels.tokens_per_step.value
        return worker, worker.channels

    def _regenerate(self, position: int) -> None:
        self.session.worker.channels.retry.put(position)

    def _served_path(self) -> str:
        """A folder with exactly the trainer's weights for the embedded server: the model's own, or a saved copy."""
        if Path(self.model_name).is_dir():
            return self.model_name
        source = str(self.output_dir / ".weights" / "initial")
        self.save_model(source)
        return source

    def _server_args(self) -> list[str]:
        args = self.args
        extra = ["--served-model-name", self.model_name, "--logprobs-mode", "processed_logprobs",
                 "--max-logprobs", str(max(20, args.num_sampler_logprobs)), "--dtype", served_dtype(self.model),
                 "--max-num-seqs", str(min(256, args.max_concurrent_rollouts))]
        if args.uses_truncated_sampling:  # each token's kept set, to renormalise the trainer's log-probs over it
            extra += ["--enable-scale-out", "--return-sampling-mask"]
        if self.lora:
            extra += lora_server_flags(args.max_staleness, self.model.peft_config["default"].r)
        else:  # full weights stream over a gloo group: faster than the reload (benchmarks/weight_sync.py)
            extra += ["--weight-transfer-config", json.dumps({"backend": "gloo"}),
                      "--weight-transfer-timeout-s", str(args.vllm_server_timeout)]
        if args.vllm_server_host != "127.0.0.1":
            extra += ["--host", args.vllm_server_host]
        if args.vllm_server_api_key:
            extra += ["--api-key", args.vllm_server_api_key]
        if args.trust_remote_code:
            extra += ["--trust-remote-code"]
        return extra

    def _served_name(self) -> str:
        served = [m["id"] for m in self.session.run(self.session.control.models())]
        if self.model_name in served:
            return self.model_name
        warnings.warn(f"the server does not serve a model named {self.model_name!r}; generating with {served[0]!r}, "
                      "its first model. Start it with --served-model-name to silence this.", stacklevel=4)
        return served[0]

    def _check_prompt_lengths(self, max_model_len: int) -> None:
        """Every dataset prompt (with the tools' schemas) leaves room to generate; an environment's reset() may add more."""
        schemas = [tool_schema(tool) for tool in self.tools] or None
        rows = first_rows(self.dataset, PROMPTS_MEASURED) if is_iterable(self.dataset) else self.dataset or []
        for index, row in enumerate(rows):
            if not row.get("prompt"):
                continue
            length = len(render_chat(self.tokenizer, row["prompt"], tools=schemas, chat_template_kwargs=self.args.chat_template_kwargs))
            if length >= max_model_len:
                raise ValueError(f"train_dataset row {index}: the prompt renders to {length} tokens, but the server's "
                                 f"max_model_len is {max_model_len}, leaving no room to generate. Start the server with a "
                                 "larger --max-model-len, or drop the long prompts from the dataset.")

    def _num_positions(self) -> int | None:
        """Where the prompt stream ends: epochs × rows; None for an endless stream (max_steps decides, or environments
        sample their own tasks)."""
        if self.args.max_steps > 0 or self.dataset is None:
            return None
        return math.ceil(self.args.num_train_epochs * len(self.dataset))

    def _first_prompt(self) -> list[dict]:
        """A prompt for the sync probe: the dataset's first, or a fixed one when environments make the prompts."""
        row = next(iter(first_rows(self.dataset, 1)), {})
        return row.get("prompt") or [{"role": "user", "content": "What is 2 + 2?"}]

    def _check_agents(self) -> bool:
        """Tools and environments, checked before any training work; returns whether an environment owns a reward."""
        validate_tools(self.tools)
        labels = {f"tool {getattr(tool, '__name__', tool)!r}": tool for tool in self.tools}
        factories = factories_of(self.environment_factory)
        labels |= {f"environment_factory {name!r}" if name else "environment_factory": f for name, f in factories.items()}
        check_picklable(labels)
        if self.environment_factory is None:
            return False
        return any(callable(getattr(cls, "get_reward", None))
                   for cls in validate_environments(self.environment_factory, self.tools, self.dataset))

    def _use_training_template(self) -> None:
        """Multi-turn rollouts re-render the conversation every turn; a template that renders earlier turns differently
        once the conversation grows makes every turn fork. Known families get a training-safe template."""
        schemas = [tool_schema(tool) for tool in self.tools] or None
        problem = check_prefix_preserving(self.tokenizer, schemas, self.args.chat_template_kwargs)
        if problem is None:
            return
        known = training_chat_template(self.tokenizer)
        if known is None:
            warnings.warn(f"the chat template is not prefix-preserving ({problem}) and tandem has no training template for "
                          "it: multi-turn rollouts will fork at every re-rendered turn (rollout/fork_frac). Pass a "
                          "processing_class whose chat_template renders earlier turns unchanged.", stacklevel=3)
            return
        family, self.rollout_template = known
        print(f"tandem: the chat template is not prefix-preserving ({problem}); training with tandem's {family} training "
              "template, which renders earlier turns unchanged")

    def _worker_spec(self, url: str, served_name: str, point: ResumePoint) -> WorkerSpec:
        args = self.args
        tokenizer_path = self.output_dir / ".tokenizer"
        tokenizer = copy.copy(self.tokenizer)  # the training template renders rollouts; checkpoints keep the model's own
        tokenizer.chat_template = self.rollout_template or self.tokenizer.chat_template
        tokenizer.save_pretrained(tokenizer_path)
        settings = RolloutSettings(
            config=args, model_name=served_name, tokenizer_path=str(tokenizer_path), dataset=self.dataset,
            reward_funcs=self.reward_funcs, eos_token_ids=eos_ids(self.tokenizer, self.model), base_url=url,
            tools=self.tools, environment_factory=self.environment_factory, api_key=args.vllm_server_api_key,
            dataset_start_index=point.start, received=point.received, queued_tokens=point.queued_tokens,
            full_step_tokens=self.token_budget * args.gradient_accumulation_steps, num_positions=self._num_positions(),
            eval_dataset=self.eval_dataset,
            adapter_name=ADAPTER_NAME if isinstance(self.sync, LoraSync) else None)
        return WorkerSpec(loop_cls=self.loop_cls, settings=settings)


def check_eval_dataset(eval_dataset, args: AsyncGRPOConfig, environments: bool):
    """The eval prompts, when evaluation is asked for and they can be generated; neither is silently ignored."""
    if eval_dataset is None:
        if args.eval_strategy != "no" or args.eval_on_start:
            raise ValueError(f"eval_strategy={args.eval_strategy!r} / eval_on_start={args.eval_on_start} needs an "
                             "eval_dataset (prompts generated and scored, never trained): pass one to AsyncGRPOTrainer, "
                             "or an eval_dataset key in the recipe")
        return None
    if args.eval_strategy == "no" and not args.eval_on_start:
        warnings.warn("an eval_dataset was given but eval_strategy='no' and eval_on_start=False: it is never evaluated. "
                      "Set eval_strategy='steps' (every eval_steps steps) or eval_on_start=True.", stacklevel=3)
    if is_iterable(eval_dataset):
        raise ValueError("eval_dataset is an IterableDataset: each evaluation generates all of it, so it needs a length. "
                         "Take a fixed set of rows, e.g. Dataset.from_list(list(eval_dataset.take(256))).")
    try:
        return check_dataset(eval_dataset, environments=environments)
    except ValueError as exc:
        raise ValueError(f"eval_dataset: {exc}".replace("train_dataset", "eval_dataset")) from None


def _reward_list(reward_funcs, environment_rewards: bool) -> list:
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs else []
    if not funcs and not environment_rewards:
        raise ValueError("reward_funcs is empty and no environment defines get_reward(): pass at least one reward function "
                         "(e.g. tandem.rewards.accuracy_reward), or give the environment a get_reward() method")
    for func in funcs:
        if not callable(func):
            raise TypeError(f"reward function {func!r} is not callable; pass functions, not {type(func).__name__}")
    return funcs


@contextmanager
def on_sigterm(enabled: bool, flag: threading.Event):
    """While training with `enabled` (enable_jit_checkpoint): SIGTERM, a scheduler's preemption notice, sets `flag`
    instead of killing the process, so the loop checkpoints the step it is in and stops. The previous handler is
    restored after. Signals reach only the main thread: elsewhere this does nothing."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: flag.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
