"""`AsyncGRPOTrainer`: trains on rollouts while the worker keeps generating them.

One loop, read top to bottom in `train()`: start (or reach) the generation server, start the
rollout worker, then repeat — take samples from the queue into rows, forward and backward each row,
step the optimizer, push the new weights to the server, log, checkpoint — until `max_steps` or the
last epoch. The worker and the trainer share only the queue and a few numbers (channels.py).
"""

import asyncio
import math
import time
import warnings
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tandem.config import AsyncGRPOConfig
from tandem.generation.client import ControlClient, GenerationClient
from tandem.generation.launcher import EmbeddedServer
from tandem.losses.flash_reinforce import flash_reinforce_loss
from tandem.losses.grpo import TokenStats, clipped_surrogate
from tandem.losses.score_centering import score_centered
from tandem.metrics.sinks import ProgressLine, make_sinks
from tandem.metrics.window import MetricWindow
from tandem.packing import PackedRow
from tandem.packing import attention as tree_attention
from tandem.packing.logprobs import check_head, row_logprobs
from tandem.rollout.loop import AsyncRolloutLoop
from tandem.rollout.records import Sample
from tandem.rollout.worker import RolloutWorker, WorkerSpec, check_picklable
from tandem.tasks import TINY_MODEL_PATH
from tandem.trainer import checkpoint, sync_check
from tandem.trainer.batching import TokenBudgetBatcher
from tandem.trainer.weight_sync import ADAPTER_NAME, LoraSync, ReloadSync, lora_server_flags

POLL_S = 0.05


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    metrics: dict


class PositionLedger:
    """Which prompt positions are finished (all their samples trained or discarded, or skipped); the
    watermark — the first unfinished position — is where a resumed run starts."""

    def __init__(self, start: int):
        self.watermark = start
        self.remaining: dict[int, int] = {}
        self.done: set[int] = set()
        self.finished: list[int] = []
        """Every finished position, in order (what a run covered)."""

    def finish(self, position: int) -> None:
        self.finished.append(position)
        self.done.add(position)
        while self.watermark in self.done:
            self.done.remove(self.watermark)
            self.watermark += 1

    def consume(self, sample: Sample) -> None:
        left = self.remaining.get(sample.position, sample.group_samples) - 1
        self.remaining[sample.position] = left
        if left == 0:
            del self.remaining[sample.position]
            self.finish(sample.position)


