"""Does the server now sample from the trainer's policy? A check run after a weight sync.

A fixed probe (a prompt and a short completion) is scored under the name the rollouts will use, and the server's
log-probs are compared with the trainer's own forward over the same tokens. In fp32 the two agree bit for bit with
tandem serve's exact decoding, and to rounding with vLLM's CPU kernels (~1e-5, a rare token 1.5e-4). A bf16 server's
rounding is far larger (0.06 RMS, 0.34 at a token, on the tiny model), so no bound on the gap alone tells it from a
missed sync; the trainer's log-probs under an earlier version do: a server that moved sits nearer the new ones.
"""

from dataclasses import dataclass

import torch

from tandem.chat.prompts import render_prompt
from tandem.contract.records import Sample
from tandem.dataset_rows import first_rows
from tandem.generation.client import GenerationClient, ServerError, ServerProblem
from tandem.metrics.doctor import rounding_bound
from tandem.model.distributed import Ranks
from tandem.packing import TREE, pack
from tandem.packing.log_probs import row_log_probs
from tandem.runtime.session import Session

PROBE_TOKENS = 16
PROBE_SEED = 1234
FORCED_PROBES = 8
"""Against an external server the syncs are probed, whatever the settings, until one shows the server moved with the
trainer's weights (at most this many: the connect push, then trained weights until they differ from the connect ones by
more than the server's rounding; again after a reconnect)."""
FORCED_ADAPTER_PROBES = 2
"""Where each probe samples its own completion, the forced probes end after the connect push and the first trained
weights."""
MARGIN = 3.0
"""A sync is judged once the trainer's new log-probs lie MARGIN times farther from the reference version's than the
served ones lie from the nearer of the two. From 2 on, the triangle inequality keeps rounding from carrying the served
log-probs nearer the wrong version; 3 leaves room for a rounding error that leans toward it."""


class SyncMismatch(ServerProblem):
    """The server's log-probs under the synced name are not the trainer's."""


@dataclass
class SyncGap:
    served_name: str
    tokens: int
    max_abs: float
    """The largest |served log-prob − trainer log-prob| over the probe's tokens."""
    mean_abs: float
    """Their mean, which rounding bounds (`metrics.doctor.OFF_POLICY_BOUND`)."""


def rms(values: torch.Tensor) -> float:
    return float(values.double().pow(2).mean().sqrt())


def moved(served: torch.Tensor, new: torch.Tensor, reference: torch.Tensor) -> bool | None:
    """Whether the server now serves the `new` weights (True) or still the `reference` version's (False), judged by
    which of the trainer's log-probs under each the `served` ones sit nearer; None while the two versions lie too close
    for the server's rounding to tell apart (then a missed sync also changes the policy by less than rounding)."""
    to_new, to_reference = rms(served - new), rms(served - reference)
    if rms(new - reference) <= MARGIN * min(to_new, to_reference):
        return None
    return to_new < to_reference


