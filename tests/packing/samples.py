"""Building samples for packing tests: a Sample from tokens and a trained mask, and random tries."""

from hypothesis import strategies as st

from tandem.contract.records import Sample


def sample(ids, trained=None, group=0, advantage=1.0, behavior_log_probs=None, sampling_mask=None) -> Sample:
    trained = [bool(t) for t in trained] if trained is not None else [False] + [True] * (len(ids) - 1)
    return Sample(
        input_ids=list(ids),
        trained=trained,
        behavior_log_probs=behavior_log_probs or [0.0] * len(ids),
        advantage=advantage,
        model_version=0,
        group_id=group,
        prompt_index=group,
        group_samples=1,
        rollout_id=f"r{group}",
        created_at=0.0,
        sampling_mask=sampling_mask or [],
    )


TOKENS = st.integers(3, 383)  # the tiny model's vocabulary, special tokens aside


@st.composite
def tries(draw, max_groups: int = 3):
    """Samples that exercise every trie shape: groups sharing a prompt, prompts sharing a system prefix,
    completions that branch one token apart, duplicates, multi-turn samples extending an earlier turn,
    and samples sharing nothing."""
    samples = []
    system = draw(st.lists(TOKENS, min_size=0, max_size=4))
    for group in range(draw(st.integers(1, max_groups))):
        prefix = system if draw(st.booleans()) else []
        prompt = prefix + draw(st.lists(TOKENS, min_size=1, max_size=10))
        completions = []
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(st.sampled_from(["fresh", "branch", "duplicate", "next_turn"])) if completions else "fresh"
            if kind == "fresh":
                completion = draw(st.lists(TOKENS, min_size=1, max_size=8))
            else:
                base = draw(st.sampled_from(completions))
                if kind == "branch":  # agree up to some token, then differ
                    cut = draw(st.integers(0, len(base)))
                    completion = base[:cut] + draw(st.lists(TOKENS, min_size=1, max_size=4))
                elif kind == "duplicate":
                    completion = list(base)
                else:  # the conversation so far, a tool result (context), and a new sampled turn
                    completion = (
                        base
                        + draw(st.lists(TOKENS, min_size=1, max_size=3))
                        + draw(st.lists(TOKENS, min_size=1, max_size=3))
                    )
            completions.append(completion)
        for completion in completions:
            ids = prompt + completion
            trained = [False] * len(prompt) + draw(
                st.lists(st.booleans(), min_size=len(completion), max_size=len(completion))
            )
            trained[-1] = True  # every sample trains at least its last token
            samples.append(sample(ids, trained, group=group, advantage=draw(st.floats(-2, 2))))
    return samples
