"""Built-in reward functions, called with TRL's reward-function signature."""

import functools
import logging

from math_verify import parse, verify

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call made without a timeout
VERDICTS_CACHED = 8192


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
    return [verdict(str(gold), _text(completion)) for completion, gold in zip(completions, solution)]


@functools.lru_cache(maxsize=VERDICTS_CACHED)
def verdict(gold: str, completion: str) -> float | None:
    """`accuracy_reward` of one completion, remembered: a group's G completions share their solution and often their
    text (half of the demo's repeat), and math-verify's sympy parsing took a third of the demo worker's CPU."""
    parsed_gold = _parsed(gold)
    if not parsed_gold:
        return None
    return 1.0 if verify(parsed_gold, parse(completion, parsing_timeout=None), timeout_seconds=None) else 0.0


@functools.lru_cache(maxsize=VERDICTS_CACHED)
def _parsed(gold: str) -> list:
    return parse(gold, parsing_timeout=None)
