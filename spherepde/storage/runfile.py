"""NetCDF output of a run, appended one snapshot at a time (the user's page is
docs/file_format.md).

Layout (NETCDF4 format, so uint64 cell ids survive):
- dimensions cell (npix) and time (unlimited);
- cell(cell) int64, the CF-1.13 index coordinate (standard_name = "healpix_index"): how
  cf-python/cfdm, xdggs' convention="cf" decoder, easygems and CDO find the cells; the same
  variable CDO 2.6 writes for a HEALPix grid;
- cell_ids(cell) uint64 with exactly grid_name="healpix", level, indexing_scheme="nested" (and no
  other attribute), so `xdggs.decode(ds)` works without arguments;
- crs: 0-d variable with the CF-1.13 healpix grid mapping (and nothing else), referenced by
  grid_mapping="crs";
- time(time), dimensionless depth (units "1", no axis or standard_name: CF keeps those for
  calendar time); density(time, cell); one (time) variable per diagnostic;
- snapshot_complete(time): 1 once the snapshot is on disk; snapshot_kind(time): 0 a regular
  snapshot, 1 the state at a guard failure (the last snapshot of a failed run);
- global attributes: Conventions="CF-1.13", config (the resolved config as JSON), spherepde
  version, creation time, complete (1 only for a finished run), failure (the message of a
  guard failure), history (resumptions), and run metadata. Every integer attribute is a 32-bit
  int (CDO drops int64 global attributes from what it writes, and its HEALPix detection wants a
  plain int refinement_level).
Files written before the cell dimension was renamed (dimension `cells`, no `cell` index) are
still read: open_run renames the dimension and adds the index coordinate.

Reliability:
- every snapshot is written and flushed as soon as it exists (`RunWriter.append`), its marker
  last, so a run killed midway leaves a file with every snapshot written so far;
- each snapshot's data live in chunks of their own (one time index per chunk), and every chunk
  carries an HDF5 Fletcher-32 checksum: a flipped byte makes the read fail instead of returning a
  wrong number;
- every snapshot slot is written when the file is created (`RunWriter._reserve`), so the file
  has its final size before the first step: a disk too small fails then, before anything is
  computed; the run only rewrites allocated chunks in place and never makes HDF5 allocate, which
  is what can leave a file that does not open after a failed flush (measured with a file-size
  limit: a failure while HDF5 adds chunk-index nodes made the file unreadable);
- a write error (full disk, quota, I/O error) raises WriteError; the file keeps every complete
  snapshot;
- Fletcher-32 covers a chunk's bytes but not HDF5's chunk index, which maps chunks to time
  indices (measured: one flipped bit there served a snapshot's chunk at another index and left
  one unread); so every snapshot carries snapshot_digest, a SHA-256 of its time index and its
  values (the variables named in the digest's `covers`), written before its marker and checked
  on every read against the values as loaded; the series rewritten at the end of a run (`rewritten`) are covered instead by
  series_digest, an attribute of the end of the run (checked once the run is complete);
- HDF5 does not checksum attributes and names, so the file carries its own: layout_digest covers
  the names, dimensions, types and attributes fixed when the file is created (config included),
  end_digest the attributes of the end of the run (RUN_END_ATTRS), rewritten with them;
- HDF5 can loop forever or crash on some damaged files (measured: a flipped bit in its global
  heap), so a file is first read in a forked child that can be killed (`_checked_in_child`);
- `open_run` raises RunFileError (with the path) for anything that is not a readable run file,
  a damaged layout included; run-end attributes that fail their checksum (damage, or a kill
  while they were written) are dropped and the run reported as not complete (`--resume` then
  recomputes them).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import signal
import time as _time
import warnings

import numpy as np

from .schema import (
    CELL_DIM,
    CELL_INDEX_ATTRS,
    DENSITY_ATTRS,
    OLD_CELL_DIM,
    TIME_ATTRS,
    attr_value,
    crs_attrs,
    int_attr,
    xdggs_attrs,
)

__all__ = ["RunWriter", "open_run", "read_resume_point", "ResumePoint", "RunFileError", "WriteError",
           "SNAPSHOT_REGULAR", "SNAPSHOT_FAILURE"]

SNAPSHOT_REGULAR, SNAPSHOT_FAILURE = 0, 1
# global attributes written at the end of a run (or at a failure, or a resumption); every other
# attribute is fixed when the file is created
RUN_END_ATTRS = ("complete", "C0", "steps", "rejected_steps", "wall_seconds", "particle_field_evaluations",
                 "failure", "failure_time", "history", "series_digest")
SNAPSHOT_DIGEST = "snapshot_digest"
UNDIGESTED = ("snapshot_complete", SNAPSHOT_DIGEST)  # the marker is written after the digest
DIGESTS = ("layout_digest", "end_digest")
# HDF5 can loop forever on a damaged file. A reading child counts as hanging once it has used
# PARSE_SECONDS of CPU time (plus 1 s per 20 MB): CPU time, not wall time, so that a child starved
# of the processor on a busy machine is never taken for a hang. PARSE_WALL_FACTOR × that in wall
# time ends a child that blocks without computing.
PARSE_SECONDS = 30.0
PARSE_WALL_FACTOR = 10.0


class RunFileError(ValueError):
    """A file that cannot be read (or resumed) as a spherepde run file; the message names it."""


class WriteError(OSError):
    """Writing the run file failed (disk full, quota, I/O error); the message names the file."""


def _plain(value):
    """An attribute value as plain JSON data."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _hash_value(h, name, value):
    """Feed one named value, as its stored bytes, to the SHA-256 h."""
    h.update(name.encode())
    h.update(np.ascontiguousarray(value).tobytes())


