"""Command line.

    spherepde run CONFIG.toml [--set section.key=value ...] [-o PATH] [--overwrite]
    spherepde plot RUN.nc [-o DIR]
    spherepde validate SUITE ... --out DIR [--slow] [--nside N ...]   (transport, exact, lagrangian)

Bad input (config, paths) ends with one line on stderr naming the setting, and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SUITES = ("transport", "exact", "lagrangian")


class UsageError(Exception):
    """A bad setting: reported as one line, exit status 2."""


def _power_of_two(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"nside must be an integer, got {text!r}") from None
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"nside must be a positive power of two, got {value}")
    return value


def build_parser():
    from spherepde import __version__

    parser = argparse.ArgumentParser(prog="spherepde", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"spherepde {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a TOML config, write a NetCDF file")
    run.add_argument("config", help="TOML config (see solvers/)")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a config value (TOML syntax), repeatable")
    run.add_argument("-o", "--output", help="output NetCDF path (default: [output] path, else results/CONFIG.nc)")
    run.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    run.add_argument("--check", action="store_true", help="validate the config and output path, then stop")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="log a line to stderr as each snapshot is written (for batch logs)")

    plot = sub.add_parser("plot", help="plot a run file: density maps and diagnostics")
    plot.add_argument("run_file", help="NetCDF file written by `spherepde run`")
    plot.add_argument("-o", "--out", help="output directory (default: next to the run file)")

    val = sub.add_parser("validate", help="run validation suites and write reports")
    val.add_argument("suites", nargs="+", choices=SUITES, metavar="SUITE",
                     help=f"one or more of: {', '.join(SUITES)}")
    val.add_argument("--out", required=True, help="output directory for reports and figures")
    val.add_argument("--slow", action="store_true", help="add the finest meshes (nside 128)")
    val.add_argument("--nside", type=_power_of_two, nargs="+", help="override the mesh list")
    return parser


def _check_output_dir(path, option="--out"):
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".spherepde-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"{option} {path}: not writable ({exc.strerror})") from None
    return out


def _check_output_file(path, overwrite, option):
    """The output file can be created: its folder is writable and it does not exist (unless
    overwrite). Creates the folder; writes nothing else."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if path.exists() and not overwrite:
        raise UsageError(f"{option} {path}: exists (use --overwrite to replace it)")
    _check_output_dir(path.parent if str(path.parent) else ".", option)
    return path


def _run(args):
    from spherepde.config import ConfigError, apply_overrides, load, resolve

    try:
        cfg = resolve(apply_overrides(load(args.config), args.set))
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if args.output:
        path, option = args.output, "-o"
    elif cfg["output"]["path"]:
        path, option = cfg["output"]["path"], "[output] path"
    else:
        path, option = str(Path("results") / (Path(args.config).stem + ".nc")), "output path"
    path = _check_output_file(path, args.overwrite, option)
    cfg["output"]["path"] = str(path)
    if args.check:
        print(f"spherepde run: config OK, output → {path}")
        return 0
    from spherepde.run import execute

    if path.exists():
        path.unlink()
    execute(cfg, path, snapshot_log=sys.stderr if args.verbose else None)
    return 0


def _plot(args):
    from spherepde.plots import plot_run

    run_file = Path(args.run_file)
    if not run_file.is_file():
        raise UsageError(f"RUN_FILE {run_file}: no such file")
    out = _check_output_dir(args.out if args.out else run_file.parent, "-o")
    try:
        paths = plot_run(run_file, out)
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"RUN_FILE {run_file}: not a spherepde run file ({exc})") from None
    for p in paths:
        print(f"spherepde plot: wrote {p}")
    return 0


def _validate(args):
    _check_output_dir(args.out)
    for suite in args.suites:
        start = time.perf_counter()
        print(f"spherepde validate {suite} → {args.out}", flush=True)
        if suite == "transport":
            from validation import transport

            transport.run_suite(args.out, slow=args.slow, nsides=args.nside)
        elif suite == "exact":
            from validation import exact

            exact.run_suite(args.out, slow=args.slow, nsides=args.nside)
        elif suite == "lagrangian":
            from validation import lagrangian

            lagrangian.run_suite(args.out, slow=args.slow, nsides=args.nside)
        print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    handler = {"run": _run, "plot": _plot, "validate": _validate}[args.command]
    try:
        return handler(args)
    except UsageError as exc:
        print(f"spherepde: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spherepde: interrupted; every snapshot written so far is kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
