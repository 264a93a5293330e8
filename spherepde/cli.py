"""spherepde: the mean-field equation of self-attention dynamics on the sphere S² (HEALPix finite
volumes with atoms, particles and tokens), run from TOML configs, written as NetCDF run files.

    spherepde run CONFIG.toml [--set section.key=value ...] [-o PATH] [--overwrite | --resume]
    spherepde plot RUN.nc [-o DIR] [--movie [--frames N] [--fps F]] [--system K]
    spherepde validate [SUITE ...] --out DIR [--slow] [--quick] [--nside N ...]   (spherepde validate --help lists the suites)
    spherepde sweep SWEEP.toml [--scheduler ADDRESS | --workers N] [--out DIR] [--overwrite] [-v]

Every failure ends with one line on stderr and an exit status:
  0 done (also: --resume of a finished run, which changes nothing)
  2 bad input: config, paths, an existing output without --overwrite, an output another run is
    writing, a run file that cannot be read or resumed; nothing is written
  3 a run guard stopped the run (non-finite or negative density, mass drift, CFL, step collapse):
    the file keeps every snapshot and the state at failure as its last one; or the memory ran
    out (the GPU's for [particles] backend = "cuda": then before anything is written)
  4 writing the output failed (disk full, I/O error): the file keeps every complete snapshot
  130 interrupted (Ctrl-C), 143 terminated (SIGTERM): the file keeps every complete snapshot
  1 an unexpected error (a bug): Python's traceback; the file keeps every complete snapshot
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

EXIT_USAGE, EXIT_GUARD, EXIT_WRITE, EXIT_INTERRUPT, EXIT_TERMINATED = 2, 3, 4, 130, 143


class UsageError(Exception):
    """A bad setting: reported as one line, exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a batch system stopping the job): handled like Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated()


def build_parser():
    from .validation.suites import add_arguments as add_validation_arguments
    from .version import __version__
    from .visualization.plots import DEFAULT_MOVIE_FRAMES

    parser = argparse.ArgumentParser(prog="spherepde", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"spherepde {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a TOML config, write a NetCDF file")
    run.add_argument("config", help="TOML config (see solvers/)")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a config value (TOML syntax), repeatable")
    run.add_argument("-o", "--output", help="output NetCDF path (default: [output] path, else results/CONFIG.nc)")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    mode.add_argument("--resume", action="store_true",
                      help="continue the interrupted run in the output file from its last complete snapshot")
    run.add_argument("--check", action="store_true", help="validate the config and output path, then stop")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="log a line to stderr as each snapshot is written (for batch logs)")

    plot = sub.add_parser(
        "plot", help="plot a run file: density maps, sphere views, diagnostics (and a movie)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Writes, for RUN.nc, into DIR:\n"
        "  RUN_density.png      Mollweide maps of up to six snapshots, one colour scale\n"
        "  RUN_diagnostics.png  alignment, W2 and density-bound time series; t = log beta and\n"
        "                       the atom events (atoms created or merged) marked, a caption line\n"
        "  RUN_sphere.png       first snapshot, the one nearest t = log beta, last: a Mollweide map\n"
        "                       beside the two orthographic hemispheres centred on +-c, c between\n"
        "                       the mass axes of the E-phase and of the last snapshot (the last\n"
        "                       one's when they are within 30 degrees); a colour scale per row\n"
        "and with --movie:\n"
        "  RUN_movie.mp4        the density over time, one frame per snapshot (at most --frames,\n"
        "                       evenly spaced, first and last included), the same three panels\n"
        "                       (H.264, ffmpeg from the imageio-ffmpeg wheel)\n"
        "  RUN_movie.gif        the same frames, for viewers without video (a fixed palette from\n"
        "                       the colour map: no banding)\n"
        "Every figure is titled with beta, the initial law, nside and the spherepde version. Colour\n"
        "scales are logarithmic when the density spans more than a decade; atoms (point masses)\n"
        "are drawn as red discs of area proportional to their mass, with a size key.")
    plot.add_argument("run_file", help="NetCDF file written by `spherepde run`")
    plot.add_argument("-o", "--out", help="output directory (default: next to the run file)")
    plot.add_argument("--movie", action="store_true",
                      help="also write an animation of the density: MP4 and GIF")
    plot.add_argument("--frames", type=int, default=None, metavar="N",
                      help="most frames of the movie: longer runs are subsampled evenly "
                      f"(default {DEFAULT_MOVIE_FRAMES})")
    plot.add_argument("--fps", type=float, default=8.0, metavar="F", help="movie frames per second (default 8)")
    plot.add_argument("--system", type=int, default=0, metavar="K",
                      help="a file of batched systems ([particles] systems): which one to plot (default 0)")

    add_validation_arguments(sub.add_parser("validate", help="run validation suites and write reports"))

    sweep = sub.add_parser("sweep", help="run a parameter sweep on dask.distributed, combine its runs")
    sweep.add_argument("sweep_file", metavar="SWEEP.toml", help="sweep file (see solvers/sweeps/)")
    sweep.add_argument("--scheduler", metavar="ADDRESS",
                       help="address of a running dask scheduler (default: a local cluster)")
    sweep.add_argument("--workers", type=int, metavar="N", help="worker processes of the local cluster (default 2)")
    sweep.add_argument("--threads-per-run", type=int, default=1, metavar="N", help="numba threads per run (default 1)")
    sweep.add_argument("--out", help="output directory (default: results/NAME/)")
    sweep.add_argument("--overwrite", action="store_true",
                       help="replace run files that hold another config (complete matching runs are still skipped)")
    sweep.add_argument("--check", action="store_true",
                       help="expand and check the sweep, list its runs and what each needs, then stop")
    sweep.add_argument("-v", "--verbose", action="store_true", help="log a line per run (for batch logs)")
    return parser