def _hash_int(h) -> int:
    """The first 8 bytes of the SHA-256 h as an int64 (what a digest variable stores)."""
    return int(np.frombuffer(h.digest()[:8], dtype="<i8")[0])


def _value_digest(head: bytes, named_values) -> int:
    """The int64 digest of head and (name, value as stored) pairs, in the order given."""
    h = hashlib.sha256(head)
    for name, value in named_values:
        _hash_value(h, name, value)
    return _hash_int(h)


def _snapshot_digest(index: int, stored: dict, covers) -> int:
    """The digest of snapshot `index`: its time index and the values it stored, name by name."""
    return _value_digest(np.int64(index).tobytes(), ((name, stored[name]) for name in covers))


def _series_digest(nc, names) -> str:
    """The digest of the series rewritten at the end of a run (every slot), 16 hex digits (the
    fixed width lets the attribute be replaced in place: SERIES_DIGEST_PLACEHOLDER)."""
    return _hex_series_digest((name, nc.variables[name][...]) for name in names)


def _hex_series_digest(named_values) -> str:
    return f"{_value_digest(b'series', named_values) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


SERIES_DIGEST_PLACEHOLDER = "0" * 16
# The attributes a guard failure writes, reserved at creation with values of their final size
# and rewritten in place: a new or longer attribute grows HDF5's object header, and under a full
# disk or a file-size limit a failed header write leaves a file that no longer opens (measured:
# "NetCDF: Can't open HDF5 attribute" after a guard failure in a file capped at the size of the
# run without it). The failure message is padded or cut to FAILURE_WIDTH characters; open_run
# strips it and drops the placeholders of a run that did not fail.
FAILURE_WIDTH = 1024
RESERVED_ATTRS = {"failure": " " * FAILURE_WIDTH, "failure_time": math.nan, "wall_seconds": math.nan}


def _layout(nc) -> dict:
    """What is fixed at creation: names, dimensions, types and attributes (not the time length)."""
    return {
        "attrs": {k: _plain(nc.getncattr(k)) for k in nc.ncattrs() if k not in RUN_END_ATTRS + DIGESTS},
        "dims": {name: len(d) for name, d in nc.dimensions.items() if name != "time"},
        "vars": {name: [list(v.dimensions), str(v.dtype), {a: _plain(v.getncattr(a)) for a in v.ncattrs()}]
                 for name, v in nc.variables.items()},
    }


def _run_end(nc) -> dict:
    return {k: _plain(nc.getncattr(k)) for k in RUN_END_ATTRS if k in nc.ncattrs()}


