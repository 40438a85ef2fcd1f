"""Continuous batching for `tandem serve`: requests join and leave the running batch between steps.

One engine thread owns the model. Each step it admits waiting requests into free KV slots
(prefilling each prompt once, then copying its KV to the request's `n` sequences), decodes one
token for every running sequence, and retires the finished ones. Everything that changes the
model (weight reloads, adapter loads) runs on that thread between steps through `call()`, so a
forward pass never sees half-loaded weights.

With the prefix cache (prefix_cache.py) a prompt's cached leading blocks are copied into its row and
only the rest is prefilled, as a window of the row like a decode step's: each row rounds as in a full
forward, so exact decoding matches a teacher-forced forward with the cache wherever it does without it.
A sequence's blocks are stored once prefilled and again when it retires.

A model with layers that carry state across tokens (gated DeltaNet, Mamba) has no prefix cache and no slots: each
sequence decodes on its own through transformers' cache (kv_cache.SequenceStates), or, in exact mode, forwards its
whole sequence every step, as the trainer does. A vision-language model serves its language model, text only.
"""

import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from tandem.errors import UsageError
from tandem.kernels import exact_attention, onednn_linear
from tandem.model import architecture
from tandem.serve import decode_attention
from tandem.serve.emission import Emission
from tandem.serve.kv_cache import SequenceStates, SlotKVCache, kv_shapes
from tandem.serve.lora import AdapterSet
from tandem.serve.model_runner import ModelRunner
from tandem.serve.prefix_cache import PrefixCache
from tandem.serve.requests import EngineRequest, EngineStats, Sequence

ENGINE_STOPPED = "The generation engine has stopped: see the server log."
MAX_PREFILL_TOKENS = 8192
"""Prompt tokens prefilled in one step at most, so running sequences keep decoding while many arrive."""
logger = logging.getLogger("tandem.serve")


def _min_rows(model: torch.nn.Module, exact: bool) -> int:
    """Rows every matmul of a decode step needs: exact decoding's MATMUL_ROWS on a CPU (16 where MKL's strict mode is
    off), at least oneDNN's EXACT_ROWS where layers run on it; 1 otherwise (the probes are of CPU kernels). Warns when
    MKL is there but the mode is not (set otherwise, or torch ran a matmul before tandem was imported)."""
    if not exact or next(model.parameters()).device.type != "cpu":
        return 1
    if not exact_attention.ROWS_ROUND_ALIKE and torch.backends.mkl.is_available():
        logger.warning(
            "tandem serve: exact decoding without MKL's strict reproducible mode pads every matmul to %d "
            "rows, and layers 1024 or more wide may still round unlike the trainer's forward; start the "
            "process with MKL_CBWR=AUTO,STRICT (or import tandem before torch's first matmul)",
            exact_attention.MIN_ROWS,
        )
    if any(onednn_linear.routed(module) for module in model.modules()):
        return max(exact_attention.MATMUL_ROWS, onednn_linear.EXACT_ROWS)
    return exact_attention.MATMUL_ROWS


def kv_cache_for(model: torch.nn.Module, max_model_len: int) -> SlotKVCache:
    """A KV cache shaped for the model's layers and heads, on its device and in its dtype."""
    layers = kv_shapes(model).layers
    shapes = set(layers.values())
    if len(shapes) != 1:
        raise UsageError(
            f"{type(model).__name__}: its layers store keys and values of differing shapes "
            f"({sorted(shapes)}), which tandem serve's one KV tensor cannot hold; generate with vllm serve"
        )
    if sorted(layers) != list(range(architecture.transformers_model(model).config.get_text_config().num_hidden_layers)):
        raise UsageError(
            f"{type(model).__name__}: only layers {sorted(layers)} store keys and values (the others share "
            "them), which tandem serve's KV cache cannot follow; generate with vllm serve"
        )
    param = next(model.parameters())
    return SlotKVCache(len(layers), *shapes.pop(), max_model_len, param.dtype, param.device)


