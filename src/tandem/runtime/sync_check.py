"""Does the server now sample from the trainer's policy? A check run after a weight sync.

A short completion is sampled under the name the rollouts will use, and the log-probs the server
reports for its tokens are compared with the trainer's own forward over the same tokens. In fp32 the two
agree bit for bit with tandem serve's exact decoding, and to rounding with vLLM's CPU kernels (~1e-5, a rare token
1.5e-4); a server that serves the base model, or an older adapter, under the new name is off by 0.1 or more.
"""

from dataclasses import dataclass

import torch

from tandem.generation.client import GenerationClient, ServerProblem
from tandem.metrics.doctor import OFF_POLICY_BOUND
from tandem.packing import TREE, pack
from tandem.packing.logprobs import row_logprobs
from tandem.records import Sample

PROBE_TOKENS = 16
PROBE_SEED = 1234
FORCED_PROBES = 2
"""Against an external server the first syncs are always probed: the connect push (same weights) and the first trained
weights (a reload that misses a layer shows only once the weights differ from the server's own)."""


class SyncMismatch(ServerProblem):
    """The server's log-probs under the synced name are not the trainer's."""


@dataclass
class SyncGap:
    served_name: str
    tokens: int
    max_abs: float
    """The largest |served log-prob − trainer log-prob| over the probe's sampled tokens."""


class SyncProbe:
    """Which syncs are checked, and how: a completion of `tokens` tokens after `prompt`, whose log-probs may differ from
    the trainer's by the user's weight_sync_check_atol; against an external server also by no more than the rounding
    bound of the coarser dtype, and each of the first FORCED_PROBES syncs is checked whatever the settings. `args`
    (the AsyncGRPOConfig) is read at each sync, as the runtime reads it."""

    def __init__(self, prompt: list[int], dtype: str, args):
        self.prompt, self.args = prompt, args
        self.bound = (OFF_POLICY_BOUND.get(dtype, OFF_POLICY_BOUND["float32"]), dtype)
        """The largest gap that rounding explains, and the dtype it is that of: the trainer's, then the coarser of it
        and the server's (`note_server_dtype`)."""
        self.tokens = PROBE_TOKENS
        """Shorter when the server's context has no room for the full probe (`fit`)."""
        self.client: GenerationClient | None = None
        """Opened by the runtime at the first checked sync."""

    def note_server_dtype(self, dtype: str) -> None:
        """The server's dtype, read at connect: the bound becomes the coarser dtype's."""
        self.bound = max(self.bound, (OFF_POLICY_BOUND.get(dtype, 0.0), dtype))

    def fit(self, max_model_len: int) -> None:
        """A probe as long as the server's context leaves room for after the prompt (at least one token)."""
        self.tokens = max(1, min(PROBE_TOKENS, max_model_len - len(self.prompt)))

    def limit(self, pushes: int) -> tuple[float, str] | None:
        """How far the probe after the `pushes`-th sync may land from the trainer's log-probs, and where that bound comes
        from; None for no probe."""
        atol = self.args.weight_sync_check_atol
        user = (atol, "weight_sync_check_atol") if atol is not None else None
        if self.args.vllm_server_base_url is None:
            return user
        bound = (self.bound[0], f"{self.bound[1]} rounding bound")
        if user is None:
            return bound if pushes <= FORCED_PROBES else None
        return min(user, bound)


async def sync_gap(client: GenerationClient, served_name: str, model: torch.nn.Module, prompt_ids: list[int],
                   kernel: str) -> SyncGap:
    """Sample `PROBE_TOKENS` tokens under `served_name` and compare their served log-probs with `model`'s forward."""
    served = await probe(client, served_name, prompt_ids)
    return compare(served_name, served, policy_logprobs(model, prompt_ids, served.token_ids, kernel))


async def probe(client: GenerationClient, served_name: str, prompt_ids: list[int], tokens: int = PROBE_TOKENS):
    """A completion of `tokens` tokens under `served_name` at temperature 1 (full vocabulary, so raw and processed
    log-probs coincide; past any end-of-sequence token, for a probe of fixed length), with its log-probs."""
    return (await client.complete(prompt_ids, max_tokens=tokens, model=served_name, seed=PROBE_SEED, ignore_eos=True))[0]


def compare(served_name: str, served, ours: torch.Tensor) -> SyncGap:
    """How far the probe's served log-probs are from the trainer's over the same tokens (`ours`)."""
    gap = (torch.tensor(served.logprobs, dtype=torch.float64) - ours).abs()
    return SyncGap(served_name, len(gap), float(gap.max()))


def policy_logprobs(model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], kernel: str,
                    layout: str = TREE) -> torch.Tensor:
    """log π_θ of each completion token given what precedes it: the trainer's own forward of a row in the model's
    `layout`, no dropout (every rank of a sharded model runs it)."""
    ids = list(prompt_ids) + list(completion_ids)
    sample = Sample(input_ids=ids, trained=[False] * len(prompt_ids) + [True] * len(completion_ids),
                    behavior_log_probs=[0.0] * len(ids), advantage=0.0, model_version=0, group_id=0, position=0,
                    group_samples=1, rollout_id="sync-check", created_at=0.0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return row_logprobs(model, pack([sample], layout=layout), kernel).log_probs.double().cpu()
    finally:
        model.train(was_training)


def check(gap: SyncGap, atol: float, limit: str = "weight_sync_check_atol") -> None:
    """Raise SyncMismatch when the gap passes `atol`; `limit` names where that bound comes from (the setting, or the
    dtype's rounding bound, which no setting loosens)."""
    if gap.max_abs <= atol:
        return
    advice = ("Raise weight_sync_check_atol only if the gap is expected rounding (--decode-mode fast)."
              if limit == "weight_sync_check_atol" else "No rounding of that dtype reaches so far.")
    raise SyncMismatch(
        f"weight sync check: the server's log-probs under {gap.served_name!r} differ from the trainer's by up to "
        f"{gap.max_abs:.3g} over {gap.tokens} tokens (allowed: {atol:g}, {limit}). The server is not sampling from the "
        "trained weights under that name (a stale or missing adapter, the base model, a weight reload that missed a "
        f"layer, or a different dtype / decode mode), so training would be off-policy. {advice}")