class AsyncGRPOTrainer:
    loop_cls = AsyncRolloutLoop

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None):
        self.args = args or AsyncGRPOConfig()
        for name, value, issue in (("callbacks", callbacks, "trainer callbacks"),
                                   ("tools", tools, "tool calling"), ("environment_factory", environment_factory, "environments")):
            if value:
                raise NotImplementedError(f"{name}: {issue} is not implemented in tandem yet; remove {name} to train")
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs] if reward_funcs else []
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty: pass at least one reward function (e.g. tandem.rewards.accuracy_reward)")
        for func in self.reward_funcs:
            if not callable(func):
                raise TypeError(f"reward function {func!r} is not callable; pass functions, not {type(func).__name__}")
        self.dataset = _check_dataset(train_dataset)
        self.model_name, self.model = _load_model(model, self.args)
        self.lora = peft_config is not None
        if self.lora:
            self.model = _with_adapter(self.model, peft_config)
        self.tokenizer = processing_class or AutoTokenizer.from_pretrained(self.model_name if isinstance(model, str) else model.name_or_path)
        self.tools, self.environment_factory = tools, environment_factory
        self.optimizer, self.scheduler = optimizers
        self.device = next(self.model.parameters()).device
        model_coef = getattr(self.model.config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0
        self.aux_loss_coef = self.args.router_aux_loss_coef if self.args.router_aux_loss_coef is not None else model_coef
        self.kernel = self.args.tree_attention_kernel or tree_attention.default_kernel(self.device)
        if self.kernel == "flex" and self.device.type != "cuda":
            raise ValueError("tree_attention_kernel='flex' needs a GPU: FlexAttention has no backward pass on CPU. "
                             "Use 'exact' or 'sdpa'.")

    # ---- public ---------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None) -> TrainOutput:
        args = self.args
        check_picklable({"reward function": f for f in self.reward_funcs} | {"loop_cls": self.loop_cls})
        torch.manual_seed(args.seed)
        self.output_dir = Path(args.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        resume = checkpoint.resolve(resume_from_checkpoint, self.output_dir)
        if resume is not None and self.lora:
            set_peft_model_state_dict(self.model, load_file(resume / "adapter_model.safetensors"))
        elif resume is not None:
            self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(resume, dtype=self.model.dtype).state_dict())
        self._make_optimizer()
        state = checkpoint.load_state(resume, self.optimizer, self.scheduler) if resume else checkpoint.TrainerState(0, 0, 0, 0)
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()

        self.runner = asyncio.Runner()
        self.server = None
        self.worker = None
        self.sinks = []
        self.progress = None
        self.probe = None
        try:
            url = self._start_server()
            self.control = ControlClient(url, timeout_s=args.vllm_server_timeout)
            self.runner.run(self.control.wait_healthy(args.vllm_server_timeout))
            max_model_len = self.runner.run(self.control.max_model_len())
            self.token_budget = args.token_budget or max_model_len
            self.batcher = TokenBudgetBatcher(self.token_budget)
            self._check_prompt_lengths(max_model_len)
            self.served_name = self._served_name()
            self.sync = self._weight_sync()
            if resume is not None or self.server is None or self.lora:
                self._push(state.model_version)  # the server must sample from our weights
            self.sinks = make_sinks(args.report_to, self.output_dir, args.run_name, args.to_dict())
            self.worker = self._start_worker(url, state.dataset_start_index, state.model_version)
            return self._loop(state)
        finally:
            if self.progress:
                self.progress.close()
            if self.worker:
                self.worker.stop()
            for sink in self.sinks:
                sink.close()
            for client in (getattr(self, "control", None), self.probe):
                if client:
                    self.runner.run(client.close())
            self.runner.close()
            if self.server:
                self.server.stop()

    def save_model(self, output_dir: str | None = None) -> None:
        target = Path(output_dir or self.args.output_dir)
        self.model.save_pretrained(target, safe_serialization=True)
        self.tokenizer.save_pretrained(target)

    # ---- setup ----------------------------------------------------------------------------------
    def _make_optimizer(self) -> None:
        args = self.args
        if self.optimizer is None:
            trainable = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter only
            self.optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                               eps=args.adam_epsilon, weight_decay=args.weight_decay)
        if self.scheduler is None:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(args))

    def _start_server(self) -> str:
        args = self.args
        if args.vllm_server_base_url:
            return args.vllm_server_base_url
        source = self.model_name
        if not Path(source).is_dir():  # a model object or hub id: serve exactly the trainer's weights
            source = str(self.output_dir / ".weights" / "initial")
            self.save_model(source)
        extra = ["--served-model-name", self.model_name, "--logprobs-mode", "processed_logprobs",
                 "--max-logprobs", str(max(20, args.num_sampler_logprobs)), "--dtype", _served_dtype(self.model),
                 "--max-num-seqs", str(min(256, args.max_concurrent_rollouts))]
        if args.uses_truncated_sampling:  # each token's kept set, to renormalise the trainer's log-probs over it
            extra += ["--enable-scale-out", "--return-sampling-mask"]
        if self.lora:
            extra += lora_server_flags(args.max_staleness, self.model.peft_config["default"].r)
        self.server = EmbeddedServer(source, log_path=self.output_dir / "server.log", extra_args=extra)
        return self.server.url

    def _weight_sync(self):
        """Adapter-only sync when training LoRA and the server can serve the adapter; the whole model otherwise."""
        reload = ReloadSync(self.control, self.output_dir, self.runner, self.served_name)
        if not self.lora:
            return reload
        info = self.runner.run(self.control.server_info()).get("vllm_config")
        info = info if isinstance(info, dict) else {}
        lora = info.get("lora_config")
        rank, needed = self.model.peft_config["default"].r, self.args.max_staleness + 2
        flags = " ".join(lora_server_flags(self.args.max_staleness, rank))
        obstacle = _adapter_sync_obstacle(self.model.peft_config, lora, (info.get("parallel_config") or {}), flags)
        if obstacle:
            warnings.warn(f"LoRA: syncing the merged model (every weight, every sync) instead of the adapter alone: "
                          f"{obstacle}", stacklevel=3)
            return reload
        if lora.get("max_loras", needed) < needed or lora.get("max_lora_rank", rank) < rank:
            raise ValueError(f"the server holds max_loras={lora.get('max_loras')} adapters of rank <= {lora.get('max_lora_rank')}; "
                             f"this run needs {needed} (max_staleness + 2) of rank {rank}. Restart it with {flags}")
        return LoraSync(self.control, self.output_dir, self.runner, keep=self.args.max_staleness + 1)

    def _push(self, version: int) -> dict[str, float]:
        """Sync the weights as `version`; with `weight_sync_check_atol` set, check the server now samples from them."""
        timings = self.sync.push(self.model, version, announce=self._announce)
        atol = self.args.weight_sync_check_atol
        if atol is not None:
            if self.probe is None:  # the client and the probe's prompt (the first row's), made at the first sync
                self.probe = GenerationClient(self.control.base_url, timeout_s=self.args.vllm_server_timeout)
                self.probe_prompt = self._prompt_ids(self.dataset[0]["prompt"])
            gap = self.runner.run(sync_check.sync_gap(self.probe, self.sync.name_for(version), self.model, self.probe_prompt,
                                                      self.kernel))
            sync_check.check(gap, atol)
            timings["weight_sync/served_logprob_gap"] = gap.max_abs
        return timings

    def _announce(self, version: int) -> None:
        """Called by the sync once the server serves `version`: the groups started from now on sample from it."""
        if self.worker:
            self.worker.channels.model_version.value = version

    def _served_name(self) -> str:
        served = [m["id"] for m in self.runner.run(self.control.models())]
        if self.model_name in served:
            return self.model_name
        warnings.warn(f"the server does not serve a model named {self.model_name!r}; generating with {served[0]!r}, "
                      "its first model. Start it with --served-model-name to silence this.", stacklevel=3)
        return served[0]

    def _prompt_ids(self, prompt: list[dict]) -> list[int]:
        """A conversational prompt as the token ids the worker sends (chat template, generation prompt added)."""
        return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False,
                                                  **(self.args.chat_template_kwargs or {}))

    def _check_prompt_lengths(self, max_model_len: int) -> None:
        for index, row in enumerate(self.dataset):
            ids = self._prompt_ids(row["prompt"])
            if len(ids) >= max_model_len:
                raise ValueError(f"train_dataset row {index}: the prompt renders to {len(ids)} tokens, but the server's "
                                 f"max_model_len is {max_model_len}, leaving no room to generate. Start the server with a "
                                 "larger --max-model-len, or drop the long prompts from the dataset.")

    def _start_worker(self, url: str, start: int, version: int) -> RolloutWorker:
        args = self.args
        n = len(self.dataset)
        spec = WorkerSpec(
            loop_cls=self.loop_cls, config=args, model_name=self.served_name, tokenizer_path=self._tokenizer_path(),
            dataset=self.dataset, reward_funcs=self.reward_funcs, eos_token_ids=_eos_ids(self.tokenizer, self.model),
            base_url=url, api_key=None, tools=self.tools, environment_factory=self.environment_factory,
            dataset_start_index=start, full_step_tokens=self.token_budget * args.gradient_accumulation_steps,
            num_positions=None if args.max_steps > 0 else math.ceil(args.num_train_epochs * n),
            adapter_name=ADAPTER_NAME if isinstance(self.sync, LoraSync) else None,
        )
        worker = RolloutWorker(spec, args.rollout_worker_timeout)
        worker.channels.model_version.value = version  # a resumed run's first groups sample from its current version
        worker.start()
        return worker

    def _tokenizer_path(self) -> str:
        path = self.output_dir / ".tokenizer"
        self.tokenizer.save_pretrained(path)
        return str(path)

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self, state: checkpoint.TrainerState) -> TrainOutput:
        args = self.args
        self.state = state
        self.ledger = PositionLedger(state.dataset_start_index)
        self.buffer: deque[Sample] = deque()
        self.window = MetricWindow()
        self.ended = False
        self.losses: list[float] = []
        self.reward_history: list[float] = []
        self.progress = ProgressLine(args.max_steps if args.max_steps > 0 else None)
        metrics: dict = {}
        while args.max_steps <= 0 or state.step < args.max_steps:
            step_start = time.perf_counter()
            rows = self._take_rows()
            if not rows:
                break
            self._train_step(rows, step_start)
            if state.step % args.logging_steps == 0:
                metrics = self._log()
            if args.save_strategy == "steps" and state.step % args.save_steps == 0:
                self._checkpoint()
        if self.window.values:  # what came in after the last log (drops while the worker finished)
            metrics = self._log()
        if args.save_strategy != "no" and state.step > 0:
            self._checkpoint()
        mean_loss = sum(self.losses) / len(self.losses) if self.losses else 0.0
        return TrainOutput(state.step, mean_loss, metrics)

    def _pull(self, timeout_s: float) -> None:
        """Take one message off the worker queue. Samples are taken only as rows need them: what the
        trainer has taken no longer counts against the worker's allowance (see _take_rows)."""
        message = self.worker.get(timeout_s)
        if message is not None:
            kind, payload = message
            if kind == "samples":
                self.buffer.extend(payload)
            elif kind == "skip":
                self.ledger.finish(payload)
            elif kind == "metrics":
                self.window.extend(payload)
            elif kind == "end":
                self.ended = True
        if self.server is not None and not self.server.alive():
            raise RuntimeError(f"the embedded tandem serve exited (code {self.server.process.poll()}):\n{self.server.tail()}")

    def _next_sample(self) -> Sample | None:
        """The next usable sample (waiting for the worker if needed); None once the worker has finished."""
        waited = 0.0
        while True:
            if not self.buffer:
                if self.ended:
                    return None
                start = time.perf_counter()
                self._pull(POLL_S)
                waited += time.perf_counter() - start
                continue
            sample = self.buffer[0]
            staleness = self.state.model_version - sample.model_version
            if staleness > self.args.max_staleness:
                self._discard(self.buffer.popleft(), "sample/dropped_stale_count")
                continue
            if sample.num_tokens > self.token_budget:
                warnings.warn(f"a sample of {sample.num_tokens} tokens exceeds token_budget={self.token_budget}: dropped",
                              stacklevel=2)
                self._discard(self.buffer.popleft(), "batch/dropped_oversize_count")
                continue
            self.waited += waited
            return sample

    def _discard(self, sample: Sample, counter: str) -> None:
        self.window.add(counter, 1)
        self.ledger.consume(sample)
        self._consumed(sample)

    def _consumed(self, sample: Sample) -> None:
        """The sample left the queue for good: the worker may generate its tokens again."""
        self.worker.channels.consumed_tokens.value += sample.num_tokens

    def _take_rows(self) -> list[PackedRow]:
        """gradient_accumulation_steps micro-batches (one row each, one process), each closed by the token-budget
        batcher when the next sample fits nowhere. A sample counts as consumed once it is placed in a row."""
        rows = []
        self.waited = 0.0
        self.window.add("rollout/queue_size", len(self.buffer) + self.worker.channels.out.qsize())
        for _ in range(self.args.gradient_accumulation_steps):
            while (sample := self._next_sample()) is not None and self.batcher.offer(sample):
                self._consumed(self.buffer.popleft())
            micro_batch = self.batcher.close()
            if not micro_batch:
                break
            self._record_micro_batch(micro_batch)
            rows += micro_batch
        return rows

    def _record_micro_batch(self, rows: list[PackedRow]) -> None:
        """Row metrics: each row, and the balance of the micro-batch's rows across ranks."""
        w, lengths, loads = self.window, [r.num_tokens for r in rows], [r.load for r in rows]
        w.add("batch/samples_per_row", *[len(r.samples) for r in rows])
        w.add("batch/row_tokens_mean", *lengths)
        w.add("batch/row_tokens_max", *lengths)
        w.add("batch/row_fill_frac", *[n / self.token_budget for n in lengths])
        w.add("batch/packing_ratio", *[r.packing_ratio for r in rows])
        w.add("batch/row_imbalance", max(loads) / (sum(loads) / len(loads)))
        w.add("batch/pad_frac", 1 - sum(lengths) / (len(rows) * max(lengths)))

    def _train_step(self, rows: list[PackedRow], step_start: float) -> None:
        args, state = self.args, self.state
        fwd_bwd_start = time.perf_counter()
        total_loss = 0.0
        if args.algorithm == "flash_reinforce":
            for row, coefficients in zip(rows, self._flash_coefficients(rows)):
                total_loss += self._flash_row_backward(row, coefficients)
        else:
            for row in rows:
                total_loss += self._row_backward(row, len(rows))
        fwd_bwd = time.perf_counter() - fwd_bwd_start
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
        opt_start = time.perf_counter()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - opt_start
        state.step += 1
        self.losses.append(total_loss)

        samples = [s for row in rows for s in row.samples]
        tokens = sum(row.num_tokens for row in rows)
        trained = sum(row.num_trained for row in rows)
        predicting = sum(row.predict_index.unique().numel() for row in rows)
        for sample in samples:
            self.ledger.consume(sample)
            self.window.add("sample/staleness_mean", state.model_version - sample.model_version)
            self.window.add("sample/staleness_max", state.model_version - sample.model_version)
            self.window.add("sample/time_in_queue_s", time.time() - sample.created_at)
            self.window.add("sample/forwarded_tokens_mean", sample.num_tokens)
            self.window.add("sample/forwarded_tokens_max", sample.num_tokens)
            self.window.add("sample/trained_tokens_mean", sample.num_trained)
        channels = self.worker.channels
        channels.tokens_per_step.value = sum(row.raw_tokens for row in rows)  # what the worker generated for this step
        state.num_tokens += tokens
        state.dataset_start_index = self.ledger.watermark

        if state.step % args.weight_sync_steps == 0:
            timings = self._push(state.model_version + 1)
            state.model_version += 1
            for name, value in timings.items():
                self.window.add(name, value)
        step_s = time.perf_counter() - step_start
        w = self.window
        w.add("loss", total_loss)
        w.add("grad_norm", float(grad_norm))
        w.add("learning_rate", self.scheduler.get_last_lr()[0])
        w.add("perf/step_s", step_s)
        w.add("perf/fwd_bwd_s", fwd_bwd)
        w.add("perf/optimizer_s", optimizer_s)
        w.add("perf/rollout_wait_s", self.waited)
        w.add("perf/fwd_bwd_forwarded_tokens_per_s", (tokens, fwd_bwd))
        w.add("perf/wall_clock_forwarded_tokens_per_s", (tokens, step_s))
        w.add("perf/wall_clock_trained_tokens_per_s", (trained, step_s))
        w.add("perf/fwd_bwd_trained_tokens_per_s", (trained, fwd_bwd))
        w.add("batch/forwarded_tokens_per_step", tokens)
        w.add("batch/trained_tokens_per_step", trained)
        w.add("batch/samples_per_step", len(samples))
        w.add("batch/groups_per_step", len({s.group_id for s in samples}))
        w.add("batch/microbatches_per_step", len(rows))
        w.add("batch/masked_token_frac", 1 - predicting / tokens)

    def _forward(self, row: PackedRow):
        """The row's log-probs with gradients (bf16 autocast where configured), timed as perf/fwd_s."""
        start = time.perf_counter()
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if _use_bf16(self.args, self.device) else nullcontext()
        with autocast:
            scored = row_logprobs(self.model, row, self.kernel, self.args.temperature)
        self.window.add("perf/fwd_s", time.perf_counter() - start)
        return scored

    def _row_backward(self, row: PackedRow, num_rows: int) -> float:
        """Forward and backward one packed row; returns its share of the step's loss."""
        args = self.args
        scored = self._forward(row)
        logprobs = scored.logprobs
        old, advantages = row.old_logprobs.to(self.device), row.advantages.to(self.device)
        bounds = {"epsilon_low": args.epsilon, "epsilon_high": args.epsilon_high,
                  "clip_min": args.vllm_importance_sampling_clip_min, "clip_max": args.vllm_importance_sampling_clip_max}
        if args.score_centering:
            if row.top_ids is None:
                raise ValueError("score_centering=True needs the sampler's top log-probs of every sampled token, and these "
                                 "samples have none: a custom generate_one/generate_one_turn must request "
                                 "logprobs=num_sampler_logprobs (or set score_centering=False)")
            losses, stats, mass = score_centered(logprobs, old, advantages, scored.extra,
                                                 row.top_sampler_logprobs.to(self.device), **bounds)
            self.window.add("sampling/sampler_mass", *mass.tolist())
        else:
            losses, stats = clipped_surrogate(logprobs, old, advantages, **bounds)
        # Normalised by the trained tokens of the micro-batch, then averaged over the accumulated micro-batches.
        loss = losses.sum() / max(row.num_trained, 1) / num_rows
        if scored.aux_loss is not None:  # MoE: the router's load-balancing loss, with the model's coefficient by default
            self.window.add("aux_loss", float(scored.aux_loss))
            loss = loss + self.aux_loss_coef * scored.aux_loss / num_rows
        loss.backward()
        self._record_token_stats(row, logprobs.detach(), old, scored.entropy, stats)
        return loss.item()

    def _flash_coefficients(self, rows: list[PackedRow]) -> list[torch.Tensor]:
        """FlashREINFORCE over the whole optimizer batch (reference/flashreinforce_notes.md): its update is
        Σ_t c_t ∇log π_θ(a_t), with every c_t detached. A no-grad pass scores every trained token, then the
        reference loss — over one [trajectories, tokens] batch, a multi-turn rollout being one trajectory
        whatever rows its samples landed in — gives the c_t as the gradient of its loss."""
        args, terms = self.args, []  # (trajectory, row, term) for every trained token
        with torch.no_grad():
            scored = [row_logprobs(self.model, row, self.kernel, args.temperature) for row in rows]
        trajectories: dict[str, int] = {}
        for r, row in enumerate(rows):
            for t, s in enumerate(row.term_sample.tolist()):
                terms.append((trajectories.setdefault(row.samples[s].rollout_id, len(trajectories)), r, t))
        rewards = torch.zeros(len(trajectories))
        for row in rows:
            for sample in row.samples:
                rewards[trajectories[sample.rollout_id]] = sample.reward
        counts = torch.bincount(torch.tensor([i for i, _, _ in terms]), minlength=len(trajectories))
        width = int(counts.max())
        current, behavior, entropies = (torch.zeros(len(trajectories), width) for _ in range(3))
        mask = torch.zeros(len(trajectories), width, dtype=torch.bool)
        filled = [0] * len(trajectories)
        for i, r, t in terms:
            j, filled[i] = filled[i], filled[i] + 1
            current[i, j], behavior[i, j] = scored[r].logprobs[t].item(), rows[r].old_logprobs[t].item()
            entropies[i, j], mask[i, j] = scored[r].entropy[t].item(), True
        current.requires_grad_(True)
        loss, diagnostics = flash_reinforce_loss(
            current, behavior.clamp(max=0.0), rewards, mask, delta=args.flash_delta,
            negative_token_fraction=args.flash_negative_token_fraction, entropies=entropies, failures=rewards <= 0)
        loss.backward()
        w = self.window
        w.add("flash/acceptance_rate", float(diagnostics["acceptance_rate"]))
        w.add("flash/sequence_kl_mean", *diagnostics["sequence_kl"].tolist())
        w.add("flash/sequence_kl_max", float(diagnostics["sequence_kl"].max()))
        w.add("flash/retained_tokens_frac", float(diagnostics["retained_tokens"].sum() / diagnostics["policy_tokens"].sum()))
        coefficients = [torch.zeros(row.num_trained) for row in rows]
        filled = [0] * len(trajectories)
        for i, r, t in terms:
            coefficients[r][t] = current.grad[i, filled[i]]
            filled[i] += 1
        return coefficients

    def _flash_row_backward(self, row: PackedRow, coefficients: torch.Tensor) -> float:
        """Forward and backward one row with the FlashREINFORCE coefficients fixed for its tokens."""
        scored = self._forward(row)
        loss = (coefficients.to(self.device) * scored.logprobs).sum()
        loss.backward()
        logprobs, old = scored.logprobs.detach(), row.old_logprobs.to(self.device)
        ratio = torch.exp(logprobs - old)
        unclipped = torch.zeros_like(ratio, dtype=torch.bool)  # FlashREINFORCE neither clips nor masks tokens
        self._record_token_stats(row, logprobs, old, scored.entropy, TokenStats(ratio, ~unclipped, unclipped, unclipped))
        return loss.item()

    def _record_token_stats(self, row: PackedRow, logprobs, old, entropy, stats) -> None:
        w = self.window
        diff = (logprobs - old).abs()
        w.add("sampling/sampling_logp_difference/mean", *diff.tolist())
        w.add("sampling/sampling_logp_difference/max", float(diff.max()))
        w.add("sampling/importance_sampling_ratio/min", float(stats.ratio.min()))
        w.add("sampling/importance_sampling_ratio/mean", *stats.ratio.tolist())
        w.add("sampling/importance_sampling_ratio/max", float(stats.ratio.max()))
        w.add("sampling/masked_mean", *(~stats.in_bounds).float().tolist())
        w.add("entropy", *entropy.tolist())
        low, high = stats.low_clipped.float(), stats.high_clipped.float()
        w.add("clip_ratio/low_mean", *low.tolist())
        w.add("clip_ratio/high_mean", *high.tolist())
        w.add("clip_ratio/region_mean", *(low + high).tolist())
        per_sample = torch.zeros(len(row.samples)).index_add_(0, row.term_sample, torch.ones(row.num_trained))
        low_frac = torch.zeros(len(row.samples)).index_add_(0, row.term_sample, low.cpu()) / per_sample.clamp(min=1)
        high_frac = torch.zeros(len(row.samples)).index_add_(0, row.term_sample, high.cpu()) / per_sample.clamp(min=1)
        w.add("clip_ratio/low_min", float(low_frac.min()))
        w.add("clip_ratio/high_max", float(high_frac.max()))

    def _log(self) -> dict:
        examples = self.window.values.get("completions/examples")
        metrics = self.window.flush()
        metrics["num_tokens"] = self.state.num_tokens
        metrics["model_version"] = self.state.model_version
        metrics["epoch"] = self.ledger.watermark / len(self.dataset)
        if "reward" in metrics:
            self.reward_history.append(metrics["reward"])
        for sink in self.sinks:
            sink.log(self.state.step, metrics)
        self.progress.update(self.state.step, metrics)
        if examples:
            self.progress.print_completions(examples, self.args.num_completions_to_print)
        return metrics

    def _checkpoint(self) -> Path:
        return checkpoint.save(self.output_dir, self.model, self.tokenizer, self.optimizer, self.scheduler, self.state,
                               self.args.save_total_limit)


