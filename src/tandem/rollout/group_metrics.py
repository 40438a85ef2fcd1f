"""What the worker records about each scored group: rewards per source, lengths, duplicates (the
catalogue's rewards and groups metrics). `record(name, *values)` appends to the worker's window records."""

import numpy as np

from tandem.contract.records import RolloutGroup


def record_group(
    record,
    group: RolloutGroup,
    columns: dict[str, np.ndarray],
    kept: bool,
    eos_token_ids: list[int],
    log_completions: bool,
) -> None:
    """Rewards (all, dropped, per source), lengths and, with `log_completions`, the examples to print. What is defined
    over trained samples (reward_kept, reward_group_std, rewards/{source}/group_std) the trainer records as it trains
    them (step_metrics.record_samples), from what each sample carries (`group_stds`)."""
    rewards = group.rewards
    assert rewards is not None  # recorded once scored
    scored = rewards[~np.isnan(rewards)]
    record("reward", *scored.tolist())
    record("rollout/completions_count", len(rewards))  # generated, trained or not: what a synchronous trainer counts
    record("frac_reward_zero_std", 0.0 if kept else 1.0)
    if not kept and len(scored):
        record("reward_dropped", *scored.tolist())
    for name, values in columns.items():
        record(f"rewards/{name}/mean", *values[~np.isnan(values)].tolist())
    record_lengths(record, group.completions_ids, set(eos_token_ids))
    if log_completions:
        record(
            "completions/examples",
            *[(group.prompts[0], c[0]["content"] if c else "", float(r)) for c, r in zip(group.completions, rewards)],
        )


def group_stds(rewards: np.ndarray, columns: dict[str, np.ndarray]) -> tuple[float, dict[str, float]]:
    """The std within the group of its summed reward and of each source's (their scored values; NaN when none)."""

    def std(values: np.ndarray) -> float:
        valid = values[~np.isnan(values)]
        return float(valid.std()) if len(valid) else float("nan")

    return std(rewards), {name: std(values) for name, values in columns.items()}


def record_lengths(record, completions_ids: list[list[int]], eos: set[int]) -> None:
    """Completion lengths (all, and those that ended with EOS), the clipped ratio and duplicates within the group."""
    lengths = [len(ids) for ids in completions_ids]
    terminated = [len(ids) for ids in completions_ids if ids and ids[-1] in eos]
    record("completions/mean_length", *lengths)
    record("completions/min_length", *lengths)
    record("completions/max_length", *lengths)
    if terminated:
        record("completions/mean_terminated_length", *terminated)
        record("completions/min_terminated_length", *terminated)
        record("completions/max_terminated_length", *terminated)
    record("completions/clipped_ratio", *[0.0 if ids and ids[-1] in eos else 1.0 for ids in completions_ids])
    seen = set()
    for ids in completions_ids:
        record("completions/duplicate_frac", 1.0 if tuple(ids) in seen else 0.0)
        seen.add(tuple(ids))
