"""The ``m2po-oracle`` command line: every subcommand and option, and the exit statuses it documents."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from m2po_oracle import __version__
from m2po_oracle.cli import options
from m2po_oracle.errors import EXIT_UNUSABLE

#: The compare options replay takes: how to call, not what to explore.
REPLAY_OPTIONS = (
    "dtype",
    "compute_dtype",
    "device",
    "timeout",
    "in_process",
    "topology",
    "backend",
    "adapter",
    "bind",
    "validation_errors",
    "show_output",
)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # usage errors exit 2, as documented
        self.print_usage(sys.stderr)
        self.exit(EXIT_UNUSABLE, f"{self.prog}: error: {message}\n")


COMPARE_EPILOG = """\
Options not given on the command line are read from [tool.m2po-oracle] in the nearest
pyproject.toml (impl, adapter, bind, examples, seed, dtype, compute-dtype, topology,
backend, accept, strict, ...); a flag overrides the file.

exit status:
  0    equivalent (or equivalent-with-accepted: every failure is an accepted deviation)
  1    divergent, or an accepted deviation no longer shows (accepted-deviation-fixed)
  2    unusable (the implementation could not be loaded or never returned a result) or a usage error
  130  interrupted (Ctrl-C); the partial JSON/HTML report is written

example:
  m2po-oracle compare --impl my_framework.losses:m2po_loss --examples 500 --html reports/mine.html
  m2po-oracle compare --impl port.py:compute_policy_loss --adapter policy_loss --accept clamped_log_ratio -x
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="m2po-oracle", description="Check an M2PO implementation against the Algorithm 1 oracle.")
    parser.add_argument("--version", action="version", version=f"m2po-oracle {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    compare = commands.add_parser(
        "compare",
        help="run the check battery on generated batches",
        epilog=COMPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument(
        "--impl",
        default=None,
        help="built-in name (core, control:NAME), package.module:function or path/file.py:function (default: impl in [tool.m2po-oracle])",
    )
    options.add_to_argparse(compare)
    options.add_to_argparse(compare, options.RUN_SETTINGS)
    compare.add_argument(
        "-x", "--exitfirst", dest="exitfirst", action="store_true", help="stop exploring at the first failing example (--max-failures 1)"
    )
    verbosity = compare.add_mutually_exclusive_group()
    verbosity.add_argument(
        "-q",
        "--quiet",
        dest="verbosity",
        action="store_const",
        const=-1,
        default=0,
        help="print only the verdict, the failing checks and the explanation",
    )
    verbosity.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=1,
        help="also print every counterexample's full batch and the implementation's captured output",
    )
    compare.add_argument("--json", type=Path, default=None, help="write the JSON report here")
    compare.add_argument("--html", type=Path, default=None, help="write the self-contained HTML report (rendered from the JSON) here")

    replay = commands.add_parser("replay", help="run the battery on one saved batch")
    replay.add_argument("--impl", default=None, help="as for compare")
    replay.add_argument("source", nargs="?", default=None, help="a compare JSON report or a batch JSON file (or JSON text)")
    replay.add_argument("--batch", default=None, help="the batch as JSON text or a file path (alternative to SOURCE)")
    options.add_to_argparse(replay, tuple(o for o in options.COMPARE_OPTIONS if o.name in REPLAY_OPTIONS))

    selftest = commands.add_parser("selftest", help="run the battery against every shipped negative control")
    selftest.add_argument("--only", default=None, help="comma-separated control names, trainer:NAME for a trainer control (default: all)")
    selftest.add_argument("--trainer", action="store_true", help="also the trainer-level controls (needs the trainer extra)")
    selftest.add_argument(
        "--distributed", action="store_true", help="also the distributed controls, each on a gloo world of the topology it shows on"
    )
    selftest.add_argument(
        "--quick",
        action="store_true",
        help="each control at the examples that catch and name it on seeds 0-9 (its own number), unshrunk: the CI run",
    )
    selftest.add_argument(
        "--seeds",
        type=options.positive_int,
        default=1,
        help="also run each control on this many seeds until its first failing example; shows min / median / max (default 1)",
    )
    options.add_to_argparse(selftest, tuple(o for o in options.COMPARE_OPTIONS if o.name in ("examples", "seed")))
    selftest.add_argument(
        "--jobs",
        type=options.positive_int,
        default=1,
        help="run the controls in this many processes at once (default %(default)s; distributed controls run one at a time)",
    )

    bench = commands.add_parser(
        "bench", help="time the exact selection and the core forward against sorting and a streaming pass, side by side"
    )
    bench.add_argument("--sizes", default="20,22,24", help="comma-separated log2 token counts (default 20,22,24: 1M, 4M and 16M)")
    bench.add_argument("--scaling", action="store_true", help="the scaling series 2^12 .. 2^24 instead of --sizes")
    bench.add_argument("--repeats", type=options.positive_int, default=7, help="interleaved repeats per size (medians and bests reported)")
    bench.add_argument("--device", default="cpu", help="cpu or cuda")
    bench.add_argument("--threads", type=options.positive_int, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument(
        "--ranks",
        type=options.positive_int,
        default=None,
        help="also compare distributed selection on a gloo world of this many ranks (tokens per rank: the largest --sizes)",
    )
    bench.add_argument("--json", type=Path, default=None)
    bench.add_argument("--html", type=Path, default=None)
    bench.add_argument(
        "--audit",
        action="store_true",
        help="instead: time the offline audit (audit_capture) of one synthetic dp=4 x 2 micro-batch step, correct and with a planted bug",
    )
    bench.add_argument(
        "--tokens", type=options.positive_int, default=1 << 24, help="with --audit: tokens of that step (default 16,777,216)"
    )

    audit = commands.add_parser(
        "audit", help="audit a capture of a training run (m2po_oracle.capture.recorder) against Algorithm 1, step by step"
    )
    audit.add_argument("directory", type=Path, help="the capture directory (manifest.rank-*.json)")
    audit.add_argument("--json", type=Path, default=None, help="write the JSON report (schema m2po-oracle/audit/1) here")
    audit.add_argument(
        "--html", type=Path, default=None, help="write the HTML report (a timeline of every step, the worst step first) here"
    )
    audit.add_argument("--step", type=int, action="append", default=None, metavar="N", help="audit only this optimizer step (repeatable)")
    audit.add_argument(
        "--rollout-atol",
        type=options.nonnegative_seconds,
        default=None,
        metavar="X",
        help="let the behaviour log-probs differ from the sampler's rollout_logp by up to X per token (a recomputation "
        "under the sampler's weights with other kernels); default: equal at float32 precision",
    )
    audit.add_argument(
        "--policy-atol",
        type=options.nonnegative_seconds,
        default=None,
        metavar="X",
        help="let the loss pass's log-probs differ from the selection's prepass (selection_logp) by up to X per token "
        "(nondeterministic kernels); default: equal at the capture dtype's precision",
    )

    commands.add_parser("checks", help="list the checks of the battery")
    commands.add_parser(
        "adapters", help="list the adapters (--adapter): each family's signature, what it reads back, which checks it can run"
    )
    return parser