def timestamp():
    """Now, UTC, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class RunWriter:
    """Create the run file (or reopen it to resume) and append snapshots.

    mesh: the HEALPix mesh of the density, or None for a run of the particles alone (then the
    file has no cell dimension and no density). variables: name → (long_name, units) of the per-time diagnostics, declared up front.
    dims: extra dimensions name → size (e.g. particle, xyz); arrays: per-time arrays over them,
    name → (dims without time, long_name, units); static: arrays without time,
    name → (dims, values, long_name, units). n_snapshots: slots written at creation (_reserve).
    rewritten: the variables whose series set_variable rewrites at the end of the run (outside
    the snapshot digests, covered by series_digest once the run is complete).
    Every method that writes raises WriteError when the file system refuses.
    """

    def __init__(self, path, mesh, config: dict, variables: dict, attrs: dict | None = None,
                 dims: dict | None = None, arrays: dict | None = None, static: dict | None = None,
                 n_snapshots: int = 1, rewritten=()):
        import netCDF4

        from ..version import __version__

        self.path = str(path)
        self.variables = dict(variables)
        self.arrays = dict(arrays or {})
        self.rewritten = sorted(rewritten)
        unknown = set(self.rewritten) - set(self.variables)
        if unknown:
            raise ValueError(f"rewritten variables are not declared: {sorted(unknown)}")
        self.next_index = 0
        with self._writing("the file header"):
            self._nc = nc = netCDF4.Dataset(self.path, "w", format="NETCDF4")
        try:
            with self._writing("the file header"):
                self._define(nc, mesh, dims, static)
                self._reserve(n_snapshots)
                glob = {
                    "Conventions": "CF-1.13",
                    "title": "spherepde run: mean-field self-attention dynamics on S²",
                    "spherepde_version": __version__,
                    "created": timestamp(),
                    "config": json.dumps(config),
                    "complete": np.int32(0),
                }
                if self.rewritten:  # set at the end: in place, the file does not grow then
                    glob["series_digest"] = SERIES_DIGEST_PLACEHOLDER
                glob.update(RESERVED_ATTRS)  # likewise for a failure (see RESERVED_ATTRS)
                glob.update({k: attr_value(v) for k, v in (attrs or {}).items()})
                nc.setncatts(glob)
                nc.setncatts({"layout_digest": _digest(_layout(nc)), "end_digest": _digest(_run_end(nc))})
                self._flush()
        except BaseException as exc:
            self.abort()
            with contextlib.suppress(OSError):  # a file without its header holds nothing
                os.unlink(self.path)
            if isinstance(exc, WriteError):
                raise WriteError(f"{exc}; nothing was computed yet and no file is left") from exc
            raise

    def _define(self, nc, mesh, dims, static):
        # one time index per chunk, each with a checksum (module docstring)
        def per_time(name, dtype, var_dims=(), sizes=(), **kw):
            return nc.createVariable(name, dtype, ("time", *var_dims), chunksizes=(1, *sizes),
                                     fletcher32=True, **kw)

        if mesh is not None:  # no mesh: a run of the particles alone
            nc.createDimension(CELL_DIM, mesh.npix)
        nc.createDimension("time", None)
        if mesh is not None:
            self._define_cells(nc, mesh)
        time = per_time("time", "f8", fill_value=False)
        time.setncatts(TIME_ATTRS)
        if mesh is not None:
            dens = per_time("density", "f8", (CELL_DIM,), (mesh.npix,), fill_value=False)
            # crs listed too: easygems (is_nested, get_nside) and cf-xarray's DataArray-level grid
            # mapping then find it on a plain xr.open_dataset (no decode_coords="all")
            dens.setncatts({**DENSITY_ATTRS, "coordinates": "cell_ids crs"})
        for name, (long_name, units) in self.variables.items():
            per_time(name, "f8", fill_value=False).setncatts({"long_name": long_name, "units": units})
        for name, size in (dims or {}).items():
            nc.createDimension(name, size)
        for name, (var_dims, long_name, units) in self.arrays.items():
            sizes = tuple(len(nc.dimensions[d]) for d in var_dims)
            per_time(name, "f8", var_dims, sizes, fill_value=False).setncatts(
                {"long_name": long_name, "units": units})
        for name, (var_dims, values, long_name, units) in (static or {}).items():
            var = nc.createVariable(name, "f8", var_dims, fill_value=False, fletcher32=True)
            var.setncatts({"long_name": long_name, "units": units})
            var[:] = np.asarray(values, dtype=float)
        per_time("snapshot_complete", "i1", fill_value=np.int8(0)).setncatts(
            {"long_name": "1 once every variable of the snapshot is on disk", "units": "1"})
        # no fill value: 0 is a value here (written with every snapshot, before its marker)
        per_time("snapshot_kind", "i1", fill_value=False).setncatts(
            {"long_name": "0: regular snapshot; 1: state at a guard failure", "units": "1",
             "flag_values": np.array([SNAPSHOT_REGULAR, SNAPSHOT_FAILURE], dtype=np.int8),
             "flag_meanings": "regular failure_state"})
        covers = sorted(name for name, var in nc.variables.items() if var.dimensions[:1] == ("time",)
                        and name not in UNDIGESTED and name not in self.rewritten)
        per_time(SNAPSHOT_DIGEST, "i8", fill_value=False).setncatts(
            {"long_name": "SHA-256 (first 8 bytes) of the time index and the values of the snapshot",
             "units": "1", "covers": " ".join(covers), "rewritten": " ".join(self.rewritten)})
        self._covers = covers

    @staticmethod
    def _define_cells(nc, mesh):
        """The HEALPix cells: the CF-1.13 index, a coordinate variable (named as its dimension, so
        no `coordinates` attribute needs to list it), found by its standard_name (cell_ids cannot
        carry one); xdggs' cell_ids; the grid mapping."""
        index = nc.createVariable(CELL_DIM, "i8", (CELL_DIM,), fletcher32=True)
        index.setncatts(CELL_INDEX_ATTRS)
        index[:] = mesh.cell_ids.astype(np.int64)
        ids = nc.createVariable("cell_ids", "u8", (CELL_DIM,), fletcher32=True)
        ids.setncatts(xdggs_attrs(mesh.level))
        ids[:] = mesh.cell_ids.astype(np.uint64)
        crs = nc.createVariable("crs", "i4")
        crs.setncatts(crs_attrs(mesh.level))
        crs.assignValue(0)

    def _reserve(self, n_snapshots):
        """Write every snapshot slot now (NaN, marked incomplete), so that the file has its final
        size before the first step: a disk too small fails here, before anything is computed,
        and the run itself only rewrites allocated chunks in place. (A flush that fails while
        it allocates, e.g. the chunk index nodes HDF5 adds every 64 snapshots, leaves nodes
        referenced but unwritten, and the file no longer opens.)"""
        nc = self._nc
        for var in nc.variables.values():
            if var.dimensions[:1] != ("time",):
                continue
            fill = 0 if var.dtype.kind == "i" else math.nan
            rows = max(1, 2**23 // max(1, int(np.prod(var.shape[1:], dtype=np.int64)) * 8))  # ≤ 8 MiB
            for k in range(0, n_snapshots, rows):
                block = np.full((min(rows, n_snapshots - k), *var.shape[1:]), fill, dtype=var.dtype)
                var[k:k + block.shape[0], ...] = block

    @classmethod
    def reopen(cls, path, variables: dict, arrays: dict, next_index: int):
        """Reopen an existing run file to continue it: snapshots are written from next_index on
        (any later ones, cut or a failure state, are overwritten in place)."""
        import netCDF4

        self = cls.__new__(cls)
        self.path = str(path)
        self.variables = dict(variables)
        self.arrays = dict(arrays or {})
        self.next_index = int(next_index)
        with self._writing("the file (reopened to resume it)"):
            self._nc = netCDF4.Dataset(self.path, "a")
        digest = self._nc.variables.get(SNAPSHOT_DIGEST)
        # files from before the digests get none
        self._covers = digest.getncattr("covers").split() if digest is not None else None
        self.rewritten = digest.getncattr("rewritten").split() if digest is not None else []
        # a scalar record the file has (and its digests cover) but this layout no longer writes,
        # e.g. log_density_anchor of a run file written at tail_anchor = 0 before the key left
        # that layout: it is written on (the run's value, NaN if it has none), so the digests hold
        for name in self._covers or ():
            var = self._nc.variables.get(name)
            if (name not in self.variables and name not in self.arrays and var is not None
                    and var.dimensions == ("time",) and var.dtype.kind == "f" and name != "time"):
                self.variables[name] = (var.getncattr("long_name") if "long_name" in var.ncattrs() else name,
                                        var.getncattr("units") if "units" in var.ncattrs() else "1")
        missing = sorted((set(self.variables) | set(self.arrays)) - set(self._nc.variables))
        if missing:
            self._nc.close()
            raise RunFileError(f"{self.path}: cannot resume, the file has no {', '.join(missing)} "
                               "(written by another spherepde version or config)")
        return self

    def begin_resume(self, attrs: dict, delete=()):
        """The first writes of a resumed run, before it computes anything: the slots it will
        write (next_index on) are read through this handle and written back unchanged, the
        end-of-run attributes are set (set_run_attrs: e.g. the history entry), and all is flushed.
        HDF5 reads some of a file's structures only when it writes (a variable's attributes in
        append mode, the index of the global attributes when one is added), so the read-only
        checks of read_resume_point can pass on a damaged file whose first write then fails. The
        slots are allocated already, so a netCDF library error here (a RuntimeError, no errno)
        means damage: RunFileError, exit 2. An OSError stays a WriteError (the file system
        refused). The writer is closed on either error."""
        nc = self._nc
        try:
            with self._writing("the unwritten snapshots (rewritten unchanged to check the file)"):
                nc.set_auto_mask(False)  # the values as stored
                for var in nc.variables.values():
                    if var.dimensions[:1] == ("time",) and self.next_index < var.shape[0]:
                        var[self.next_index:, ...] = var[self.next_index:, ...]
                nc.set_auto_mask(True)
            self.set_run_attrs(attrs, delete)
            with self._writing("the resumed file's attributes"):
                self._flush()
        except WriteError as exc:
            self.abort()
            if isinstance(exc.__cause__, RuntimeError):
                raise RunFileError(f"{self.path}: cannot resume, damaged run file ({exc.__cause__} at its "
                                   "first write)") from exc
            raise
        except BaseException:
            self.abort()
            raise

    @contextlib.contextmanager
    def _writing(self, what):
        """Turn the file system's refusal into one WriteError naming the file and what was written."""
        try:
            yield
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, WriteError):
                raise
            try:
                free = f"{shutil.disk_usage(os.path.dirname(os.path.abspath(self.path))).free / 2**20:.1f} MiB free"
            except OSError:
                free = "free space unknown"
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise WriteError(f"{self.path}: writing {what} failed ({reason}; {free} on its file system)") from exc

    def _flush(self):
        self._nc.sync()

    def append(self, time: float, density, values: dict, arrays: dict | None = None,
               kind: int = SNAPSHOT_REGULAR) -> int:
        """Write one snapshot (density (ignored in a file without mesh), scalar values, the
        declared arrays: NaN where not given) and flush it to disk; returns its index."""
        nc = self._nc
        k = self.next_index
        with self._writing(f"snapshot {k} (t = {time:.6g})"):
            if k < len(nc.dimensions["time"]) and np.ma.filled(nc.variables["snapshot_complete"][k], 0) == 1:
                nc.variables["snapshot_complete"][k] = 0  # overwriting a failure state
                self._flush()
            # every value as stored, for the digest
            stored = {"snapshot_kind": np.int8(kind), "time": np.float64(time)}
            if "density" in nc.variables:
                stored["density"] = np.asarray(density, dtype=float)
            for name in self.arrays:
                value = (arrays or {}).get(name)
                stored[name] = (np.full(nc.variables[name].shape[1:], math.nan) if value is None
                                else np.asarray(value, dtype=float))
            for name in self.variables:
                value = values.get(name, math.nan)
                stored[name] = np.float64(math.nan if value is None else value)
            for name, value in stored.items():
                nc.variables[name][k, ...] = value
            if self._covers is not None:
                nc.variables[SNAPSHOT_DIGEST][k] = _snapshot_digest(k, stored, self._covers)
            self._flush()
            # written last, in its own flush: a snapshot interrupted mid-write stays marked 0
            nc.variables["snapshot_complete"][k] = 1
            self._flush()
        self.next_index = k + 1
        return k

    def set_variable(self, name, values):
        """Overwrite a (time) variable from the start (for quantities only known at the end)."""
        values = np.asarray(values, dtype=float)
        with self._writing(name):
            self._nc.variables[name][: values.size] = values

    def set_run_attrs(self, attrs: dict, delete=()):
        """Set (and delete) attributes of the end of the run (RUN_END_ATTRS), with their digest."""
        unknown = (set(attrs) | set(delete)) - set(RUN_END_ATTRS)
        if unknown:
            raise ValueError(f"not an attribute of the end of a run: {sorted(unknown)}")
        nc = self._nc
        values = {k: attr_value(v) for k, v in attrs.items()}
        if "failure" in values:  # the reserved width (RESERVED_ATTRS)
            values["failure"] = str(values["failure"])[:FAILURE_WIDTH].ljust(FAILURE_WIDTH)
        with self._writing("global attributes"):
            nc.setncatts(values)
            for name in delete:
                if name in RESERVED_ATTRS:  # back to its placeholder: the space stays reserved
                    nc.setncattr(name, RESERVED_ATTRS[name])
                elif name in nc.ncattrs():
                    nc.delncattr(name)
            nc.setncattr("end_digest", _digest(_run_end(nc)))

    def close(self, complete: bool = True):
        if self._nc.isopen():
            if complete:
                end = {"complete": 1}
                if self.rewritten:
                    with self._writing("the end of the run"):
                        self._nc.set_auto_mask(False)  # the values as stored
                        end["series_digest"] = _series_digest(self._nc, self.rewritten)
                self.set_run_attrs(end)
            with self._writing("the end of the run"):
                self._nc.close()

    def abort(self):
        """Close after an error, without raising: what the last successful flush wrote (every
        complete snapshot) stays readable, since the run never allocates after _reserve."""
        nc = getattr(self, "_nc", None)
        if nc is not None and nc.isopen():
            with contextlib.suppress(OSError, RuntimeError):
                nc.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close(complete=True)
        else:
            self.abort()


