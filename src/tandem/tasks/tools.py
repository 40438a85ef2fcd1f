"""The arithmetic task's tool: a calculator the tiny model was pretrained to call.

Offered to the tiny model (`tools=[calculator]`, or `tools: [tandem.tasks.tools.calculator]` in a recipe), the
model calls it on part of the problems with the question's expression and answers with the result; RL can
teach it to call it every time.
"""

import re

_SUM = re.compile(r"\s*-?\d+(\s*[+-]\s*-?\d+)*\s*")
_TERM = re.compile(r"([+-]?)\s*(-?\d+)")


def calculator(expression: str) -> str:
    """Add and subtract integers.

    Args:
        expression: Integers joined by + and - signs.

    Returns:
        The value of the expression.
    """
    if not _SUM.fullmatch(expression):
        raise ValueError(f"calculator takes integers joined by + and -, got {expression!r}")
    return str(sum(-int(n) if sign == "-" else int(n) for sign, n in _TERM.findall(expression)))
