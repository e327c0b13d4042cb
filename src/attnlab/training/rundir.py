"""The training directory (``--out DIR``) as one run's property: whose it is, and who is using it.

Two rules keep a run from destroying data:

* **attnlab only writes into a directory it can prove is its own**: one that does not exist yet, an
  empty one, or one holding an attnlab run (``latest.json``, or the lock file below, which every run
  leaves behind). Anything else is refused with one line: a training run prunes old checkpoints and
  rewrites ``metrics.jsonl``, which must never happen to files someone else put there. Step
  directories without a ``latest.json`` (lost or deleted) are refused too: a new run would take
  them for debris.
* **one run at a time**: the run holds an exclusive lock on ``DIR/.attnlab-train.lock`` (``fcntl.flock``,
  released by the kernel when the process ends, however it ends) for as long as it may write, and
  writes its process id, host and start time into it, so a second ``attnlab train --out DIR`` is
  refused with a line naming the process that holds it.

Without ``fcntl`` (Windows) there is no lock; the ownership rule still holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import IO, Any

from attnlab.files import current_umask, read_json, remove_temp_files

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunLock", "check_run_directory"]

LOCK_NAME = ".attnlab-train.lock"
LATEST_NAME = "latest.json"  # as attnlab.training.checkpoint (which this module sits below)


def check_run_directory(out: Path, *, resume: bool = False) -> None:
    """ValueError unless ``out`` is a directory attnlab may write a run into: absent, empty, or
    holding an attnlab run (its ``latest.json`` or its lock file). With ``resume``, a run's one step
    directory without ``latest.json`` (a first save stopped before its pointer's write) is left for the trainer
    to take up (:func:`attnlab.training.checkpoint.recover_latest`)."""
    if os.path.lexists(out) and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if not out.exists() or os.path.lexists(out / LATEST_NAME):
        return
    steps = sorted(p.name for p in (out / "checkpoints").glob("step-*")) if (out / "checkpoints").is_dir() else []
    if steps and not (resume and len(steps) == 1 and os.path.lexists(out / LOCK_NAME)):
        # A new run would prune them as debris: never without the pointer that says which is the run's.
        ours = len(steps) == 1 and os.path.lexists(out / LOCK_NAME)
        again = " (or pass --resume, which takes it up when it is whole)" if ours else ""
        raise ValueError(
            f"--out {out} holds checkpoints ({', '.join(steps[:3])}) but no {LATEST_NAME}; restore it to resume"
            f"{again} (generate and viz also take a step directory), or remove {out / 'checkpoints'} to start over"
        )
    if os.path.lexists(out / LOCK_NAME):
        return
    try:
        entries = sorted(p.name for p in out.iterdir())
    except OSError as exc:
        raise OSError(f"cannot read the --out directory {out}: {exc.strerror}") from None
    if entries:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise ValueError(
            f"--out {out} is not empty ({shown}) and holds no attnlab run; attnlab never overwrites files it "
            "did not write: choose a new or empty --out"
        )


class RunLock:
    """An exclusive lock on a training directory, held from :meth:`acquire` to :meth:`release` (or
    the end of the process). Acquiring creates the directory and the lock file."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self._file: IO[bytes] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock (a no-op when already held); ValueError naming the holder when another
        run has it. Then clears what a killed run of this directory left half-written."""
        if self._file is not None:
            return
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"cannot create the --out directory {self.out}: {exc.strerror}") from None
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        flags |= getattr(os, "O_NONBLOCK", 0)  # a FIFO planted under the name must not block us
        try:
            fd = os.open(self.path, flags, 0o666 & ~current_umask())
        except OSError as exc:
            raise OSError(f"cannot open the lock file {self.path}: {exc.strerror}") from None
        f = os.fdopen(fd, "r+b")
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{self.path} is not a regular file; attnlab keeps its run lock there")
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ValueError(
                        f"--out {self.out} is in use by another attnlab train ({self._holder()}); "
                        "wait for it to finish or stop it, or choose another --out"
                    ) from None
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            f.seek(0)
            f.truncate()
            f.write((json.dumps(info) + "\n").encode())
            f.flush()
        except BaseException:
            f.close()
            raise
        self._file = f
        # Nobody else writes here now: temporary files are what a killed run left behind.
        for name in (LATEST_NAME, "metrics.jsonl"):
            remove_temp_files(self.out / name)

    def _holder(self) -> str:
        """Who holds the lock, as its lock file says."""
        with contextlib.suppress(OSError, ValueError):
            info: Any = read_json(self.path, "lock file", max_bytes=4096)
            if isinstance(info, dict) and "pid" in info:
                return f"process {info['pid']} on {info.get('host', '?')}, since {info.get('started', '?')}"
        return f"its lock file is {self.path}"

    def release(self) -> None:
        """Give the lock up (the lock file stays: it marks the directory as an attnlab run's)."""
        if self._file is not None:
            if fcntl is not None:
                with contextlib.suppress(OSError):
                    fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
