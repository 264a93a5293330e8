"""The run file (NetCDF4, CF-1.13 with the HEALPix grid mapping, xdggs cell ids): its layout,
writing one snapshot at a time, reading and resuming, and one writer per file (locking).
The user's page is docs/file_format.md."""

from .runfile import RunFileError, RunWriter, WriteError, open_run, read_resume_point

__all__ = ["RunWriter", "open_run", "read_resume_point", "RunFileError", "WriteError"]