def _load(path):
    """The whole run file as an xarray.Dataset in memory, every read error as RunFileError."""
    import xarray as xr

    path = str(path)
    if not os.path.isfile(path):
        raise RunFileError(f"{path}: no such file")
    layout_ok, end_ok = _checked_in_child(path)
    if not layout_ok:
        raise RunFileError(f"{path}: damaged run file (its names, dimensions or attributes do not match "
                           "their checksum layout_digest)")
    try:
        with xr.open_dataset(path, engine="netcdf4") as ds:
            ds = ds.load()
    except Exception as exc:  # read by the child already: only a file changed meanwhile gets here
        raise RunFileError(f"{path}: unreadable NetCDF file ({type(exc).__name__}: {exc})") from exc
    for name in ("time", "snapshot_complete"):
        if name not in ds.variables:
            raise RunFileError(f"{path}: not a spherepde run file (no variable {name})")
    if "density" not in ds.variables and "positions" not in ds.variables:
        raise RunFileError(f"{path}: not a spherepde run file (no variable density or positions)")
    if not end_ok:
        ds.attrs.pop("series_digest", None)
        for name in RUN_END_ATTRS:
            ds.attrs.pop(name, None)
        ds.attrs.update(complete=0, warning="the attributes of the end of the run do not match their "
                        "checksum (damaged, or written when the run was killed): dropped, --resume recomputes them")
    _check_values(path, ds)
    _drop_placeholders(ds.attrs)
    return _current_layout(ds)


