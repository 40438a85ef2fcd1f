"""Turns -> training sequences. A turn whose prompt starts with the tokens held so far extends the
same sequence (the new prompt tokens, e.g. tool results, are context); any other turn starts a new
sequence (a fork: the chat template re-rendered history differently). Generated tokens are trained
exactly once; context tokens never are."""

from dataclasses import dataclass, field

from tandem.contract.records import TrainingSequence, TurnRecord


@dataclass
class ReconcileStats:
    transitions: int = 0
    forks: int = 0
    drift_tokens: list[int] = field(default_factory=list)


def reconcile(turns: list[TurnRecord], version: int) -> tuple[list[TrainingSequence], ReconcileStats]:
    """The turns' training sequences; `version` is the policy version of a turn's tokens that do not carry one."""
    sequences: list[TrainingSequence] = []
    stats = ReconcileStats()
    held: TrainingSequence | None = None
    for turn in turns:
        if held is not None:
            stats.transitions += 1
            if turn.prompt_ids[: len(held.input_ids)] == held.input_ids:
                _extend(held, turn.prompt_ids[len(held.input_ids) :], trained=None)
                stats.drift_tokens.append(0)
            else:
                stats.forks += 1
                stats.drift_tokens.append(len(held.input_ids) - _common_prefix(held.input_ids, turn.prompt_ids))
                sequences.append(held)
                held = None
        if held is None:
            held = TrainingSequence(input_ids=[], trained=[], behavior_log_probs=[])
            _extend(held, turn.prompt_ids, trained=None)
        mask = turn.output_mask if turn.output_mask is not None else [1] * len(turn.output_ids)
        _extend(
            held,
            turn.output_ids,
            trained=mask,
            behavior_log_probs=turn.output_log_probs,
            sampler_logprobs=turn.output_sampler_logprobs,
            sampling_mask=turn.output_sampling_mask,
            token_versions=turn.output_token_versions or [version] * len(turn.output_ids),
        )
    if held is not None:
        sequences.append(held)
    return [s for s in sequences if any(s.trained)], stats


def _extend(
    seq: TrainingSequence,
    ids: list[int],
    trained,
    behavior_log_probs=None,
    sampler_logprobs=None,
    sampling_mask=None,
    token_versions=None,
) -> None:
    n = len(ids)
    seq.input_ids += list(ids)
    seq.trained += [bool(t) for t in trained] if trained is not None else [False] * n
    seq.behavior_log_probs += list(behavior_log_probs) if behavior_log_probs else [0.0] * n
    seq.sampler_logprobs += list(sampler_logprobs) if sampler_logprobs else [None] * n
    seq.sampling_mask += list(sampling_mask) if sampling_mask else [None] * n
    seq.token_versions += list(token_versions) if token_versions else [-1] * n


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
