"""One writer per output file: a lock file PATH.lock next to it, held while a run writes PATH.

The lock is an advisory `flock` on PATH.lock, which holds the owner's pid and host. The kernel
drops a flock when its process dies, however it dies (SIGKILL included), so a lock file left
behind by a dead run is recognised as stale and taken over, with a note saying so; a pid alone
could not tell (pids are reused). The file is removed when the run ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket

__all__ = ["LockError", "output_lock"]


class LockError(Exception):
    """Another live process holds the lock of the output file, or the lock cannot be made."""


def _owner(fd) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 200).decode("utf-8", "replace").strip()
    return text or "unknown"


def _acquire(lock, path):
    """An fd of the lock file, flock-ed by us; None where the file system has no locks."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise LockError(f"{path}: cannot create the lock file {lock} ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _owner(fd)
            os.close(fd)
            raise LockError(f"{path}: another run is writing it (lock {lock} held by {owner})") from None
        except OSError:  # no locks on this file system (some network file systems)
            os.close(fd)
            return None
        # a previous holder may have removed the file between our open and our flock: the lock
        # counts only on the file that is at that path now
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextlib.contextmanager
def output_lock(path, note=None):
    """Hold PATH.lock while the block runs. Raises LockError if another process holds it;
    note(text) is told when a stale lock of a dead run is taken over, or when the file system
    cannot lock (the run goes on unprotected)."""
    note = note or (lambda text: None)
    lock = f"{path}.lock"
    fd = _acquire(lock, path)
    if fd is None:
        note(f"{lock}: this file system cannot lock files; nothing stops a second run on {path}")
        yield
        return
    try:
        previous = _owner(fd)
        if previous != "unknown":
            note(f"taking over the stale lock {lock} of {previous}, which is no longer running")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)