class SyncProbe:
    """Which syncs are probed and how they are judged. The probe is a fixed sequence: the prompt and a completion the
    server sampled at the first probe, scored by the server under the synced name and by the trainer.

    - With weight_sync_check_atol set, every sync is probed, and a gap above it at any token stops the run.
    - Against an external server, whatever the settings, each probe checks the server serves this model at all: a
      mean gap above the coarser dtype's rounding bound stops the run. The first probe since connect takes the
      trainer's log-probs as the reference; later ones ask whether the served log-probs moved with the trainer's
      (`moved`): a server that still serves the reference stops the run; one that moved ends the forced probes.

    `args` (the AsyncGRPOConfig) is read at each sync, as the runtime reads it."""

    def __init__(self, prompt: list[int], dtype: str, args):
        self.prompt, self.args = prompt, args
        self.dtypes: list[str | None] = [dtype]
        """The trainer's dtype, then the server's (`note_server_dtype`): the connect check takes the coarser bound."""
        self.tokens = PROBE_TOKENS
        """Shorter when the server's context has no room for the full probe (`fit`)."""
        self.completion: list[int] | None = None
        """The probe's completion, sampled by the server at the first probe and scored again at each later one."""
        self.rescored = True
        """Whether later probes score the first one's completion (prompt log-probs). Not against a vLLM started with
        --enable-lora: its CPU build's engine dies scoring a prompt there (its LoRA logits kernel), so each probe samples
        its own completion, and only the mean-gap bound can judge it (FORCED_ADAPTER_PROBES of them)."""
        self.client: GenerationClient | None = None
        """Opened by the runtime at the first probe."""
        self.restart()

    @classmethod
    def of_run(cls, tokenizer, dataset, dtype: str, args) -> "SyncProbe":
        """A run's probe: its dataset's first prompt (a fixed question without one), rendered as rollouts are."""
        first_prompt = next(iter(first_rows(dataset, 1)), {}).get("prompt")
        messages = first_prompt or [{"role": "user", "content": "What is 2 + 2?"}]
        return cls(render_prompt(tokenizer, messages, args.chat_template_kwargs), dtype, args)

    def restart(self) -> None:
        """A server reached anew (connect, reconnect): it may serve other weights, so it is probed as a new one."""
        self.pushes = 0
        """Weight syncs pushed since the server was reached."""
        self.reference: torch.Tensor | None = None
        """The trainer's log-probs of the completion at the first probe since the server was reached."""
        self.settled = False
        """Whether a probe saw the server move with the trainer's weights (no more forced probes)."""

    def note_server_dtype(self, dtype: str) -> None:
        """The server's dtype, read at connect on rank 0, which judges the probes."""
        self.dtypes.append(dtype)

    def fit(self, max_model_len: int) -> None:
        """A probe as long as the server's context leaves room for after the prompt (at least one token), and one token
        more: scoring it asks for one (vLLM refuses a request that leaves no room to generate)."""
        self.tokens = max(1, min(PROBE_TOKENS, max_model_len - len(self.prompt) - 1))

    def due(self, push: int) -> bool:
        """Whether the `push`-th sync since the server was reached is probed."""
        if self.args.weight_sync_check_atol is not None:
            return True
        return self.args.vllm_server_base_url is not None and not self.settled and push <= FORCED_PROBES

    def gave_up(self) -> bool:
        """Whether the last forced probe has passed without the versions lying far enough apart to judge it."""
        return (
            self.args.vllm_server_base_url is not None
            and self.reference is not None
            and self.rescored
            and self.pushes == FORCED_PROBES
            and not self.settled
        )

    async def served_logprobs(self, client: GenerationClient, served_name: str) -> tuple[list[int], list[float]]:
        """The probe's completion and the server's log-probs of it under `served_name`: sampled at the first probe (at
        temperature 1 over the full vocabulary, where raw and processed log-probs coincide; past any end-of-sequence
        token, for a probe of fixed length), scored by a teacher-forced forward at each later one (sampled again
        where not `rescored`)."""
        if self.completion is None or not self.rescored:
            sampled = (
                await client.complete(
                    self.prompt, max_tokens=self.tokens, model=served_name, seed=PROBE_SEED, ignore_eos=True
                )
            )[0]
            self.completion = sampled.token_ids
            return sampled.token_ids, sampled.logprobs
        scored = await client.score(self.prompt + self.completion, model=served_name)
        return self.completion, scored[len(self.prompt) - 1 :]

    def probe(
        self, name: str, session: Session, ranks: Ranks, model: torch.nn.Module, kernel: str, layout: str
    ) -> SyncGap:
        """Probe a sync that made the server serve `name`: rank 0 asks the server for the probe's log-probs, every rank
        scores the completion with the trained model (a sharded forward takes them all), rank 0 judges, and every rank
        takes its verdict, so the next syncs' probes are due alike. A mismatch raises SyncMismatch on every rank."""
        answer: tuple[list[int], list[float]] | None = None
        verdict: tuple[SyncGap | None, str | None] | None = None
        if ranks.main:
            self.client = self.client or session.generation_client()
            try:
                answer = session.run(self.served_logprobs(self.client, name))
            except ServerError as error:
                if 400 <= error.status < 500:  # refused, not lost: reconnecting would be refused alike
                    raise ServerProblem(f"the weight sync check's request was refused: {error}") from None
                raise
        self.completion, served = ranks.broadcast(answer)
        ours = policy_log_probs(model, self.prompt, self.completion, kernel, layout)
        if ranks.main:
            try:
                verdict = self.judge(name, served, ours), None
            except SyncMismatch as mismatch:
                verdict = None, str(mismatch)
        (gap, failure), self.settled = ranks.broadcast((verdict, self.settled) if ranks.main else None)
        if failure is not None:
            raise SyncMismatch(failure)
        return gap

    def judge(self, served_name: str, served: list[float], ours: torch.Tensor) -> SyncGap:
        """The gap between the `served` log-probs and the trainer's (`ours`), after SyncMismatch if a rule in effect
        (class docstring) says the server does not serve the trainer's weights."""
        theirs = torch.tensor(served, dtype=torch.float64)
        gap = SyncGap(served_name, len(theirs), float((theirs - ours).abs().max()), float((theirs - ours).abs().mean()))
        if self.args.weight_sync_check_atol is not None:
            check(gap, self.args.weight_sync_check_atol)
        if self.args.vllm_server_base_url is None:
            return gap
        if self.reference is not None and self.rescored:
            verdict = moved(theirs, ours, self.reference)
            if verdict is False:
                raise SyncMismatch(
                    f"weight sync check: after the sync, the server's log-probs under {served_name!r} sit nearer the "
                    f"weights it served at the first probe than the trainer's new ones "
                    f"({rms(theirs - self.reference):.3g} against {rms(theirs - ours):.3g} RMS over {gap.tokens} tokens, "
                    f"while the two versions lie {rms(ours - self.reference):.3g} apart). The weights did not reach the "
                    "server (a reload that missed, an adapter not applied), so training would be off-policy."
                )
            self.settled = self.settled or verdict is True
        bound, dtype = rounding_bound(self.dtypes)
        if gap.mean_abs > bound:
            raise SyncMismatch(
                f"weight sync check: the server's log-probs under {served_name!r} differ from the trainer's by "
                f"{gap.mean_abs:.3g} on average over {gap.tokens} tokens (largest {gap.max_abs:.3g}); {dtype} rounding "
                f"stays under {bound:g}. The server does not serve the trainer's weights under that name (another "
                "checkpoint, a reload that garbled them, a different decode mode or logprobs mode), so training would "
                "be off-policy."
            )
        if self.reference is None:
            self.reference = ours
        self.settled = self.settled or (not self.rescored and self.pushes >= FORCED_ADAPTER_PROBES)
        return gap


