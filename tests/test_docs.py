"""The documentation keeps up with what it documents (issue 27): the performance page shows
every figure of ``bench/results/*.json`` and nothing copied by hand, every preset key has
its row in the configuration reference, and README stays a five-minute read whose links
lead somewhere. ``make docs`` (before pytest in ``make test``) builds the site strictly:
broken links, anchors and pages left out of the nav fail there."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

from bench import report
from shared.config import ModelSpec, SamplingDefaults, ServerConfig
from tests.conftest import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


def hooks() -> ModuleType:
    """docs/hooks.py as MkDocs loads it (a file, not a package module)."""
    spec = importlib.util.spec_from_file_location("modelyard_docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def figures(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every leaf of a results file as the page must write it: numbers as the JSON has them."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from figures(inner, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from figures(inner, f"{path}[{i}]")
    elif isinstance(value, bool):
        yield path, "yes" if value else "no"
    elif isinstance(value, (int, float)):
        yield path, json.dumps(value)
    else:
        yield path, str(value)


def blocks(page: str) -> dict[str, str]:
    return {m["name"]: m.group(0) for m in report.MARKER.finditer(page)}


def test_results_exist() -> None:
    assert len(RESULTS) >= 7, RESULTS  # a glob that matched nothing would pass the rest


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_the_built_performance_page_shows_every_figure_of_the_results_file(path: Path) -> None:
    """What the site shows (the hook's output), block by block: each figure of
    ``NAME.json`` inside NAME's block, with the run and machine it came from."""
    page = (DOCS / "performance.md").read_text()
    shown = blocks(hooks().on_page_markdown(page, None, None, None))
    assert path.stem in shown, f"docs/performance.md: no <!-- bench:{path.stem}:start --> block"
    block = shown[path.stem]
    missing = [(where, text) for where, text in figures(json.loads(path.read_text()))
               if text not in block]
    assert not missing, f"{path.name}: figures not on the page: {missing}"
    assert "run of " in block and "machine: " in block


def test_the_committed_performance_page_is_what_the_results_make() -> None:
    """GitHub shows the committed file, so it is kept equal too."""
    page = (DOCS / "performance.md").read_text()
    assert page == report.fill(page), (
        "docs/performance.md and bench/results/*.json disagree: "
        "run `python -m bench.report --write`")


def test_a_block_is_made_again_whatever_it_held(tmp_path: Path) -> None:
    (tmp_path / "scaling.json").write_text((ROOT / "bench/results/scaling.json").read_text())
    stale = "a\n<!-- bench:scaling:start -->\n| 1 | 99999.9 |\n<!-- bench:scaling:end -->\nb\n"
    made = report.fill(stale, tmp_path)
    assert "99999.9" not in made and made.startswith("a\n") and made.endswith("\nb\n")
    assert "| 16 | 103.5 | 7.66 |" in made


def test_a_results_file_without_a_table_of_its_own_is_listed_whole(tmp_path: Path) -> None:
    """A new benchmark's file (say ``newbench.json``) is on the page before anyone writes
    its table, and a block whose file is missing says how to make it."""
    result = {"benchmark": "newbench", "machine": {"cpus": 2, "cpu": "AMD EPYC"},
              "when": "2026-11-27 10:00", "commit": "abc1234",
              "modelyard": {"valid_calls": 17, "broken": 0, "share": 0.85}, "ok": True}
    (tmp_path / "newbench.json").write_text(json.dumps(result))
    page = "<!-- bench:newbench:start -->\n<!-- bench:newbench:end -->\n" \
           "<!-- bench:absent:start -->\n<!-- bench:absent:end -->\n"
    shown = blocks(report.fill(page, tmp_path))
    for where, text in figures(result):
        assert text in shown["newbench"], where
    assert "`modelyard.valid_calls` | 17" in shown["newbench"]
    assert "make bench BENCH=absent" in shown["absent"]


def preset_keys() -> Iterator[str]:
    for struct in (ServerConfig, ModelSpec, SamplingDefaults):
        for field in msgspec.structs.fields(struct):
            if field.name != "id":  # the section's name, not a key one writes
                yield field.name


@pytest.mark.parametrize("key", sorted(set(preset_keys())))
def test_every_preset_key_is_in_the_configuration_reference(key: str) -> None:
    page = (DOCS / "presets.md").read_text()
    tables = page[page.index("## Model keys"):page.index("## Environment variables")]
    named = [line.split("|")[1] for line in tables.splitlines()
             if line.startswith("| ")]  # a key table's first column: the keys a row is about
    assert any(f"`{key}`" in cell for cell in named), (
        f"docs/presets.md: the preset key `{key}` has no row in the key tables")


def test_readme_is_a_five_minute_read_whose_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 150, "README grew back: move the reference into docs/"
    assert "make serve" in text and "make test" in text
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_site_home_page_is_readme_with_its_docs_links_made_relative() -> None:
    home = hooks().home_page(README.read_text())
    assert "](docs/" not in home and "](presets.md)" in home


def test_readmes_tool_call_figures_are_the_results_files() -> None:
    """README's sentence on ``auto`` tool calls quotes ``bench/results/toolcalls.json``."""
    r = json.loads((ROOT / "bench/results/toolcalls.json").read_text())
    runs = r["runs"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    ours = runs["modelyard, default preset (tool_strict_level parameter)"]
    hot = runs["modelyard, default preset (tool_strict_level parameter), temperature 1.0"]
    before = runs["modelyard, tool_strict_level auto (no tag, as before), temperature 1.0"]
    peer = runs["vllm serve, defaults"]
    strict = runs["vllm serve --tool-strict-level parameter"]
    n = r["requests_each"]
    for said in [f"{ours['broken']} of {n} broken on `configs/default.yaml`",
                 f"({hot['broken']} of {n} at temperature 1.0, against {before['broken']} of {n}",
                 (f"{peer['broken']} of {n} broken from `vllm serve` with its defaults, "
                 f"{strict['broken']} with `--tool-strict-level parameter`"),
                 f"run of {r['when']}"]:
        assert said in readme, said
