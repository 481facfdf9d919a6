"""The two ways a run is refused before it starts: a usage error, and a load error; and
the one way an adapter fails after the port returned: its return could not be read.

The first two are ValueErrors whose message names the argument (or the spec) and what was
expected; the CLI exits 2 on either, and writes the report of a load error when asked.
The exit statuses of every command (compare, replay, audit, bench, selftest) are here too,
and the one rule by which a refused name suggests the closest known ones.
"""

import difflib
from collections.abc import Iterable

#: No divergence found (equivalent, or every failure an accepted deviation).
EXIT_EQUIVALENT = 0
#: A divergence found (or an accepted deviation that no longer shows).
EXIT_DIVERGENT = 1
#: Unusable: the implementation could not be loaded or never returned a result, or a usage error.
EXIT_UNUSABLE = 2
#: Ctrl-C: the partial report is written, as the shell's convention for SIGINT.
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """The command line or configuration asks for something this run cannot do."""


class LoadError(ValueError):
    """The implementation could not be loaded (the message says why, naming the spec)."""


class UnreadableReturn(TypeError):
    """The port returned, but not what its adapter reads back (a type, a shape, a place in
    the return): a finding about the port's result, and never its refusal of an input, so a
    validation probe that ends here counts as accepted, not rejected."""


def closest(name: str, known: Iterable[str], *, otherwise: str = "") -> str:
    """The one closest-match rule of every refusal of a name: ``"; closest matches: a, b"``
    (at most three, by ``difflib``'s ratio of at least 0.5), else ``otherwise`` (say where
    the names are listed, or list them)."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    return f"; closest matches: {', '.join(close)}" if close else otherwise
