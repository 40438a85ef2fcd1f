"""Built-in reward functions, called with the spec's reward-function signature."""

import logging

from math_verify import parse, verify

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call made without a timeout


def _text(completion) -> str:
    """The text of a completion: a conversational message list, or a plain string."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")


def accuracy_reward(completions, solution, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals `solution` (checked by math-verify), else 0.0.
    None when the solution itself cannot be parsed: that rollout is left unscored.

    Sync reward functions run in worker threads, where math-verify's signal-based timeouts cannot work,
    so they are switched off.
    """
    rewards = []
    for completion, gold in zip(completions, solution):
        parsed_gold = parse(str(gold), parsing_timeout=None)
        if not parsed_gold:
            rewards.append(None)
            continue
        answer = parse(_text(completion), parsing_timeout=None)
        rewards.append(1.0 if verify(parsed_gold, answer, timeout_seconds=None) else 0.0)
    return rewards