def _check_output_dir(path, option="--out"):
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # a name of this process's own: runs started in the same folder at once do not race on it
        probe = out / f".spherepde-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"{option} {path}: not writable ({exc.strerror})") from None
    return out


def _check_output_file(path, overwrite, option, resume=False):
    """The output file can be created: its folder is writable and it does not exist (unless
    overwrite); with resume, it must exist. Creates the folder; writes nothing else."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if resume and not path.is_file():
        raise UsageError(f"{option} {path}: no such file to resume (run without --resume to start)")
    if path.exists() and not (overwrite or resume):
        raise UsageError(f"{option} {path}: exists (use --overwrite to replace it, --resume to continue it)")
    _check_output_dir(path.parent if str(path.parent) else ".", option)
    return path


def _run(args):
    from .runner.config import ConfigError, apply_overrides, load, resolve

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
    path = _check_output_file(path, args.overwrite, option, args.resume)
    cfg["output"]["path"] = str(path)
    if args.check:
        print(f"spherepde run: config OK, output → {path}")
        return 0
    from .runner.run import execute
    from .solvers.guards import RunFailure
    from .storage.locking import LockError, output_lock
    from .storage.runfile import RunFileError, WriteError

    def note(text):
        print(f"spherepde: note: {text}", file=sys.stderr)

    # SIGTERM handled like Ctrl-C (signal handlers can only be set from the main thread)
    previous = (signal.signal(signal.SIGTERM, _terminate)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        with output_lock(path, note=note):
            # checked again under the lock: another run may have created the file meanwhile
            _check_output_file(path, args.overwrite, option, args.resume)
            if path.exists() and not args.resume:
                path.unlink()
            execute(cfg, path, snapshot_log=sys.stderr if args.verbose else None, resume=args.resume)
    except (LockError, RunFileError) as exc:
        raise UsageError(str(exc)) from None
    except RunFailure as exc:
        print(f"spherepde: run failed: {exc}; snapshots kept in {path}: {exc.kept}, then the state at "
              "failure (snapshot_kind = 1)", file=sys.stderr)
        return EXIT_GUARD
    except WriteError as exc:
        print(f"spherepde: error: {exc}", file=sys.stderr)
        return EXIT_WRITE
    except MemoryError as exc:  # the GPU's (spherepde.summation.cuda.DeviceMemoryError) or the host's
        kept = f"; complete snapshots kept in {path}" if path.exists() else ""
        print(f"spherepde: run failed: {exc or 'out of memory'}{kept}", file=sys.stderr)
        return EXIT_GUARD
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _plot(args):
    from .visualization.plots import DEFAULT_MOVIE_FRAMES, plot_run

    frames = DEFAULT_MOVIE_FRAMES if args.frames is None else args.frames
    if frames < 1:
        raise UsageError(f"--frames: must be >= 1, got {frames}")
    if not args.fps > 0 or args.fps > 100:
        raise UsageError(f"--fps: must be in (0, 100], got {args.fps}")
    if not args.movie and args.frames is not None:
        raise UsageError("--frames: only with --movie")
    run_file = Path(args.run_file)
    if not run_file.is_file():
        raise UsageError(f"RUN_FILE {run_file}: no such file")
    out = _check_output_dir(args.out if args.out else run_file.parent, "-o")
    from .storage.runfile import RunFileError
    from .visualization.plots import NotPlottable

    try:
        paths = plot_run(run_file, out, movie=args.movie, max_frames=frames, fps=args.fps, system=args.system)
    except RunFileError as exc:
        raise UsageError(f"RUN_FILE {exc}") from None
    except NotPlottable as exc:
        message = str(exc)
        raise UsageError(message if message.startswith("--") else f"RUN_FILE {run_file}: {exc}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"RUN_FILE {run_file}: not a spherepde run file ({exc})") from None
    for p in paths:
        print(f"spherepde plot: wrote {p}")
    return 0


def _validate(args):
    from .validation.suites import run_all, unknown_suite

    message = unknown_suite(args.suites)
    if message:
        raise UsageError(message)
    _check_output_dir(args.out)
    run_all(args, say=lambda text: print(text, flush=True))
    return 0


def _sweep(args):
    from .runner.sweep import SweepError, SweepFailure, expand, plan, run_sweep

    if args.scheduler and args.workers is not None:
        raise UsageError("--workers: the cluster at --scheduler has its own workers")
    for option, value in (("--workers", args.workers), ("--threads-per-run", args.threads_per_run)):
        if value is not None and value < 1:
            raise UsageError(f"{option}: must be >= 1, got {value}")
    if args.check:
        try:
            specs = expand(args.sweep_file, args.out)
            actions = plan(specs, args.overwrite)
        except SweepError as exc:
            raise UsageError(str(exc)) from None
        for spec, action in zip(specs, actions):
            values = ", ".join(f"{k} = {v}" for k, v in spec.params.items())
            print(f"{spec.run_id}  {action:8s} {values}")
        print(f"spherepde sweep: {len(specs)} runs OK, output → {specs[0].path.parent}/")
        return 0
    previous = (signal.signal(signal.SIGTERM, _terminate)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        run_sweep(args.sweep_file, out_dir=args.out, scheduler=args.scheduler, workers=args.workers or 2,
                  threads_per_run=args.threads_per_run, overwrite=args.overwrite, verbose=args.verbose)
    except SweepError as exc:
        raise UsageError(str(exc)) from None
    except SweepFailure:  # each failure was reported as it happened
        return 1
    except KeyboardInterrupt as exc:
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"spherepde sweep: {what}; every complete run file is kept, interrupted runs keep their "
              "snapshots: the same command continues the sweep", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPT
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def main(argv=None):
    args = build_parser().parse_args(argv)
    handler = {"run": _run, "plot": _plot, "validate": _validate, "sweep": _sweep}[args.command]
    try:
        return handler(args)
    except UsageError as exc:
        print(f"spherepde: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"spherepde: {what}; every snapshot written so far is kept (continue with --resume)",
              file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPT


if __name__ == "__main__":
    sys.exit(main())
