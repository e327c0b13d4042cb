"""The project as a user gets it: a wheel installed (not editable) in a fresh virtual environment.

Tests that import from the source tree cannot notice a file that the wheel leaves out, such as the
HTML viewer's assets (package data). So this test builds a wheel from a copy of the sources,
installs it into a new venv, and runs ``attnlab viz --out`` there, from a directory away from the
sources. The new venv sees the running interpreter's site-packages through a ``.pth`` path line, so
that torch is not installed again; a path line does not run the ``.pth`` files it points at, so an
editable install of attnlab there stays invisible, and the test checks that ``attnlab`` is imported
from the new venv.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src" / "attnlab" / "interpret" / "assets"


def run(argv: list, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_installed_wheel_writes_the_viewer(tmp_path):
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources it builds.
    project = tmp_path / "project"
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, project / name)
    dist = tmp_path / "dist"
    # With setuptools at hand the build needs no network; without it (Python >= 3.12 venvs lack it)
    # pip fetches the build backend as it did for the editable install.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", dist, project], tmp_path)
    (wheel,) = dist.glob("attnlab-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for asset in sorted(ASSETS.iterdir()):
        assert f"attnlab/interpret/assets/{asset.name}" in names, f"the wheel lacks the viewer's {asset.name}"
    assert not any(n.endswith((".cpp", ".c", ".cu")) for n in names), "the wheel ships no hand-written kernels"

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no PYTHONPATH=src
    env["PYTHONNOUSERSITE"] = "1"
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    shared = {*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}  # torch
    (purelib / "shared-site-packages.pth").write_text("".join(p + "\n" for p in sorted(shared)))
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([python, "-c", "import attnlab.tools.viz.page as p; print(p.__file__)"], elsewhere, env).strip()
    assert Path(where).resolve().is_relative_to(venv.resolve()), f"attnlab was imported from {where}"
    out = run([bindir / "attnlab", "viz", "--out", "x.html"], elsewhere, env)
    assert out.startswith("wrote x.html: 7 attention maps")
    page = (elsewhere / "x.html").read_text(encoding="utf-8")
    assert (ASSETS / "viewer.js").read_text(encoding="utf-8") in page
    assert (ASSETS / "viewer.css").read_text(encoding="utf-8") in page
    assert "Your journey starts with one step" in page
