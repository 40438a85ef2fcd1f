"""`Runtime`: the trainer's side of a run that is not the model — the generation server (embedded or external), the
rollout worker, the queue between them, the weight sync, and every rule for restarting, reconnecting and stopping.

The trainer calls it one way: `start`, then each step `next_micro_batches`, `wait_sync`, `trained`, `sync`, `publish`, sometimes
`evaluate` and `resume_point`, and `take_metrics` at each log. Nothing here calls the trainer: an embedded server that
dies is restarted with the weights of `spec.model` (the module the trainer trains; read here, never written), a lost
worker is replaced once, and a server that stays away ends the run with a `ServerProblem`.
"""

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from tandem.config import AsyncGRPOConfig, mapping
from tandem.contract.agents import EnvironmentFactories, Harness
from tandem.dataset_rows import Rows, RowTable
from tandem.generation.client import EngineDead, ServerProblem, engine_died
from tandem.generation.launcher import server_threads
from tandem.generation.server_facts import ServerFacts, read_facts
from tandem.metrics.window import MetricWindow
from tandem.model.distributed import Ranks
from tandem.packing import PackedRow
from tandem.rollout.worker import WorkerLost
from tandem.runtime import embedded_server, server_checks, sync_check
from tandem.runtime.rollout_inputs import num_prompts, worker_spec
from tandem.runtime.sample_source import POLL_S, ResumePoint, SampleSource
from tandem.runtime.session import DYING_S, Session
from tandem.runtime.step_rows import StepRows
from tandem.runtime.weight_sync import ADAPTER_NAME, LoraSync, WeightSync, choose_sync, follower_sync, write_weights
from tandem.runtime.weight_transfer import GlooPlane, InThread, TransferSync


@dataclass
class RuntimeSpec:
    """What the trainer decided and the runtime needs: plain values, the model it reads the weights from, and the
    user's rollout inputs (checked when the trainer was built)."""

    args: AsyncGRPOConfig
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    ranks: Ranks
    model_name: str
    """The model as the user named it: a folder the embedded server can load, or a hub id."""
    output_dir: Path
    layout: str
    kernel: str
    """The rows' layout and the attention kernel: the sync probe scores the served tokens as training does."""
    compute_dtype: str
    served_dtype: str
    eos_token_ids: list[int]
    lora_rank: int | None
    """The adapter's rank when training LoRA (None: full weights)."""
    dataset: Rows | None
    eval_dataset: RowTable | None
    reward_funcs: list
    tools: list
    environment_factory: EnvironmentFactories | None
    harness: Harness | None
    """Another library's episodes the loop class runs (an OpenEnv harness, a verifiers environment), or None."""
    loop_cls: type | None
    """The user's AsyncRolloutLoop subclass (None: AsyncRolloutLoop itself)."""
    rollout_template: str | None
    """A training-safe chat template the worker renders rollouts with (None: the tokenizer's own)."""


