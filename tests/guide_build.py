"""Building the learners' guide (mkdocs.yml, docs/) with ``mkdocs build --strict``, as CI does.

A strict build takes minutes (the tour of SmolLM2 is computed from the model, every lesson runs),
so the real guide is built once per test session: the ``guide_site`` fixture of ``conftest.py``,
which tests/test_docs.py and tests/test_docs_examples.py read. A test that needs a different guide
(a planted broken link) builds its own copy with :func:`mkdocs_build`.
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


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict -f config -d site`` in a child process, with GPT-2's BPE files from
    the shared data and this checkout's src/ on the path."""
    env = dict(os.environ)
    env.update(
        ATTNLAB_GPT2_BPE_DIR=str(GPT2_BPE_DIR),
        NO_MKDOCS_2_WARNING="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