def _drop_placeholders(attrs):
    """The reserved attributes (RESERVED_ATTRS) as a reader expects them: the failure message
    without its padding, and no failure, failure_time or wall_seconds where none was written."""
    failure = attrs.get("failure")
    if isinstance(failure, str):
        if failure.strip():
            attrs["failure"] = failure.rstrip()
        else:
            del attrs["failure"]
    for name in ("failure_time", "wall_seconds"):
        value = attrs.get(name)
        if isinstance(value, (float, np.floating)) and math.isnan(value):
            del attrs[name]


def _current_layout(ds):
    """A file written before the cell dimension was renamed, as the current layout: dimension
    `cells` → `cell`, the index coordinate `cell` added, integer attributes as 32-bit ints, and
    the calendar-time axis = "T" of its dimensionless time dropped (so that to_netcdf writes a
    file in the current layout). Only the loaded dataset changes, never the file."""
    if OLD_CELL_DIM not in ds.dims:
        return ds
    ds = ds.rename_dims({OLD_CELL_DIM: CELL_DIM})
    ids = ds["cell_ids"].values if "cell_ids" in ds.variables else np.arange(ds.sizes[CELL_DIM])
    ds = ds.assign_coords({CELL_DIM: (CELL_DIM, ids.astype(np.int64), dict(CELL_INDEX_ATTRS))})
    for attrs in [ds.attrs] + [var.attrs for var in ds.variables.values()]:
        for key, value in attrs.items():
            if isinstance(value, np.integer) and value.dtype.itemsize > 4:
                attrs[key] = int_attr(value)
    if ds["time"].attrs.get("units") == "1":
        ds["time"].attrs.pop("axis", None)
    return ds


