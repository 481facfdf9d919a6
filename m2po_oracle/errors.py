"""The two ways a run is refused before it starts: a usage error, and a load error.

Both are ValueErrors whose message names the argument (or the spec) and what was expected;
the CLI exits 2 on either, and writes the report of a load error when asked.
"""


class UsageError(ValueError):
    """The command line or configuration asks for something this run cannot do."""


class LoadError(ValueError):
    """The implementation could not be loaded (the message says why, naming the spec)."""