# ---- helpers ------------------------------------------------------------------------------------
def _check_dataset(dataset):
    if dataset is None:
        raise ValueError("train_dataset is required (environments that own their data are not implemented yet)")
    columns = getattr(dataset, "column_names", None) or (list(dataset[0]) if len(dataset) else [])
    if "prompt" not in columns:
        raise ValueError(f"train_dataset has no 'prompt' column (columns: {columns}). Each row needs a conversational "
                         "prompt: [{'role': 'user', 'content': '...'}]")
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty")
    for index in range(min(len(dataset), 8)):
        prompt = dataset[index]["prompt"]
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
            raise ValueError(f"train_dataset row {index}: 'prompt' must be conversational, a list of "
                             f"{{'role': ..., 'content': ...}} messages; got {type(prompt).__name__} {str(prompt)[:80]!r}. "
                             "Wrap plain text as [{'role': 'user', 'content': text}].")
    return dataset


def _load_model(model, args: AsyncGRPOConfig) -> tuple[str, PreTrainedModel]:
    """(name the server knows it by, the model ready to train) from a path, hub id, 'tiny' or a model object.
    Its attention is switched to tree attention, which every packed row needs."""
    if isinstance(model, str):
        name = TINY_MODEL_PATH if model == "tiny" else model
        kwargs = {"dtype": args.dtype, **(args.model_init_kwargs or {})}
        loaded = AutoModelForCausalLM.from_pretrained(name, **kwargs)
        if torch.cuda.is_available():
            loaded.to("cuda")
    elif isinstance(model, PreTrainedModel):
        name, loaded = model.name_or_path or "tandem-policy", model
    else:
        raise TypeError(f"model must be a path, a hub id, 'tiny' or a PreTrainedModel, not {type(model).__name__}")
    tree_attention.prepare(loaded)
    check_head(loaded)
    return name, loaded