class Runtime:
    facts: ServerFacts
    """What the server said at connect (every rank holds rank 0's reading). It and the attributes below are set by
    `start`; `source`, `rows` and `served_url` on rank 0 only."""
    sync_strategy: WeightSync
    served_name: str
    served_url: str
    served_path: str | None  # the folder the embedded server loads (None: an external server)
    token_budget: int
    source: SampleSource
    rows: StepRows

    def __init__(self, spec: RuntimeSpec):
        self.spec, self.args, self.ranks = spec, spec.args, spec.ranks
        self.staleness = spec.args.staleness_policy
        self.lora = spec.lora_rank is not None
        self.session = Session(spec.args.vllm_server_timeout, spec.args.vllm_server_api_key)
        self.preempted = threading.Event()
        """Set by SIGTERM while training with enable_jit_checkpoint: the step in progress ends with a checkpoint."""
        self.window = MetricWindow()
        """The runtime's own records (syncs, drops, restarts): the trainer takes them at each log."""
        self.probe = sync_check.SyncProbe.of_run(spec.tokenizer, spec.dataset, spec.compute_dtype, spec.args)
        """Which syncs are probed, and how the server's log-probs are judged against the trainer's (sync_check.py)."""
        self.in_flight: tuple[int, InThread] | None = None
        """An overlapped sync: its version and its thread (`sync`, `wait_sync`)."""
        self.version = 0
        """The policy version the server samples from (what a restarted embedded server serves)."""
        self.step = 0
        """The trainer's last step: where a stall's worker metrics are logged."""
        self.worker_replaced = False
        """Whether the worker was lost and replaced already: a second loss stops the run."""
        self.restarts = embedded_server.Restarts()

    def __enter__(self) -> "Runtime":
        self.preempted.clear()
        self.session.__enter__()
        self.session.stack.enter_context(on_sigterm(self.args.enable_jit_checkpoint, self.preempted))
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.session.__exit__(*exc_info)
        finally:
            vars(self).pop("sync_strategy", None)  # its transfer group (sockets, threads) went with the server
            self.in_flight = None  # a sync left running by a failed step went with the server: not the next run's
            self.probe.client = None  # closed with the session: the next train() opens its own

    # ---- what the trainer calls ---------------------------------------------------------------------
    def start(self, version: int, resume: ResumePoint, resumed: bool) -> None:
        """Reach the server, check the data fits it, bring it to the trainer's weights, then start the worker from
        `resume`. Rank 0 talks to the server and owns the worker; every rank takes part in the syncs."""
        args, spec = self.args, self.spec
        self.version = version
        self.served_path = (
            embedded_server.served_folder(spec.model_name, spec.model, spec.tokenizer, spec.output_dir, self.ranks)
            if args.vllm_server_base_url is None
            else None
        )
        self._connect()
        max_model_len = self.facts.max_model_len
        self.token_budget = args.token_budget or max_model_len
        self.probe.fit(max_model_len)
        server_checks.check_prompt_lengths(
            spec.dataset, spec.tokenizer, spec.tools, mapping(args.chat_template_kwargs), max_model_len
        )
        self.probe.restart()
        if resumed or args.vllm_server_base_url is not None or self.lora:
            self._push(version)  # the server must sample from our weights
        if self.ranks.main:
            self._start_rollouts(resume)

    def _connect(self) -> None:
        """Rank 0 starts the embedded server (or reaches the configured one), reads its facts, checks them and
        chooses the weight sync from them; every rank learns the facts and takes its part of the sync."""
        args, session, spec, main = self.args, self.session, self.spec, self.ranks.main
        if main:
            device = next(spec.model.parameters()).device.type
            flags = embedded_server.server_flags(args, spec.model_name, spec.served_dtype, spec.lora_rank)
            self.served_url = args.vllm_server_base_url or session.start_server(
                self._embedded_folder(), spec.output_dir / "server.log", flags, server_threads(device)
            )
            control = session.connect(self.served_url)
            facts = session.run(read_facts(control))
            server_checks.check(facts, self.served_url, spec.served_dtype, args.recompute_kv_cache_after_weight_updates)
            server_checks.check_in_flight(args, facts, self.served_url, self.lora)
            self.probe.note_server_dtype(facts.dtype)  # rank 0 judges the probe
            served_name = server_checks.served_name(list(facts.served_names), spec.model_name)
            self.sync_strategy = choose_sync(
                control, session, facts, served_name, spec.model, args, self.lora, self.ranks
            )
        kind, self.facts, self.served_name = self.ranks.broadcast(
            (type(self.sync_strategy), facts, served_name) if main else None
        )
        self.probe.rescored = self.facts.scores_prompts  # sync_check.SyncProbe.rescored
        if not main:
            self.sync_strategy = follower_sync(kind, spec.output_dir, self.served_name, self.staleness, self.ranks)

    def _start_rollouts(self, resume: ResumePoint) -> None:
        """Rank 0: the run's metric sinks opened, the rollout worker started from `resume`, the queue read from it."""
        args, spec = self.args, self.spec
        config = args.to_dict() | {
            "compute_dtype": spec.compute_dtype,
            "server_dtype": self.facts.dtype,
        }  # tandem doctor's rounding bound
        max_steps = args.max_steps if args.max_steps > 0 else None
        self.session.open_sinks(args.report_to, spec.output_dir, config, max_steps, dashboard=not args.disable_tqdm)
        worker = self._start_worker(resume)
        self.source = SampleSource(
            worker,
            worker.channels,
            self.window,
            resume=resume,
            staleness=self.staleness,
            token_budget=self.token_budget,
            num_prompts=num_prompts(args, spec.dataset),
            stall_timeout=args.stall_timeout,
            say=self.session.say,
        )
        self.rows = StepRows(
            self.source,
            args,
            spec.layout,
            self.ranks.world_size,
            self.window,
            self._read,
            lambda metrics: self.session.log(self.step, metrics),
            self.preempted,
        )

    def next_micro_batches(self, version: int) -> list[list[PackedRow]]:
        """The step's micro-batches, taken from the queue (step_rows.py); their samples are consumed. Rank 0 only."""
        self._read(self.source.drain)
        self.window.add("rollout/queue_size", len(self.source.buffer))
        micro_batches = self.rows.take(version)
        if self.staleness.step_frees_room(sync_in_flight=self.in_flight is not None):
            self.source.release()
        return micro_batches

    def limit_token_budget(self, budget: int) -> None:
        """auto_find_batch_size packed a step out of device memory in rows of `budget` tokens: the steps after are
        packed so too, and a sample longer than that is dropped as oversize. Rank 0 only."""
        self.token_budget = budget
        self.rows.limit_token_budget(budget)

    def trained(self, rows: list[PackedRow], step: int) -> int:
        """Step `step` trained `rows`: their samples leave the queue for good. Returns the first unfinished
        prompt index (where a resumed run starts). Rank 0 only."""
        self.step = step
        self.source.trained([s for row in rows for s in row.samples])
        return self.source.ledger.watermark

    def publish(self, tokens_per_step: float) -> None:
        """The worker's next allowance, once the step's sync is done or started (sample_source.py). Rank 0 only."""
        self.source.publish(tokens_per_step)

    def sync(self, version: int, overlap: bool = False) -> None:
        """Bring the server to the trainer's weights as `version` (every rank calls it): a failure that a server brought
        back can cure is retried once it answers; one that it cannot stops the run. With `overlap`, a streamed sync on
        one process runs on a thread while the next step gathers and computes its gradients (~0.06 of a ~0.25 s demo
        step); `wait_sync` ends it, before anything changes the weights."""
        start = time.perf_counter()
        self.ranks.barrier()  # the gathers of the sync start when the slowest rank has finished its step
        waited = time.perf_counter() - start
        if overlap and (sync := self._overlappable()) is not None:
            self.in_flight = (version, sync.push_in_thread(self.spec.model, version, self._announce))
            return
        self._settle(version, lambda: self._push(version), waited)

    def wait_sync(self, record: bool = True) -> None:
        """The end of an overlapped sync (nothing when none runs): as `sync` ends, with its failures handled alike;
        without `record` its timings are left out (the run ended: no step's log is left to carry them)."""
        if self.in_flight is None:
            return
        version, call = self.in_flight
        self.in_flight = None

        def pushed() -> dict[str, float]:
            timings = call.result(None)  # the push bounds each of its waits
            self.probe.pushes += 1
            return timings if record else {}

        self._settle(version, pushed)

    def _overlappable(self) -> TransferSync | None:
        """The sync, when it may run beside the next step: on one process whose samples may be two versions behind
        (groups the worker starts while the sync runs sample from the last version and train two steps on), a gloo
        transfer (vLLM's NCCL buffers would add to the step's peak on the GPU), and no probe due after it (the probe
        forwards the model the next step trains)."""
        sync = self.sync_strategy
        if not isinstance(sync, TransferSync) or not isinstance(sync.plane, GlooPlane):
            return None
        alone = not self.ranks.several and self.staleness.syncs_may_overlap
        return sync if alone and not self.probe.due(self.probe.pushes + 1) else None

    def _settle(self, version: int, push, waited: float | None = None) -> None:
        """End a sync as `push()` returns: its timings recorded (with `perf/weight_sync_wait_s`, how long this thread
        waited for it: all of it, or what an overlapped one outlasted its step by), or its failure handled."""
        start = time.perf_counter()
        try:
            timings = push()
            if timings:
                timings["perf/weight_sync_wait_s"] = time.perf_counter() - start
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
            if self.staleness.sync_end_frees_room:
                self.source.release()  # the room taken meanwhile admits groups under the new weights
        self.version = version

    def evaluate(self, step: int, version: int) -> dict[str, list] | None:
        """The eval records of the prompts generated under `version`; None when the run is stopping. Rank 0 only."""
        self.source.ask_evaluation(step, version)
        while (records := self.source.evaluations.pop(step, None)) is None:
            if self.preempted.is_set():
                return None
            self._read(lambda: self.source.pull(POLL_S))
        return records

    def resume_point(self) -> ResumePoint:
        return self.source.resume_point()

    @property
    def rollout_wait_s(self) -> float:
        """Seconds waited for the worker so far (a counter: a step reads its growth)."""
        return self.source.wait_s

    @property
    def recomputes_kv_cache(self) -> bool:
        """The server computes its running sequences' caches again at each sync: no token comes from mixed weights."""
        return self.facts.recomputes_kv_cache

    def take_metrics(self) -> dict[str, list]:
        """The runtime's and the worker's records since the last call. Rank 0 only."""
        records = self.window.take()
        for name, values in self.source.worker_metrics.take().items():
            records.setdefault(name, []).extend(values)
        return records

    def preempted_everywhere(self) -> bool:
        """Whether any rank got SIGTERM (with enable_jit_checkpoint): every rank stops at the same step."""
        if not self.args.enable_jit_checkpoint:
            return False
        if self.ranks.several:
            return self.ranks.total(float(self.preempted.is_set())) > 0
        return self.preempted.is_set()

    # ---- the sync ---------------------------------------------------------------------------------
    def _push(self, version: int) -> dict[str, float]:
        """Sync the weights as `version` (every rank takes part), then, when a probe is due, check that the server now
        samples from them."""
        timings = self.sync_strategy.push(self.spec.model, version, announce=self._announce)
        probe = self.probe
        probe.pushes += 1
        if not probe.due(probe.pushes):
            return timings
        spec = self.spec
        gap = probe.probe(
            self.sync_strategy.name_for(version), self.session, self.ranks, spec.model, spec.kernel, spec.layout
        )
        timings["weight_sync/served_logprob_gap"] = gap.max_abs
        if probe.gave_up() and self.ranks.main:
            self.session.say(
                f"the sync probe could not tell the trained weights from the first probe's after "
                f"{probe.pushes} syncs (they moved less than the server's rounding): syncs are no "
                "longer probed; set weight_sync_check_atol to probe each one"
            )
        return timings

    def _announce(self, version: int, since: float) -> None:
        """The sync's word that the server serves `version` from monotonic time `since` on (ServedVersions)."""
        if self.session.worker is not None:
            self.session.worker.channels.served.mark(version, since)
            self.session.worker.channels.model_version.value = version

    # ---- a server that died or went away --------------------------------------------------------------
    def _check_server(self) -> None:
        """The embedded server's health, checked at every read of the worker's queue (with an overlapped sync's end): one
        that died is restarted with the current weights, unless it died too often (then the run stops with its log's
        tail)."""
        server = self.session.server
        if self.in_flight is not None and (self.in_flight[1].done or (server is not None and not server.alive())):
            self.wait_sync()  # an overlapped sync that ended (or will fail) is settled now: a failure as on this thread
            server = self.session.server  # (which restarts a dead server)
        if server is not None and not server.alive() and not self.ranks.several and self.restarts.allowed():
            self._restart_server(self.version)
        self.session.check_server()

    def _reconnect(self, version: int, error: Exception) -> bool:
        """After a failed sync: restart an embedded server that died, or wait (up to vllm_server_timeout) for an external
        one to answer, join its transfer group anew (a restarted server has a new one) and sync `version` again.
        False when there is nothing to try (an embedded server alive, several ranks)."""
        session = self.session
        if self.ranks.several:
            return False
        if session.server is not None:
            if session.server.alive(wait_s=DYING_S):
                return False
            if not self.restarts.allowed():
                session.check_server()  # it died too often: stop with its exit code and log
            self._restart_server(version)
            return True
        session.wait_for_server(error)
        self._choose_sync_anew()
        self.probe.restart()  # the server that came back may serve other weights: probe it as a new one
        self._push(version)
        self.window.add("rollout/server_reconnect_count", 1)
        return True

    def _choose_sync_anew(self) -> None:
        """The server came back (restarted, or answering again): its facts read anew, its sync chosen from them."""
        session, control = self.session, self.session.control
        assert control is not None, "connected at start"
        self.facts = session.run(read_facts(control))
        self.sync_strategy = choose_sync(
            control, session, self.facts, self.served_name, self.spec.model, self.args, self.lora, self.ranks
        )

    def _embedded_folder(self) -> str:
        assert self.served_path is not None, "start() gives the embedded server a folder"
        return self.served_path

    def _restart_server(self, version: int) -> None:
        """Start the embedded server again where it was, serving the model as it is now under `version`: full weights
        from a folder they are written to, a LoRA adapter loaded on the base model. Requests in flight retry until
        it answers; a group that failed meanwhile is generated again."""
        session, spec, start, server = self.session, self.spec, time.perf_counter(), self.session.server
        assert server is not None, "an embedded server to restart"
        self.restarts.note()
        session.say(
            f"the embedded tandem serve exited (code {server.process.poll()}); restarting it with "
            f"the weights of step {self.step} (log: {server.log_path})"
        )
        folder = (
            self._embedded_folder()
            if self.lora
            else str(write_weights(spec.model, spec.output_dir / ".weights", "current", self.ranks))
        )
        session.restart_server(folder)
        self._choose_sync_anew()
        if self.lora:
            self.sync_strategy.push(spec.model, version, announce=self._announce)
        else:
            self._announce(version, time.monotonic())
        self.window.add("rollout/server_restart_count", 1)
        self.window.add("perf/server_restart_s", time.perf_counter() - start)

    def _read(self, read):
        """`read()`, a read of the worker's queue, then the server's health: a worker lost without an error of its own
        (killed, hung) is replaced once; one that failed is named after the server, if that died first. While the run
        is stopping (the job's SIGTERM, which may end the worker and the server too) nothing is restarted, and a failed
        read returns None."""
        try:
            result = read()
        except Exception as error:
            if self.preempted.is_set():
                return None
            self._check_server()  # a server that died takes precedence
            if not isinstance(error, WorkerLost):
                raise
            self._replace_worker(error)
            return None
        if not self.preempted.is_set():
            self._check_server()
        return result

    # ---- the worker ---------------------------------------------------------------------------------
    def _start_worker(self, point: ResumePoint):
        """The rollout worker, generating from `point` on (its start, leaving out what the trainer holds past it)."""
        spec = worker_spec(
            self.spec,
            point,
            served_name=self.served_name,
            served_url=self.served_url,
            token_budget=self.token_budget,
            server=self.facts,
            world_size=self.ranks.world_size,
            adapter_name=ADAPTER_NAME if isinstance(self.sync_strategy, LoraSync) else None,
        )
        return self.session.start_worker(spec, self.args.rollout_worker_timeout, self.version)

    def _replace_worker(self, lost: WorkerLost) -> None:
        """Start a new worker where the lost one left off: from the watermark, leaving out the prompt indices already
        received, so nothing is generated twice; the groups it had in flight are generated again. Once per run."""
        if self.worker_replaced:
            raise lost
        self.worker_replaced = True
        point, old = self.source.resume_point(), self.session.worker
        assert old is not None, "the worker that was lost"
        old.stop()
        tokens_per_step = old.channels.tokens_per_step.value
        worker = self._start_worker(point)
        worker.channels.tokens_per_step.value = tokens_per_step
        self.source.replace_worker(worker, worker.channels)
        self.session.say(
            f"{lost}. Restarted it from prompt index {point.dataset_start_index}, leaving out the "
            f"{len(point.received)} prompt indices past it already received; a second loss stops the run."
        )


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


@contextmanager
def unless_preempted(preempted: threading.Event):
    """A failure while the run is stopping on SIGTERM (`preempted` set) is let go: the job's signal may have ended the
    server too, and the step trained is still checkpointed. Any other failure goes on up."""
    try:
        yield
    except Exception:
        if not preempted.is_set():
            raise
