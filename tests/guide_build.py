"""Building the learners' guide (mkdocs.yml, docs/) with ``mkdocs build --strict``, as CI does.

A strict build takes minutes (the tour of SmolLM2 is computed from the model, every lesson runs),
so the real guide is built once per test session: the ``guide_site`` fixture of ``conftest.py``,
which tests/test_docs.py and tests/test_docs_examples.py read. A test that needs a different guide
(a planted broken link) builds its own copy with :func:`mkdocs_build`.

The session's build starts in the background as soon as the tests are collected (when a collected
test reads it: :func:`start_build`), at low priority and on one torch thread, so it runs on the
time the other tests leave idle; the fixture waits for it (:meth:`Build.wait`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from shared_data import GPT2_BPE_DIR

ROOT = Path(__file__).resolve().parents[1]


class Built(NamedTuple):
    """One strict build: the site folder and the finished ``mkdocs build`` process (its exit status
    and output)."""

    site: Path
    result: subprocess.CompletedProcess


def _command(config: Path, site: Path) -> list[str]:
    return [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]


def _env(**extra: str) -> dict[str, str]:
    """The build's environment: GPT-2's BPE files from the shared data, this checkout's src/ first."""
    env = dict(os.environ)
    env.update(
        ATTNLAB_GPT2_BPE_DIR=str(GPT2_BPE_DIR),
        NO_MKDOCS_2_WARNING="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
        **extra,
    )
    return env


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict -f config -d site`` in a child process, waited for."""
    return subprocess.run(
        _command(config, site),
        cwd=config.parent,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


class Build:
    """The guide's strict build (``mkdocs build --strict``) running in a child process: started by
    :func:`start_build`, its outcome read with :meth:`wait`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.site = folder / "site"
        self._out, self._err = folder / "stdout.txt", folder / "stderr.txt"
        with open(self._out, "wb") as out, open(self._err, "wb") as err:
            self.process = subprocess.Popen(
                _command(ROOT / "mkdocs.yml", self.site),
                cwd=ROOT,
                # one torch thread (the tour's passes) and a low priority: it must not slow the tests
                # running meanwhile, only use the time they leave idle
                env=_env(OMP_NUM_THREADS="1"),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        if hasattr(os, "setpriority"):  # (before the child starts its threads, which inherit it)
            os.setpriority(os.PRIO_PROCESS, self.process.pid, 10)
        self._built: Built | None = None

    def wait(self, timeout: float = 900) -> Built:
        """The finished build (waiting for it, at most ``timeout`` seconds more)."""
        if self._built is None:
            try:
                code = self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
            result = subprocess.CompletedProcess(
                self.process.args,
                code,
                self._out.read_text(encoding="utf-8", errors="replace"),
                self._err.read_text(encoding="utf-8", errors="replace"),
            )
            self._built = Built(self.site, result)
        return self._built

    def stop(self) -> None:
        """Kill the build if it still runs (the session ended without reading it)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_build(folder: Path) -> Build:
    """Start the strict build of this checkout's guide into ``folder / "site"``, in the background."""
    return Build(folder)


def built_once(folder: Path) -> Built:
    """The strict build in ``folder`` made by the first process that asks (a lock beside the folder)
    and read back by the others: pytest-xdist's workers share one build of the guide."""
    from filelock import FileLock

    code = folder / "returncode.txt"  # (written last: the build is whole once it is there)
    with FileLock(f"{folder}.lock"):
        if not code.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            built = start_build(folder).wait()
            code.write_text(str(built.result.returncode))
            return built
    out, err = ((folder / name).read_text(encoding="utf-8", errors="replace") for name in ("stdout.txt", "stderr.txt"))
    return Built(
        folder / "site",
        subprocess.CompletedProcess(_command(ROOT / "mkdocs.yml", folder / "site"), int(code.read_text()), out, err),
    )
