"""`UsageError`: a mistake in what the user gave, told apart from a bug; `install_command`: the fix for a missing extra."""

from tandem import DISTRIBUTION


class UsageError(ValueError):
    """A setting, recipe, dataset, tool or model the run cannot use, with the value and the fix in its message:
    `tandem train` prints it in one line and exits 2, while any other exception keeps its traceback (a bug). A
    ValueError, so code that catches those still does."""


def install_command(extra: str) -> str:
    """The command that installs one of tandem's extras (`pip install 'tandem-rl[vllm]'`)."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
