"""Test a rollout loop or a trainer on their own.

`run_loop` runs an `AsyncRolloutLoop` (yours, with its hooks) against a generation server for a few prompts, the way
the trainer runs it, and returns what it produced:

    from tandem.testing import run_loop

    run = run_loop(MyLoop, train_dataset=rows, reward_funcs=[my_reward], num_prompts=4)
    assert run.groups and all(s.reward is not None for s in run.samples)
    assert run.metrics["rollout/tool_call_count"]

The loop runs in this process (a breakpoint in a hook stops there), against `tandem serve` started for the model, or
against the server at `base_url`. It reads and scores prompts exactly as in training: the same settings, the same
scheduler, the same records; only the trainer is absent, so the samples are taken as soon as they are sent.

`scripted(steps)` is the other half: a runtime for `AsyncGRPOTrainer.runtime_cls` that has no server and no worker
and hands the trainer the packed rows you give it, step by step, so a trainer-level test (a loss, a metric, a
callback, a checkpoint) runs `train()` in a second without generating anything.
"""

import asyncio
import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

from tandem.config import AsyncGRPOConfig
from tandem.contract.channels import Channels
from tandem.contract.records import Sample
from tandem.generation.client import ControlClient
from tandem.generation.launcher import EmbeddedServer
from tandem.generation.server_facts import read_facts
from tandem.packing import PackedRow
from tandem.rollout.loop import AsyncRolloutLoop
from tandem.rollout.settings import RolloutSettings
from tandem.runtime.sample_source import ResumePoint
from tandem.tasks import TINY_MODEL_PATH


@dataclass
class LoopRun:
    """What a loop produced: its kept groups' samples, the prompts it skipped, and every metric it recorded."""

    groups: list[list[Sample]] = field(default_factory=list)
    """The samples of each group sent to the trainer, in the order they were sent."""
    skipped: list[int] = field(default_factory=list)
    """The prompt indices whose group was not sent: filtered, its rewards all equal (GRPO), or failed."""
    metrics: dict[str, list] = field(default_factory=dict)
    """Every value recorded under each metric name (`self.record` in a hook, the scheduler's own), unreduced."""
    said: list[str] = field(default_factory=list)
    """The lines the loop printed for the user (a server that stopped answering, ...)."""

    @property
    def samples(self) -> list[Sample]:
        return [sample for group in self.groups for sample in group]


def run_loop(
    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop,
    *,
    train_dataset,
    reward_funcs: Sequence[Callable] = (),
    num_prompts: int | None = None,
    model: str = "tiny",
    base_url: str | None = None,
    args: AsyncGRPOConfig | None = None,
    tools: list | None = None,
    environment_factory=None,
    processing_class=None,
    timeout_s: float = 300.0,
) -> LoopRun:
    """Run `loop_cls` over the first `num_prompts` prompts of `train_dataset` (all of them when None) once each,
    scoring with `reward_funcs`, and return what it produced. `base_url` is a running server's (vLLM, tandem serve or
    tandem proxy); None starts `tandem serve` for `model` ("tiny": the project's tiny model) and stops it after.
    `args` are the run's settings (sampling, tools, pacing); `processing_class` the tokenizer (None: the model's)."""
    from transformers import AutoTokenizer

    args = args or AsyncGRPOConfig()
    path = TINY_MODEL_PATH if model == "tiny" else model
    tokenizer = processing_class or AutoTokenizer.from_pretrained(path)
    num_prompts = len(train_dataset) if num_prompts is None else num_prompts
    with ExitStack() as stack:
        if base_url is None:
            base_url = stack.enter_context(EmbeddedServer(path, extra_args=["--served-model-name", model])).url
        server = asyncio.run(_facts(base_url, args.vllm_server_api_key))
        settings = RolloutSettings(
            config=args,
            model_name=server.served_names[0],
            tokenizer_path=path,
            dataset=train_dataset,
            reward_funcs=list(reward_funcs),
            eos_token_ids=[tokenizer.eos_token_id],
            base_url=base_url,
            api_key=args.vllm_server_api_key,
            tools=list(tools or []),
            environment_factory=environment_factory,
            num_prompts=num_prompts,
            full_step_tokens=float(server.max_model_len),
            server=server,
        )
        channels = Channels.create(mp.get_context("spawn"))
        loop = loop_cls(settings, processing_class=tokenizer, channels=channels)
        return asyncio.run(asyncio.wait_for(_drive(loop, channels), timeout_s))