def policy_log_probs(
    model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], kernel: str, layout: str = TREE
) -> torch.Tensor:
    """log π_θ of each completion token given what precedes it: the trainer's own forward of a row in the model's
    `layout`, no dropout (every rank of a sharded model runs it)."""
    ids = list(prompt_ids) + list(completion_ids)
    sample = Sample(
        input_ids=ids,
        trained=[False] * len(prompt_ids) + [True] * len(completion_ids),
        behavior_log_probs=[0.0] * len(ids),
        advantage=0.0,
        model_version=0,
        group_id=0,
        prompt_index=0,
        group_samples=1,
        rollout_id="sync-check",
        created_at=0.0,
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return row_log_probs(model, pack([sample], layout=layout), kernel).log_probs.double().cpu()
    finally:
        model.train(was_training)


def check(gap: SyncGap, atol: float) -> None:
    """Raise SyncMismatch when the gap passes the user's weight_sync_check_atol."""
    if gap.max_abs <= atol:
        return
    raise SyncMismatch(
        f"weight sync check: the server's log-probs under {gap.served_name!r} differ from the trainer's by up to "
        f"{gap.max_abs:.3g} over {gap.tokens} tokens (allowed: {atol:g}, weight_sync_check_atol). The server is not "
        "sampling from the trained weights under that name (a stale or missing adapter, the base model, a weight reload "
        "that missed a layer, or a different dtype / decode mode), so training would be off-policy. Raise "
        "weight_sync_check_atol only if the gap is expected rounding (--decode-mode fast), or leave it unset against a "
        "bf16 server: the probe then tells a missed sync from rounding by direction."
    )
