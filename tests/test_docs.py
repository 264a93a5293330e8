"""The docs site (mkdocs.yml, docs/) builds without a single warning: `mkdocs build --strict`,
which fails on a broken link between pages, a missing anchor, a page left out of the nav, and
on any warning of mkdocstrings (an API object that does not exist, a docstring it cannot parse).
mkdocs and mkdocstrings come with the [test] extra (and the [docs] extra)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "tutorial.ipynb"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built into a temporary folder: (folder, the build's log)."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    return out, done


def test_site_builds_strict_without_warnings(site):
    out, done = site
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    assert (out / "index.html").is_file()


def test_every_docs_page_is_in_the_site(site):
    out, _ = site
    for page in sorted((ROOT / "docs").glob("*.md")):
        built = out / "index.html" if page.stem == "index" else out / page.stem / "index.html"
        assert built.is_file(), f"{page.name} was not built"


def test_tutorial_notebook_is_a_page_of_the_site(site):
    """mkdocs_hooks.py turns docs/tutorial.ipynb into the page tutorial/ (code cells as Python
    blocks) and the notebook itself is in the site for download."""
    out, _ = site
    page = (out / "tutorial" / "index.html").read_text()
    assert "execute(config" in page and "expand(work" in page
    assert (out / "tutorial.ipynb").read_bytes() == NOTEBOOK.read_bytes()


@pytest.mark.parametrize("name", ["spherepde.runner.config.resolve", "spherepde.runner.run.execute",
                                  "spherepde.storage.runfile.open_run", "spherepde.runner.sweep.run_sweep",
                                  "spherepde.analysis.diagnostics.MeasureDiagnostics",
                                  "spherepde.analysis.metrics.f_phase_onset",
                                  "spherepde.solvers.eulerian.EulerianSolver",
                                  "spherepde.solvers.particles.ParticleSolver"])
def test_api_page_documents_the_public_api(site, name):
    """mkdocstrings rendered the object (its heading's anchor is on the page)."""
    out, _ = site
    html = (out / "api" / "index.html").read_text()
    assert f'id="{name}"' in html, f"{name} is missing from the API page"



def python_blocks(path):
    """The ```python blocks of a Markdown page."""
    return re.findall(r"^```python\n(.*?)^```", Path(path).read_text(), flags=re.DOTALL | re.MULTILINE)


@pytest.mark.parametrize("index", range(len(python_blocks(ROOT / "docs" / "api.md"))))
def test_api_page_examples_run(index, tmp_path):
    """Each Python example of docs/api.md runs as written, from a folder holding the repository's
    solvers/ (the examples read solvers/quickstart.toml and solvers/sweeps/tiny.toml), with this
    checkout's spherepde first on the path."""
    shutil.copytree(ROOT / "solvers", tmp_path / "solvers")
    code = python_blocks(ROOT / "docs" / "api.md")[index]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def notebook_code_cells(path):
    """The source of the notebook's code cells, in order (nbformat 4 JSON, read with the standard
    library)."""
    notebook = json.loads(Path(path).read_text())
    assert notebook["nbformat"] == 4
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_tutorial_is_committed_without_outputs():
    notebook = json.loads(NOTEBOOK.read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, "clear the notebook's outputs"


def test_tutorial_notebook_runs(tmp_path, monkeypatch):
    """Runs docs/tutorial.ipynb as Jupyter would, without Jupyter: its code cells are executed in
    order in one namespace with exec, matplotlib on the Agg backend, in an empty temporary
    working directory (the notebook writes everything it needs there). The notebook's own
    asserts (mass conservation, the density above its lower bounds, the F-onset later at larger
    β) are part of this test; afterwards the run file must be complete and the sweep combined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for k, source in enumerate(notebook_code_cells(NOTEBOOK)):
        try:
            exec(compile(source, f"tutorial.ipynb, code cell {k + 1}", "exec"), namespace)  # noqa: S102 (the notebook)
        finally:
            plt.close("all")
    assert int(namespace["ds"].attrs["complete"]) == 1
    assert namespace["sweep"].sizes["run"] == 3
    assert (tmp_path / "tutorial_output" / "beta" / "beta.nc").is_file()
