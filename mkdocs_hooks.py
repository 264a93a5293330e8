"""MkDocs hook (mkdocs.yml, hooks:): the tutorial notebook docs/tutorial.ipynb as a page of the
site, tutorial.md, generated at build time with the standard library only (mkdocs-jupyter would
pull Jupyter's nbconvert stack). Markdown cells are copied, code cells become ```python blocks;
the notebook is committed without outputs, so the page shows none. The .ipynb itself is copied
to the site as it is, for download."""

import json
from pathlib import Path

from mkdocs.structure.files import File

NOTEBOOK = "tutorial.ipynb"
PAGE = "tutorial.md"


def notebook_markdown(path) -> str:
    """The notebook's cells as one Markdown text, with a note on how to run it."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    parts = []
    for cell in cells:
        source = "".join(cell["source"]).rstrip("\n")
        if cell["cell_type"] == "markdown":
            parts.append(source)
        elif cell["cell_type"] == "code":
            parts.append(f"```python\n{source}\n```")
        if len(parts) == 1:  # after the notebook's title
            parts.append(f"!!! note\n    This page shows the cells of [{NOTEBOOK}]({NOTEBOOK}) without their "
                         "outputs: download it and run it with Jupyter to see the figures (about a minute "
                         "on 2 cores).")
    return "\n\n".join(parts) + "\n"


def on_files(files, config):
    notebook = Path(config["docs_dir"]) / NOTEBOOK
    files.append(File.generated(config, PAGE, content=notebook_markdown(notebook)))
    return files
