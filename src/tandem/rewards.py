"""Built-in reward functions, called with the spec's reward-function signature."""

from math_verify import parse, verify


def _text(completion) -> str:
    """The text of a completion: a conversational message list, or a plain string."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")


def accuracy_reward(completions, solution, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals `solution` (checked by math-verify), else 0.0.
    None when the solution itself cannot be parsed: that rollout is left unscored."""
    rewards = []
    for completion, gold in zip(completions, solution):
        parsed_gold = parse(str(gold))
        if not parsed_gold:
            rewards.append(None)
            continue
        rewards.append(1.0 if verify(parsed_gold, parse(_text(completion))) else 0.0)
    return rewards