def caches_for(
    model: torch.nn.Module, max_model_len: int, exact: bool, prefix_tokens: int | None, recompute: bool = False
):
    """The slot KV cache, or each sequence's state for a model with recurrent layers; and the prefix cache of up to
    `prefix_tokens` tokens (None: off, and always off with recurrent layers: no cached block holds their state).
    `recompute`: the cache is computed again after each weight update, which transformers' own cannot be."""
    scanning = architecture.scanning_layers(model)
    if scanning and recompute and not exact:
        raise UsageError(
            "--recompute-kv-cache-after-weight-updates: this model's recurrent layers decode through transformers' "
            "own cache, which tandem serve cannot compute again; use --decode-mode exact (it forwards every "
            "sequence whole each step, so each token comes from the weights of its step)"
        )
    if not scanning:
        return kv_cache_for(model, max_model_len), PrefixCache(prefix_tokens) if prefix_tokens is not None else None
    if prefix_tokens is not None:
        logger.warning(
            "tandem serve: %s carry state across tokens, which no cached block of keys and values holds: "
            "prefix caching is off, and each sequence decodes on its own, %s",
            ", ".join(scanning),
            "forwarded whole every step (exact mode)" if exact else "through transformers' own cache",
        )
    return SequenceStates(reforward=exact), None


def with_serving_kernels(model: torch.nn.Module, exact: bool) -> torch.nn.Module:
    """The model with the kernels it decodes with: on a CPU, its large linear layers on oneDNN (as the trainer's
    forward); its attention exact (`exact`: rows round as in a full forward) or the CPU's decode kernel; a model with
    attention extras (sinks, soft-capping) keeps its own."""
    model = architecture.without_hub_kernels(model)
    cpu = next(model.parameters()).device.type == "cpu"
    if cpu:
        onednn_linear.install(model, exact=exact, reorder=True)
    if not architecture.attention_extras(model):
        language_model = architecture.transformers_model(model)
        if exact:
            language_model.set_attn_implementation(exact_attention.NAME)
        elif cpu and language_model.config._attn_implementation == "sdpa":
            language_model.set_attn_implementation(decode_attention.NAME)
    return model


@dataclass
class StepDelay:
    """Extra seconds per decode step (`step_delay_s`): lets benchmarks stand in a slower (GPU-sized) server. The wait
    comes between steps, so weight reloads do not sit behind it; a pause stops its clock (a paused GPU computes
    nothing, so the rest of the wait comes after the resume)."""

    seconds: float
    next_step_at: float = 0.0
    left_at_pause: float = 0.0

    def rest(self) -> float:
        """Seconds until the next step may run (0 or less: now)."""
        return self.next_step_at - time.monotonic()

    def stepped(self) -> None:
        self.next_step_at = time.monotonic() + self.seconds

    def pause(self) -> None:
        self.left_at_pause = max(0.0, self.rest())

    def resume(self) -> None:
        self.next_step_at = time.monotonic() + self.left_at_pause


