"""Command line: `spherepde validate SUITE --out DIR`."""

from __future__ import annotations

import argparse
import sys
import time

SUITES = ("transport", "exact")


def _power_of_two(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"nside must be an integer, got {text!r}") from None
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"nside must be a positive power of two, got {value}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(prog="spherepde", description=__doc__)
    from spherepde import __version__

    parser.add_argument("--version", action="version", version=f"spherepde {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    val = sub.add_parser("validate", help="run validation suites and write reports")
    val.add_argument("suites", nargs="+", choices=SUITES, metavar="SUITE",
                     help=f"one or more of: {', '.join(SUITES)}")
    val.add_argument("--out", required=True, help="output directory for reports and figures")
    val.add_argument("--slow", action="store_true", help="add the finest meshes (nside 128)")
    val.add_argument("--nside", type=_power_of_two, nargs="+", help="override the mesh list")
    return parser


def _check_output_dir(path):
    from pathlib import Path

    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".spherepde-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise SystemExit(f"spherepde: error: --out {path}: not writable ({exc.strerror})") from None
    return out


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "validate":
        try:
            _check_output_dir(args.out)
        except SystemExit as exc:
            print(exc, file=sys.stderr)
            return 2
        for suite in args.suites:
            start = time.perf_counter()
            print(f"spherepde validate {suite} → {args.out}", flush=True)
            if suite == "transport":
                from validation import transport

                transport.run_suite(args.out, slow=args.slow, nsides=args.nside)
            elif suite == "exact":
                from validation import exact

                exact.run_suite(args.out, slow=args.slow, nsides=args.nside)
            print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
