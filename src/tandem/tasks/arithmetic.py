"""The built-in arithmetic task: "What is 37 + 48?" answered with a number.

Problems are two-operand additions and subtractions of numbers below 100. A fixed fifth of
all problems is held out of the tiny model's pretraining (`split="test"`), so the pass rate
measured on it is honest, and RL on the task has room to improve.
"""

import random
import re
import zlib

OPERATORS = ("+", "-")


def all_problems() -> list[tuple[int, str, int]]:
    return [(a, op, b) for a in range(100) for b in range(100) for op in OPERATORS]


def split_of(problem: tuple[int, str, int]) -> str:
    """'test' for a fixed, hash-chosen fifth of the problems, 'train' for the rest."""
    return "test" if zlib.crc32(repr(problem).encode()) % 5 == 0 else "train"


def question(problem: tuple[int, str, int]) -> str:
    a, op, b = problem
    return f"What is {a} {op} {b}?"


def answer(problem: tuple[int, str, int]) -> int:
    a, op, b = problem
    return a + b if op == "+" else a - b


def make_rows(n: int, *, split: str = "test", seed: int = 0) -> list[dict]:
    """`n` dataset rows: a conversational `prompt` and the `solution` as a string."""
    pool = [p for p in all_problems() if split_of(p) == split]
    rng = random.Random(seed)
    picked = [pool[rng.randrange(len(pool))] for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": question(p)}], "solution": str(answer(p))} for p in picked]


_INTEGER = re.compile(r"-?\d+")


def is_correct(completion_text: str, expected: str) -> bool:
    """True when the first integer in the completion equals the expected answer."""
    found = _INTEGER.search(completion_text)
    return found is not None and found.group() == expected.strip()


def correctness_reward(completions, solution, **kwargs) -> list[float]:
    """The task's own reward: 1.0 when the first integer of the completion is the solution. Much cheaper
    than math-verify, for runs where the worker's CPU time matters (benchmarks)."""
    return [float(is_correct("".join(m.get("content") or "" for m in c), s)) for c, s in zip(completions, solution)]