class Engine:
    """Continuous batching over one model: requests are submitted from any thread, one engine thread runs the steps."""

    paused = False
    weight_version = "default"
    """The served weights' label (`/finish_weight_update`'s weight_version), set on the engine thread between steps."""
    error: BaseException | None = None
    """What ended the engine thread: the server answers /health with 503 from then on."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_model_len: int,
        eos_token_id: int | None,
        extra_stop_token_ids: collections.abc.Sequence[int] = (),
        max_num_seqs: int = 256,
        logprobs_mode: str = "raw_logprobs",
        adapters: AdapterSet | None = None,
        exact: bool = False,
        step_delay_s: float = 0.0,
        prefix_caching: bool = True,
        prefix_cache_max_tokens: int | None = None,
        recompute_kv_cache: bool = False,
    ):
        self.emission = Emission(logprobs_mode, eos_token_id, frozenset(extra_stop_token_ids), max_model_len)
        model = with_serving_kernels(model, exact)
        self.max_model_len, self.max_num_seqs, self.adapters, self.exact = max_model_len, max_num_seqs, adapters, exact
        self.delay, self.device = StepDelay(step_delay_s), next(model.parameters()).device
        bound = max_num_seqs * max_model_len if prefix_cache_max_tokens is None else prefix_cache_max_tokens
        prefix_tokens = bound if prefix_caching else None
        self.cache, self.prefix_cache = caches_for(model, max_model_len, exact, prefix_tokens, recompute_kv_cache)
        # keys and values to compute again after a weight update (a sequence forwarded whole each step has none)
        self.recompute_kv_cache = recompute_kv_cache and isinstance(self.cache, SlotKVCache)
        min_rows = _min_rows(model, exact)
        self.runner = ModelRunner(
            model, self.cache, max_model_len=max_model_len, min_rows=min_rows, exact=exact, adapters=adapters
        )
        """The forward passes (model_runner.py); it holds the model, which an adapter load may replace (peft wraps it)."""
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.rows: list[tuple[EngineRequest, Sequence]] = []
        self.prefilling: list[EngineRequest] = []
        self.lengths: list[int] = []
        self.counters, self.finished_total = collections.Counter[str](), collections.Counter[str]()
        self._lock = threading.Condition()
        """Guards what other threads touch: `waiting`, `paused`, the flags and the published stats. The running rows,
        their lengths, the counters and the prefix cache are the engine thread's alone."""
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._abort_running = False
        """Set by abort_all: the engine thread aborts its running rows at the next step boundary."""
        self._stepping = False
        """The engine thread is between taking work and publishing its stats (a request it admitted is in neither)."""
        self._stats = self._snapshot()
        """The engine thread's figures as of its last step, published for /metrics (read whole, never mid-step)."""
        self._touched: dict[int, EngineRequest] = {}
        """Requests a step changed, told (`notify`) once its figures are published: a client that has its answer
        finds it counted in /metrics."""
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        """Set on the engine thread only (a `call`), as every change of the model is."""
        self.runner.model = model

    # ---- public, thread-safe -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, request: EngineRequest) -> None:
        with self._lock:
            self.waiting.append(request)
            self._lock.notify_all()

    def abort(self, request: EngineRequest) -> None:
        """End the request's sequences with finish_reason 'abort' at the next step boundary."""
        with self._lock:
            request.aborted = True
            self._lock.notify_all()

    def abort_all(self) -> None:
        """End every request submitted so far with finish_reason 'abort': the waiting ones now, the running ones at the
        next step boundary (the engine thread owns the rows)."""
        with self._lock:
            for request in self.waiting:
                request.aborted = True
            self._abort_running = True
            self._lock.notify_all()

    def set_paused(self, paused: bool) -> None:
        """Stop or restart the steps; a pause also stops the clock of a simulated slow step (`StepDelay`)."""
        with self._lock:
            if paused and not self.paused:
                self.delay.pause()
            elif self.paused and not paused:
                self.delay.resume()
            self.paused = paused
            self._lock.notify_all()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two steps; returns a future of its result (failed if the engine died)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:
                future.set_exception(RuntimeError(ENGINE_STOPPED))
            else:
                self._calls.put((fn, future))
                self._lock.notify_all()
        return future

    def idle(self) -> bool:
        with self._lock:
            if self.error is not None:  # a dead engine runs nothing (its requests were failed)
                return True
            return not (self.waiting or self._abort_running or self._stepping or self._stats.running)

    def stats(self) -> EngineStats:
        """The engine thread's figures as of its last step, and the queue as it is now."""
        with self._lock:
            return replace(self._stats, waiting=sum(r.n for r in self.waiting))

    def _snapshot(self) -> EngineStats:
        """The figures only the engine thread changes (called on it, or before it starts)."""
        cache = self.prefix_cache
        return EngineStats(
            running=len(self.rows),
            waiting=0,
            kv_used_tokens=sum(self.lengths),
            kv_capacity_tokens=self.max_num_seqs * self.max_model_len,
            prompt_tokens_total=self.counters["prompt_tokens"],
            generation_tokens_total=self.counters["generation_tokens"],
            preemptions_total=0,
            finished_total=dict(self.finished_total),
            prefix_cache_queries_total=cache.queries if cache else 0,
            prefix_cache_hits_total=cache.hits if cache else 0,
            prefix_cache_tokens=cache.num_tokens if cache else 0,
        )

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache. Run it on the engine thread (through `call`) whenever the weights change."""
        if self.prefix_cache:
            self.prefix_cache.clear()

    def weights_changed(self) -> None:
        """The weights were changed in place: the prefix cache is dropped and copies made for oneDNN follow. On the
        engine thread, between steps."""
        self.reset_prefix_cache()
        onednn_linear.forget(self.model)
        if self.recompute_kv_cache and self.rows:  # the running sequences' next tokens: the new weights' exactly
            histories = [self._cached_tokens(i) for i in range(len(self.rows))]
            self.runner.recompute(histories, [request.adapter for request, _ in self.rows], self._adapters_in_use())

    # ---- engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and self._calls.empty() and not self._has_work():
                        self._lock.wait(timeout=0.5)
                    if self._stopping:
                        return
                    rest = self.delay.rest()
                    if rest > 0 and self._calls.empty():  # a simulated slow step; control calls cut it short
                        self._lock.wait(timeout=rest)
                        continue
                    self._stepping = True
                with torch.inference_mode():  # no autograd bookkeeping: ~10% of a CPU decode step
                    self._run_calls()
                    self._retire_aborted()
                    if not self.paused and self.delay.rest() <= 0:
                        self._guarded_step()
                    stats = self._snapshot()
                with self._lock:
                    self._stats, self._stepping = stats, False
                self._notify_touched()
        except BaseException as exc:  # the server reports a dead engine through /health
            self.error = exc
            self._notify_touched()
            with self._lock:
                for request in list(self.waiting) + self.prefilling + [r for r, _ in self.rows]:
                    for seq in request.sequences:
                        seq.finish_reason = seq.finish_reason or "error"
                    request.notify()
                while not self._calls.empty():
                    self._calls.get()[1].set_exception(RuntimeError(ENGINE_STOPPED))
            raise

    def _notify_touched(self) -> None:
        touched, self._touched = list(self._touched.values()), {}
        for request in touched:
            request.notify()

    def _has_work(self) -> bool:
        aborted = self._abort_running or any(r.aborted for r in self.waiting) or any(r.aborted for r, _ in self.rows)
        return aborted or (not self.paused and bool(self.waiting or self.rows))

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn, future = self._calls.get()
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _guarded_step(self) -> None:
        """One step. An exception inside it fails the requests it ran (each client gets a 500, the log the traceback)
        and the engine goes on serving: their rows and the prefix cache are dropped, waiting requests keep their place."""
        try:
            self.step()
        except Exception as exc:  # noqa: BLE001 - reported to the failed requests' callers and logged
            logger.exception("tandem serve: a step failed; its requests are answered with an error, the engine goes on")
            reason = f"The generation engine failed while serving this request ({type(exc).__name__}: {exc}); see the server log."
            ran = {id(r): r for r in self.prefilling + [r for r, _ in self.rows]}
            for request in ran.values():
                request.error = request.error or reason
                self._finish_request(request, "error")
            self.rows, self.lengths, self.prefilling = [], [], []
            self.reset_prefix_cache()

    def step(self) -> None:
        """Admit and prefill new requests, then decode one token for every running row."""
        self.prefilling = self._admit()
        if self.prefilling:
            self._prefill(self.prefilling)
        self.prefilling = []
        if self.rows:
            self._decode()

    def _retire_aborted(self) -> None:
        with self._lock:
            if self._abort_running:
                for request, _ in self.rows:
                    request.aborted = True
                self._abort_running = False
            dropped = [r for r in self.waiting if r.aborted]
            self.waiting = collections.deque(r for r in self.waiting if not r.aborted)
        for request in dropped:
            self._finish_request(request, "abort")
        finished = {i for i, (request, _) in enumerate(self.rows) if request.aborted}
        for i in finished:
            self._finish_request(self.rows[i][0], "abort")
        self._retire(finished)

    def _finish_request(self, request: EngineRequest, reason: str) -> None:
        for seq in request.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = reason
                self.finished_total[reason] += 1
        self._touched[id(request)] = request

    def _admit(self) -> list[EngineRequest]:
        """FIFO into free slots; a request whose adapter would exceed max_loras waits (deferred)."""
        admitted: list[EngineRequest] = []
        free, budget = self.max_num_seqs - len(self.rows), MAX_PREFILL_TOKENS
        active_adapters = self._adapters_in_use()
        with self._lock:
            for request in list(self.waiting):
                if request.n > free or (admitted and len(request.prompt) > budget):
                    break
                if self.adapters and request.adapter and not self.adapters.can_join(active_adapters, request.adapter):
                    continue
                self.waiting.remove(request)
                admitted.append(request)
                free -= request.n
                budget -= len(request.prompt)
                if request.adapter:
                    active_adapters.add(request.adapter)
        return [r for r in admitted if self._load_adapter(r, active_adapters)]

    def _load_adapter(self, request: EngineRequest, in_use: set[str]) -> bool:
        """Load the request's adapter before it runs; a failure (its files gone, say) fails that request alone."""
        if not (self.adapters and request.adapter):
            return True
        try:
            self.model = self.adapters.ensure_loaded(self.model, {request.adapter}, in_use)
            return True
        except Exception as exc:  # noqa: BLE001 - reported to the request's caller; the model is as it was
            request.error = f"Loading lora {request.adapter} failed: {exc}"
            self._finish_request(request, "error")
            return False

    def _adapters_in_use(self) -> set[str]:
        """The adapters of the running rows: loading another must keep them."""
        return {r.adapter for r, _ in self.rows if r.adapter}

    def _prefill(self, requests: list[EngineRequest]) -> None:
        # A request asking for prompt log-probs needs logits at every prompt position: prefill it alone.
        alone = [r for r in requests if r.params.prompt_logprobs is not None]
        shared = [r for r in requests if r.params.prompt_logprobs is None]
        leaders, followers = self.prefix_cache.split_shared(shared) if self.prefix_cache else (shared, [])
        for group in [g for g in (leaders, followers) if g] + [[r] for r in alone]:
            self._prefill_group(group)

    def _prefill_group(self, requests: list[EngineRequest]) -> None:
        """Prefill each prompt once (batched) past its cached blocks; a request's other sequences get copies of its KV row."""
        base, n = len(self.rows), len(requests)
        lengths = [len(r.prompt) for r in requests]
        self.cache.ensure_rows(base + sum(r.n for r in requests))
        windows = [r.prompt[self._load_prefix(r, base + j) :] for j, r in enumerate(requests)]
        prompt_logprobs = requests[0].params.prompt_logprobs  # a request asking for them is prefilled alone
        logits = self.runner.window_forward(
            windows,
            lengths,
            slice(base, base + n),
            [r.adapter for r in requests],
            self._adapters_in_use(),
            prompt_logprobs is not None,
        )[:n]
        if prompt_logprobs is not None:
            requests[0].prompt_logprobs = self.emission.prompt_logprobs(
                logits[0, -lengths[0] :], requests[0].prompt, prompt_logprobs
            )
        self.counters["prompt_tokens"] += sum(lengths)
        for j, request in enumerate(requests):
            request.created_cache_tokens = self._store_prefix(base + j, request, request.prompt)

        new_rows = [(request, request.sequences[0]) for request in requests]
        new_lengths = list(lengths)
        last_logits = [logits[j, -1] for j in range(n)]
        for j, request in enumerate(requests):
            start = base + len(new_rows)
            self.cache.copy_row(base + j, range(start, start + len(request.sequences) - 1), lengths[j])
            for seq in request.sequences[1:]:
                new_rows.append((request, seq))
                new_lengths.append(lengths[j])
                last_logits.append(logits[j, -1])
        self.rows += new_rows
        self.lengths += new_lengths
        self._emit(range(base, len(self.rows)), torch.stack(last_logits))

    def _load_prefix(self, request: EngineRequest, row: int) -> int:
        return self.prefix_cache.load_prompt(request, self.cache, row) if self.prefix_cache is not None else 0

    def _store_prefix(self, row: int, request: EngineRequest, tokens: list[int]) -> int:
        return self.prefix_cache.store_row(request, tokens, self.cache, row) if self.prefix_cache is not None else 0

    def _decode(self) -> None:
        """One new token per running sequence."""
        totals = [length + 1 for length in self.lengths]
        windows = [[seq.output[-1]] for _, seq in self.rows]
        logits = self.runner.window_forward(
            windows, totals, slice(0, len(self.rows)), [r.adapter for r, _ in self.rows], self._adapters_in_use()
        )
        self.lengths = totals
        self._emit(range(len(self.rows)), logits[: len(self.rows), -1])
        self.delay.stepped()

    def _emit(self, rows: collections.abc.Sequence[int], logits: torch.Tensor) -> None:
        """Sample one token for each of `rows` from its logits (emission.py), count it, retire finished rows."""
        entries = [self.rows[i] for i in rows]
        reasons = self.emission.emit(entries, [self.lengths[i] + 1 for i in rows], logits, self.weight_version)
        self.finished_total.update(reason for reason in reasons if reason)
        self.counters["generation_tokens"] += sum(reason != "error" for reason in reasons)
        for request, _ in entries:
            self._touched[id(request)] = request
        self._retire({i for i, reason in zip(rows, reasons) if reason})

    def _cached_tokens(self, row: int) -> list[int]:
        """The tokens whose keys and values row `row` holds: its prompt and output, but the last sampled token."""
        request, seq = self.rows[row]
        return (request.prompt + seq.output)[: self.lengths[row]]

    def _retire(self, finished: set[int]) -> None:
        """Store the finished rows' blocks in the prefix cache (their last sampled token has no KV), then free the rows."""
        for i in finished:
            self._store_prefix(i, self.rows[i][0], self._cached_tokens(i))
        self._compact(finished)

    def _compact(self, finished: set[int]) -> None:
        """Drop finished rows, moving live rows from the tail into the holes so rows 0..n-1 stay live."""
        if not finished:
            return
        keep = len(self.rows) - len(finished)
        holes = sorted(i for i in finished if i < keep)
        movers = [i for i in range(keep, len(self.rows)) if i not in finished]
        for src, dst in zip(movers, holes):
            self.cache.copy_row(src, range(dst, dst + 1), self.lengths[src])
            self.rows[dst], self.lengths[dst] = self.rows[src], self.lengths[src]
        del self.rows[keep:], self.lengths[keep:]