async def _facts(base_url: str, api_key: str | None):
    async with ControlClient(base_url, api_key=api_key) as control:
        await control.wait_healthy(60)
        return await read_facts(control)


async def _drive(loop: AsyncRolloutLoop, channels: Channels) -> LoopRun:
    """Run the loop and take its messages as the trainer would, until it says it has generated every prompt."""
    run = LoopRun()
    task = asyncio.ensure_future(loop.run())
    while True:
        while channels.out.empty():
            if task.done():
                task.result()  # the loop's own error, raised here
                if channels.out.empty():
                    raise RuntimeError("the loop ended without saying so (no 'end' message)")
            await asyncio.sleep(0.01)
        kind, payload = channels.out.get()
        if kind == "end":
            break
        if kind == "samples":
            run.groups.append(payload)
            channels.consumed_tokens.value += sum(s.num_tokens for s in payload)  # taken: room for the next groups
            channels.room.ring()
        elif kind == "skip":
            run.skipped.append(payload)
        elif kind == "metrics":
            for name, values in payload.items():
                run.metrics.setdefault(name, []).extend(values)
        elif kind == "say":
            run.said.append(payload)
        elif kind in ("server", "error"):
            raise RuntimeError(f"the rollout loop stopped: {payload}")
    channels.stop.set()
    await task
    return run


class ScriptedRuntime:
    """The trainer's runtime with no server and no worker: each step trains the next of `steps` (a step is a list of
    micro-batches, a micro-batch a list of `PackedRow`), and the run ends when they run out. What the trainer logs is
    kept in `logged` (one dict per log line) and what it says in `said`. Build one with `scripted`."""

    steps: list[list[list[PackedRow]]] = []

    def __init__(self, spec):
        self.spec, self.preempted = spec, threading.Event()
        self.remaining = iter(list(self.steps))
        self.logged: list[dict] = []
        self.said: list[str] = []
        self.session = _Session(self)
        self.rollout_wait_s = 0.0
        self.synced: list[int] = []
        """The policy versions the trainer synced, in order."""
        self.token_budgets: list[int] = []
        """The smaller token budgets auto_find_batch_size asked for, in order."""
        self.recomputes_kv_cache = False
        """As a server that keeps a running sequence's cache across a sync: tokens after it count as mixed."""

    def __enter__(self) -> "ScriptedRuntime":
        return self

    def __exit__(self, *exc_info) -> None:
        return None

    def start(self, version: int, resume: ResumePoint, resumed: bool) -> None:
        return None

    def next_micro_batches(self, version: int) -> list[list[PackedRow]]:
        return next(self.remaining, [])

    def trained(self, rows: list[PackedRow], step: int) -> int:
        return 0

    def limit_token_budget(self, budget: int) -> None:
        self.token_budgets.append(budget)

    def sync(self, version: int, overlap: bool = False) -> None:
        self.synced.append(version)

    def wait_sync(self, record: bool = True) -> None:
        return None

    def publish(self, tokens_per_step: float) -> None:
        return None

    def evaluate(self, step: int, version: int) -> dict[str, list]:
        return {}

    def resume_point(self) -> ResumePoint:
        return ResumePoint(0)

    def take_metrics(self) -> dict[str, list]:
        return {}

    def preempted_everywhere(self) -> bool:
        return False


class _Session:
    """The sinks and progress lines of a scripted run, kept on its runtime."""

    def __init__(self, runtime: ScriptedRuntime):
        self.runtime = runtime

    def log(self, step: int, metrics: dict) -> None:
        self.runtime.logged.append({"step": step, **metrics})

    def log_completions(self, step: int, examples, count: int) -> None:
        return None

    def say(self, line: str) -> None:
        self.runtime.said.append(line)

    def update(self, step: int, metrics: dict) -> None:
        return None


def scripted(steps: list[list[list[PackedRow]]]) -> type[ScriptedRuntime]:
    """A runtime class that trains `steps` (each a list of micro-batches of `PackedRow`), for
    `AsyncGRPOTrainer.runtime_cls`: `class Trainer(AsyncGRPOTrainer): runtime_cls = scripted([[[row]]])`."""
    return type("Scripted", (ScriptedRuntime,), {"steps": steps})
