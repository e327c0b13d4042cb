"""The example notebook runs from top to bottom in a real Jupyter kernel (nbclient), offline, and a
trace displays there as the inspector page, inline."""

from __future__ import annotations

import html
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install 'attnlab[dev]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install 'attnlab[dev]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install 'attnlab[dev]')")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "inspect_attention.ipynb"


@pytest.mark.slow
def test_the_example_notebook_runs_and_shows_the_inspector(tmp_path, monkeypatch):
    # The kernel is a child process: it inherits this environment. No network, an empty model
    # cache (so the notebook takes its offline path at once), attnlab from this checkout.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "commit it without outputs"
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    pages = [out["data"]["text/html"] for out in outputs if "text/html" in out.get("data", {})]
    assert len(pages) == 1 and pages[0].startswith('<iframe class="attnlab-inspector"')
    page = html.unescape(pages[0].split('srcdoc="', 1)[1])
    assert page.startswith("<!DOCTYPE html>") and "default-src 'none'" in page and 'id="attn-data"' in page
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "softmax(masked) == the model's weights: True" in text
    assert "strongest induction head:" in text and "removing it: loss" in text
