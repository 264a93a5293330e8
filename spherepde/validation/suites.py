"""The one registry of validation suites: what `spherepde validate` and
`python -m spherepde.validation` run.

Each suite is a module of spherepde.validation with a `run_suite(out, ...)` that writes its report
into `out`; the registry says which of the options quick, slow and nsides it takes. Suites marked
`part_of="variants"` run inside the variants suite (and alone by name); suites marked
`in_default=False` (hours long) run only when named.
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import NamedTuple

__all__ = ["Suite", "SUITES", "DEFAULT", "QUICK_NSIDES", "run", "run_all", "add_arguments", "unknown_suite", "main"]

QUICK_NSIDES = [8, 16]  # --quick for the suites that take a mesh list


class Suite(NamedTuple):
    name: str  # spherepde validate NAME; the module spherepde.validation.NAME
    report: str  # the report file it writes into the output folder
    what: str  # one line: what it checks
    options: tuple = ()  # which of "quick", "slow", "nsides" its run_suite takes
    quick_nsides: bool = False  # --quick gives it QUICK_NSIDES unless --nside is given
    part_of: str | None = None  # run by that suite, not by a bare `spherepde validate`
    in_default: bool = True  # False: run only when named (a study of hours)


SUITES = {s.name: s for s in (
    Suite("transport", "transport.md", "published transport tests (Williamson, Nair–Lauritzen)",
          ("slow", "nsides"), quick_nsides=True),
    Suite("exact", "exact.md", "the attention field and the Eulerian solver against exact solutions",
          ("slow", "nsides"), quick_nsides=True),
    Suite("lagrangian", "lagrangian.md", "the Eulerian solver against quadrature particles", ("slow", "nsides"),
          quick_nsides=True),
    Suite("paper", "report.md", "the seed paper's experiments", ("quick", "slow", "nsides")),
    Suite("atoms", "atoms.md", "atoms: convergence of the Eulerian state with point masses",
          ("quick", "slow", "nsides")),
    Suite("tails", "tails.md", "the density's tails relative to f against the exact β = ∞ solution",
          ("quick", "slow", "nsides")),
    Suite("variants", "variants.md", "the model variants (runs the three suites below)", ("quick",)),
    Suite("unnormalised", "unnormalised.md", "unnormalised attention and the log-partition function", ("quick",),
          part_of="variants"),
    Suite("noise", "noise.md", "diffusion on the mesh and Brownian particles", ("quick", "slow", "nsides"),
          part_of="variants"),
    Suite("heads", "heads.md", "several heads and layer-wise weights", ("quick",), part_of="variants"),
    Suite("rotf", "rotf.md", "the rotf phase diagram: clustered pairs of n = 32 tokens against β and t, d = 2, 8, 128",
          ("quick",)),
    Suite("finite_n", "finite_n.md", "tokens against n (500 … 32 000, 8 seeds batched) beside the mean field",
          ("quick",), in_default=False),
)}
DEFAULT = tuple(name for name, s in SUITES.items() if s.part_of is None and s.in_default)


def run(name, out, quick=False, slow=False, nsides=None, progress=True):
    """Run one registered suite into `out` with the options it takes; returns what its run_suite
    returns."""
    suite = SUITES[name]
    if nsides is None and quick and suite.quick_nsides:
        nsides = list(QUICK_NSIDES)
    given = {"quick": quick, "slow": slow, "nsides": nsides}
    options = {k: v for k, v in given.items() if k in suite.options}
    module = importlib.import_module(f"{__package__}.{name}")
    return module.run_suite(out, progress=progress, **options)


def _power_of_two(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"nside must be an integer, got {text!r}") from None
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"nside must be a positive power of two, got {value}")
    return value


def add_arguments(parser):
    """The arguments of `spherepde validate` (also `python -m spherepde.validation`)."""
    names = ", ".join(DEFAULT)
    parts = ", ".join(name for name, s in SUITES.items() if s.part_of or not s.in_default)
    # no choices= here: argparse checks a '*' positional's default list against them as one value
    parser.add_argument("suites", nargs="*", metavar="SUITE",
                        help=f"any of: {names} (default: these, in this order); also {parts} alone")
    parser.add_argument("--out", required=True, help="output directory for reports and figures")
    parser.add_argument("--slow", action="store_true", help="add each suite's finest meshes (docs/validation.md)")
    parser.add_argument("--nside", type=_power_of_two, nargs="+", help="override the mesh list")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized runs: meshes 8 and 16 (unless --nside), paper: nside 8, 300 tokens, t <= 8")
    return parser


def unknown_suite(names) -> str | None:
    """The message for the first name that is no registered suite, else None."""
    for name in names:
        if name not in SUITES:
            return f"validate: unknown suite {name!r} (choose from {', '.join(SUITES)})"
    return None


def run_all(args, say=print):
    """Run the suites of parsed arguments (add_arguments), each timed."""
    for name in args.suites or DEFAULT:
        start = time.perf_counter()
        say(f"spherepde validate {name} → {args.out}")
        run(name, args.out, quick=args.quick, slow=args.slow, nsides=args.nside)
        say(f"  done in {time.perf_counter() - start:.0f} s")


def main(argv=None) -> int:
    """`python -m spherepde.validation [SUITE ...] --out DIR [--quick | --slow] [--nside N ...]`."""
    parser = add_arguments(argparse.ArgumentParser(prog="python -m spherepde.validation",
                                                   description="Run validation suites and write reports."))
    args = parser.parse_args(argv)
    message = unknown_suite(args.suites)
    if message:
        parser.exit(2, f"{message}\n")
    run_all(args, say=lambda text: print(text, flush=True))
    return 0
