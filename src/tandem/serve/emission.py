"""From a step's logits to what each sequence reports: the sampled token, its log-prob and rank, the top-k, the
sampling mask, and whether the sequence is done (vLLM's stop rules). Holds none of the engine's state: the engine
passes its rows (whose sequences this appends to) and keeps the counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.serve.sampling import apply_masks, apply_penalties, process_logits, sample

if TYPE_CHECKING:
    from tandem.serve.requests import EngineRequest, Sequence

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
NOTHING_TO_SAMPLE = (
    "No token is left to sample: allowed_token_ids, bad_words, logit_bias and min_tokens together exclude "
    "the whole vocabulary at this position. Allow at least one token."
)


@dataclass(frozen=True)
class Emission:
    """The engine's fixed settings for turning logits into tokens."""

    logprobs_mode: str
    eos_token_id: int | None
    extra_stop_token_ids: frozenset[int]
    max_model_len: int

    def __post_init__(self):
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} is not one of {LOGPROBS_MODES}")

    def emit(
        self,
        entries: list[tuple[EngineRequest, Sequence]],
        totals: list[int],
        logits: torch.Tensor,
        weight_version: str,
    ) -> list[str | None]:
        """Sample one token per entry from its row of `logits` (changed in place: masks, bias, penalties), append it to
        the sequence with its log-prob (top-k, sampling mask when asked) and the label of the weights that sampled it;
        each entry's finish reason, None while it runs. `totals`: tokens in each row's sequence once the new one is
        appended. A row whose masks left nothing to sample gets no token: its request fails ("error")."""
        params = [request.params for request, _ in entries]
        raw = logits.clone()
        self._shape_rows(entries, logits)
        processed = process_logits(logits, params)
        nothing_left = ~torch.isfinite(processed).any(-1)
        if bool(nothing_left.any()):  # its masks excluded every token: that request fails, the others go on
            processed[nothing_left] = 0.0
        tokens = sample(processed, params, [seq.generator for _, seq in entries])
        reported = self._reported(raw, processed)
        chosen = reported.gather(1, tokens[:, None])[:, 0]
        ranks = ((reported > chosen[:, None]).sum(-1) + 1).tolist()
        top = _top(reported, max((p.logprobs for p in params if p.logprobs is not None), default=None))
        reasons: list[str | None] = []
        empty = nothing_left.tolist()
        for b, ((request, seq), token, value, total) in enumerate(
            zip(entries, tokens.tolist(), chosen.tolist(), totals)
        ):
            if empty[b]:
                reasons.append(_fail_with_nothing_to_sample(request, seq))
                continue
            seq.output.append(token)
            seq.logprobs.append(value)
            if not seq.weight_versions or seq.weight_versions[-1][0] != weight_version:
                seq.weight_versions.append((weight_version, len(seq.output) - 1))
            p = request.params
            if p.logprob_token_ids is not None:
                seq.top_logprobs.append(_listed_entries(reported[b], token, value, ranks[b], p.logprob_token_ids))
            elif p.logprobs is not None:
                seq.top_logprobs.append(_top_entries(top, b, token, value, ranks[b], p.logprobs))
            if request.return_sampling_mask:
                seq.sampling_masks.append(torch.isfinite(processed[b]).nonzero().flatten().tolist())
            reasons.append(self._finish(request, seq, total))
            if reasons[-1] is None:
                seq.checked = len(seq.output)
        return reasons

    def _reported(self, raw: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
        """What the sequences report for each token, per `logprobs_mode`: log-probs or logits, before or after the
        masks, bias, penalties and temperature."""
        return {
            "raw_logprobs": lambda: raw.log_softmax(-1),
            "processed_logprobs": lambda: processed.log_softmax(-1),
            "raw_logits": lambda: raw,
            "processed_logits": lambda: processed,
        }[self.logprobs_mode]()

    def _shape_rows(self, entries: list[tuple[EngineRequest, Sequence]], logits: torch.Tensor) -> None:
        """Each row's masks, bias and penalties, in place, in vLLM's order (sampling.apply_masks, apply_penalties)."""
        for b, (request, seq) in enumerate(entries):
            p = request.params
            blocked: set[int] = set()
            if len(seq.output) < p.min_tokens:
                eos = set() if self.eos_token_id is None else {self.eos_token_id}
                blocked = set(p.stop_token_ids) | self.extra_stop_token_ids | eos
            if p.allowed_token_ids is not None or p.bad_words or blocked or p.logit_bias:
                apply_masks(logits[b], p, seq.output, blocked)
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                apply_penalties(logits[b], p, request.prompt, seq.output)

    def prompt_logprobs(self, logits: torch.Tensor, prompt: list[int], k: int) -> list:
        """Entry 0 is None; entry j holds prompt token j and the top-k at that position (raw log-probs)."""
        logprobs = logits.log_softmax(-1)
        targets = torch.tensor(prompt[1:], device=logprobs.device)
        chosen = logprobs[:-1].gather(1, targets[:, None])[:, 0]
        ranks = ((logprobs[:-1] > chosen[:, None]).sum(-1) + 1).tolist()
        top = _top(logprobs[:-1], k)
        result: list = [None]
        for j, (token, value) in enumerate(zip(prompt[1:], chosen.tolist())):
            result.append({t: (v, r) for t, v, r in _top_entries(top, j, token, value, ranks[j], k)})
        return result

    def _finish(self, request: EngineRequest, seq: Sequence, total_len: int) -> str | None:
        """Whether the sequence's last token ends it, as vLLM decides: EOS, a stop token, then (past min_tokens) a stop
        string or a repetition, then max_tokens and the model's length; sets the sequence's finish and stop reasons."""
        token, p = seq.output[-1], request.params
        reason: str | None = None
        stop_reason: int | str | None = None
        checks_text = len(seq.output) > p.min_tokens  # vLLM: stop strings and repetitions only past min_tokens
        if token == self.eos_token_id and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids or (token in self.extra_stop_token_ids and not p.ignore_eos):
            reason, stop_reason = "stop", token
        elif checks_text and request.stop_check and (matched := request.stop_check(seq.output)) is not None:
            reason, stop_reason = "stop", matched
        elif checks_text and p.repetition_detection and repeats(seq.output, *p.repetition_detection):
            reason, stop_reason = "repetition", "repetition_detected"
        elif len(seq.output) >= p.max_tokens or total_len >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
        return reason


def _fail_with_nothing_to_sample(request: EngineRequest, seq: Sequence) -> str:
    """End a sequence whose masks left no token to sample: its request fails (400) with the first such error."""
    if request.error is None:
        request.error, request.error_status = NOTHING_TO_SAMPLE, 400
    seq.finish_reason = "error"
    return "error"


def repeats(output: list[int], min_size: int, max_size: int, min_count: int) -> bool:
    """The last L tokens, for some L in [min_size, max_size], occur `min_count` times in a row at the output's end.
    A pattern of size L needs the last token to recur L tokens back, which rules most sizes out at one comparison."""
    end = len(output)
    for size in range(max(min_size, 1), min(max_size, end // min_count) + 1):
        if output[end - 1] != output[end - 1 - size]:
            continue
        if all(output[end - size * k - i - 1] == output[end - i - 1] for k in range(1, min_count) for i in range(size)):
            return True
    return False


def _top(values: torch.Tensor, k: int | None) -> tuple[list, list, list] | None:
    """Each row's top-k (all of the vocabulary for k = -1) as lists of ids, values and ranks, read out for the whole
    batch at once rather than row by row (three tensor-to-list conversions a step, not three per row). Rank is 1 +
    the number of strictly larger values, so ties share a rank. None for no top-k."""
    if not k:
        return None
    top = values.topk(values.shape[-1] if k < 0 else min(k, values.shape[-1]))
    ranks = torch.searchsorted(-top.values, -top.values, side="left") + 1
    return top.indices.tolist(), top.values.tolist(), ranks.tolist()


def _listed_entries(
    row: torch.Tensor, token: int, value: float, rank: int, ids: list[int]
) -> list[tuple[int, float, int]]:
    """(id, value, rank) of the sampled token, then of each listed id in the request's order, duplicates merged."""
    listed = list(dict.fromkeys(t for t in ids if t != token))
    values = row[listed].tolist()
    ranks = ((row[None, :] > row[listed][:, None]).sum(-1) + 1).tolist() if listed else []
    return [(token, value, rank)] + list(zip(listed, values, ranks))


def _top_entries(top, row: int, token: int, value: float, rank: int, k: int) -> list[tuple[int, float, int]]:
    """(id, value, rank): the sampled token first, then the row's top-k by value (`_top`), duplicates merged."""
    entries = [(token, value, rank)]
    if top is None or k == 0:
        return entries
    ids, values, ranks = (part[row] if k < 0 else part[row][:k] for part in top)
    return entries + [(t, v, r) for t, v, r in zip(ids, values, ranks) if t != token]