def _with_adapter(model: PreTrainedModel, peft_config):
    """The model with a trainable LoRA adapter; the head stays untouched (the chunked log-prob head and the
    server's adapters both leave lm_head to the base weights)."""
    targets = peft_config.target_modules or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if any(t == "lm_head" or t.endswith(".lm_head") for t in targets) or "lm_head" in (peft_config.modules_to_save or []):
        raise ValueError("peft_config targets lm_head: tandem trains adapters on the transformer layers only (the "
                         "chunked log-prob head reads the base head). Remove lm_head from target_modules / modules_to_save.")
    return get_peft_model(model, peft_config)


def _adapter_sync_obstacle(peft_config: dict, lora_config: dict | None, parallel_config: dict, flags: str) -> str | None:
    """Why the server cannot serve this adapter by name (the merged model then travels instead), or None.
    vLLM serves single plain LoRA adapters: no DoRA, bias, modules_to_save, parameter targets or embeddings."""
    if len(peft_config) != 1:
        return f"the model has {len(peft_config)} adapters and a request names one. Train a single adapter."
    config = next(iter(peft_config.values()))
    if not lora_config:
        return f"the server was started without LoRA support. Restart it with {flags} to sync the adapter alone."
    data_parallel = parallel_config.get("data_parallel_size", 1)
    if data_parallel > 1:
        return (f"the server runs data_parallel_size={data_parallel}, and /v1/load_lora_adapter reaches only the rank "
                "that answers it: the others would serve the base model under the new name. Run replicas with "
                "--data-parallel-size 1 behind `tandem proxy`, which loads each adapter on every replica.")
    targets = config.target_modules or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = [("use_dora", getattr(config, "use_dora", False), "DoRA"),
                   ("bias", getattr(config, "bias", "none") != "none", f"bias={getattr(config, 'bias', None)!r}"),
                   ("modules_to_save", bool(config.modules_to_save), f"modules_to_save={config.modules_to_save}"),
                   ("target_parameters", bool(getattr(config, "target_parameters", None)), "target_parameters"),
                   ("target_modules", any("embed_tokens" in t for t in targets), "an adapter on embed_tokens")]
    for field_name, present, what in unsupported:
        if present:
            return f"vLLM does not serve {what} ({field_name} in the LoraConfig). Use a plain LoRA adapter to sync it alone."
    return None


def _served_dtype(model) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[next(model.parameters()).dtype]


def _eos_ids(tokenizer, model) -> list[int]:
    ids = {tokenizer.eos_token_id}
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)


def _use_bf16(args: AsyncGRPOConfig, device: torch.device) -> bool:
    return args.bf16 if args.bf16 is not None else device.type == "cuda"


def _schedule(args: AsyncGRPOConfig):
    warmup = args.warmup_steps * args.max_steps if 0 < args.warmup_steps < 1 else args.warmup_steps
    total = max(args.max_steps, 1)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if args.lr_scheduler_type in ("constant", "constant_with_warmup"):
            return 1.0
        progress = min(1.0, (step - warmup) / max(1.0, total - warmup))
        return 1.0 - progress if args.lr_scheduler_type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return factor
