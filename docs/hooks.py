"""MkDocs hooks (``hooks:`` in mkdocs.yml): what the site takes from the rest of the repo.

- The home page is README.md itself (its ``docs/`` links made relative to the site), so
  the two never differ.
- Every ``<!-- bench:NAME:start -->`` block, on any page, is made again from
  ``bench/results/NAME.json`` by ``bench/report.py``: the site never shows a figure that
  the results files do not hold.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
if str(ROOT) not in sys.path:  # `mkdocs` run as a script: bench/ is not an installed package
    sys.path.insert(0, str(ROOT))

from bench import report


def home_page(readme: str) -> str:
    """README as the site's index.md: a link to ``docs/X`` is a link to ``X`` there."""
    return readme.replace("](docs/", "](")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, "index.md", content=home_page(README.read_text())))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    return report.fill(markdown)


def on_serve(server: Any, config: MkDocsConfig, builder: Any) -> Any:
    server.watch(str(README))
    server.watch(str(report.RESULTS))
    return server