def _cpu_seconds(pid) -> float:
    """CPU time (user + system) a running child has used, from /proc; 0 where there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def _checked_in_child(path):
    """_verify(path), run in a forked child: HDF5 can loop forever or crash on a damaged file
    (measured: a flipped bit in its global heap), and a failed open leaves the file open in the
    library (a later read of the same file, rewritten, would see the old one). The child is
    killed once it has used a generous CPU time (PARSE_SECONDS); a read error comes back as its message. Raises RunFileError."""
    if not hasattr(os, "fork"):
        return _verify(path)
    timeout = PARSE_SECONDS + os.path.getsize(path) / 20e6  # CPU seconds: reading at 20 MB/s, plus a margin
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python ≥ 3.12 warns about fork with threads (numba's)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: nothing on stderr, no cleanup of the parent's state
        message = "crashed"
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            import faulthandler

            faulthandler.disable()
            message = json.dumps(_verify(path))
        except BaseException as exc:  # netCDF/HDF5 report damage as OSError, RuntimeError, ...
            message = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(write_end, message.encode()[:60000])
            os._exit(0)
    os.close(write_end)
    deadline = _time.monotonic() + PARSE_WALL_FACTOR * timeout
    try:
        while not (done := os.waitpid(pid, os.WNOHANG))[0]:
            if _cpu_seconds(pid) > timeout or _time.monotonic() > deadline:
                raise RunFileError(f"{path}: damaged NetCDF file (HDF5 did not finish reading it in {timeout:.0f} s)")
            _time.sleep(0.002)
        message = os.read(read_end, 65536).decode("utf-8", "replace")
    except BaseException:  # a hang, or Ctrl-C while waiting: no child left behind
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(read_end)
    if os.WIFSIGNALED(done[1]):
        raise RunFileError(f"{path}: damaged NetCDF file (HDF5 crashed reading it: signal {os.WTERMSIG(done[1])})")
    try:
        return tuple(json.loads(message))
    except ValueError:
        busy = f"; a run may be writing it ({path}.lock exists)" if os.path.exists(f"{path}.lock") else ""
        raise RunFileError(f"{path}: unreadable or damaged NetCDF file ({message}){busy}") from None


def _verify(path):
    """Read all of the file: (layout intact, run-end attributes intact) by its digests (True
    for files without them). Raises what netCDF4 raises on a damaged file."""
    import netCDF4

    with netCDF4.Dataset(path) as nc:
        for var in nc.variables.values():
            var[...]  # every chunk, so that its checksum is checked
        names = nc.ncattrs()
        layout_ok = "layout_digest" not in names or nc.getncattr("layout_digest") == _digest(_layout(nc))
        end_ok = "end_digest" not in names or nc.getncattr("end_digest") == _digest(_run_end(nc))
    return layout_ok, end_ok


def _check_values(path, ds):
    """The values as loaded (not as the checking child read them: a chunk the damaged index
    loses reads as whatever memory held) against snapshot_digest and series_digest. Raises
    RunFileError."""
    if SNAPSHOT_DIGEST not in ds:  # a file from before the digests
        return
    digest = ds[SNAPSHOT_DIGEST]
    covers = digest.attrs["covers"].split()
    if not all(name in ds for name in covers):  # a changed layout: refused by the layout digest, or
        return                                  # where the missing variable is needed
    complete = np.nonzero(ds["snapshot_complete"].values == 1)[0]
    bad = [int(k) for k in complete
           if _snapshot_digest(int(k), {name: ds[name].values[k] for name in covers}, covers) != digest.values[k]]
    if bad:
        raise RunFileError(f"{path}: damaged run file (snapshot {', '.join(map(str, bad))} does not "
                           f"match its checksum {SNAPSHOT_DIGEST})")
    finished = int(ds.attrs.get("complete", 0)) == 1
    if finished and complete.size != ds["snapshot_complete"].size:  # a finished run fills every slot
        lost = np.nonzero(ds["snapshot_complete"].values != 1)[0]
        raise RunFileError(f"{path}: damaged run file (the run finished, but snapshot "
                           f"{', '.join(map(str, lost))} is not marked written)")
    rewritten = digest.attrs["rewritten"].split()
    if finished and "series_digest" in ds.attrs and rewritten:
        if _hex_series_digest((name, ds[name].values) for name in rewritten) != ds.attrs["series_digest"]:
            raise RunFileError(f"{path}: damaged run file (the series rewritten at the end of the run do "
                               "not match their checksum series_digest)")


def _snapshot_flags(ds):
    """(complete, kind) per time index; files from before snapshot_kind are all regular."""
    complete = ds["snapshot_complete"].values == 1
    kind = ds["snapshot_kind"].values if "snapshot_kind" in ds else np.zeros(complete.size, dtype=np.int8)
    return complete, kind


def open_run(path):
    """Open a run file as an xarray.Dataset, loaded into memory (the file is not kept open).

    The file's checksums are verified, and a snapshot cut short by a kill (snapshot_complete
    not 1) is dropped, so every snapshot returned was completely written. Also `spherepde.open_run`.

    Args:
        path: a run file written by `spherepde run` or `spherepde.runner.run.execute`.

    Returns:
        The run as an xarray.Dataset: `density(time, cell)` (cell averages, sr⁻¹, NESTED
        order), the atoms' `atom_position(time, atom, xyz)` and `atom_mass(time, atom)`, one
        `(time,)` variable per diagnostic (`alignment_E`, `alignment_F`, `w2_to_projection`,
        `w2_bound_zero_temperature`, `lyapunov`, `min_density`, `lower_bound_paper`,
        `lower_bound_aposteriori`, …; `particle_…` for the particles), the particles'
        `positions(time, particle, xyz)`, and the attributes: `config` (the resolved config as
        JSON), `complete` (1 when the run finished, 0 when it was interrupted or failed; then
        `failure` says why and the last snapshot, snapshot_kind = 1, is the state at failure),
        β, the spectral data. docs/file_format.md lists every variable and attribute.

    Raises:
        RunFileError: a missing, unreadable, damaged or foreign file (the message names the path).
    """
    ds = _load(path)
    complete, kind = _snapshot_flags(ds)
    ds = ds.isel(time=np.nonzero(complete)[0])
    times = ds["time"].values[kind[complete] == SNAPSHOT_REGULAR]
    if not np.all(np.isfinite(times)) or np.any(np.diff(times) <= 0):
        raise RunFileError(f"{path}: damaged run file (snapshot times not increasing: {times})")
    return ds


class ResumePoint:
    """What a run file holds for --resume: index of the last snapshot of the complete regular
    prefix, the config, the per-time records up to it, and its density and arrays."""

    def __init__(self, path, ds, index):
        self.path, self.index = str(path), index
        self.config = json.loads(ds.attrs["config"])
        self.complete = int(ds.attrs.get("complete", 0)) == 1
        scalars = [n for n, v in ds.data_vars.items() if v.dims == ("time",)]
        self.records = [{n: float(ds[n].values[k]) for n in scalars} | {"time": float(ds["time"].values[k])}
                        for k in range(index + 1)]
        self.density = ds["density"].values[index] if "density" in ds else None  # None: particles alone
        self.arrays = {n: v.values[index] for n, v in ds.data_vars.items()
                       if v.dims[:1] == ("time",) and len(v.dims) > 1 and n != "density"}
        self.attrs = dict(ds.attrs)


def read_resume_point(path) -> ResumePoint:
    """The last snapshot a run can continue from: the end of the prefix of complete, regular
    snapshots (with tails from log f, the last of them at an anchor of g). Raises RunFileError
    if there is none or the file is not a readable run file."""
    ds = _load(path)
    if "config" not in ds.attrs:
        raise RunFileError(f"{path}: not a spherepde run file (no config attribute)")
    complete, kind = _snapshot_flags(ds)
    good = complete & (kind == SNAPSHOT_REGULAR)
    prefix = int(np.argmin(good)) if not good.all() else good.size
    if prefix == 0:
        raise RunFileError(f"{path}: cannot resume, no complete snapshot (start again without --resume)")
    index = prefix - 1
    if "log_density_time" in ds:  # tails: back to the last snapshot at an anchor (or the start)
        # (files before anchors: at a coupling time, where g was interpolated then)
        key = "log_density_anchor" if "log_density_anchor" in ds else "log_density_time"
        coupled = np.flatnonzero(ds[key].values[:prefix] == ds["time"].values[:prefix])
        index = int(coupled[-1]) if coupled.size else 0
    try:
        return ResumePoint(path, ds, index)
    except (ValueError, KeyError, TypeError) as exc:
        raise RunFileError(f"{path}: cannot resume, damaged run file ({type(exc).__name__}: {exc})") from exc
