"""Does the server now sample from the trainer's policy? A check run after a weight sync.

A short completion is sampled under the name the rollouts will use, and the log-probs the server
reports for its tokens are compared with the trainer's own forward over the same tokens. In fp32 the two
agree bit for bit with tandem serve's exact decoding, and to rounding with vLLM's CPU kernels (~1e-5, a rare token
1.5e-4); a server that serves the base model, or an older adapter, under the new name is off by 0.1 or more.
"""

from dataclasses import dataclass

import torch

from tandem.generation.client import GenerationClient, ServerProblem
from tandem.packing import TREE, pack
from tandem.packing.logprobs import row_logprobs
from tandem.records import Sample

PROBE_TOKENS = 16
PROBE_SEED = 1234


class SyncMismatch(ServerProblem):
    """The server's log-probs under the synced name are not the trainer's."""


@dataclass
class SyncGap:
    served_name: str
    tokens: int
    max_abs: float
    """The largest |served log-prob − trainer log-prob| over the probe's sampled tokens."""


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
