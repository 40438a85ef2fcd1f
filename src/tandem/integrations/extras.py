"""Other libraries as tandem's optional extras: imported when used, a missing one a one-line error naming its extra."""

import importlib

from tandem.errors import UsageError, install_command


def library(module: str, needed_by: str, extra: str):
    """The installed module `module`, or a UsageError naming the extra that installs it (`needed_by` says what needs
    it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{needed_by}: {install_command(extra)}") from None
