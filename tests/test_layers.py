"""router/'s layers, read from the source with ``ast`` (issue 27): no module starts.

Every ``import`` and ``from ... import`` counts, wherever it is written: at the top, under
``if TYPE_CHECKING:`` or inside a function. An import moved into a function still makes
the module depend on the other one; it only hides the circle from Python's loader (which
is how ``admission``/``key_store``/``limits`` held one). ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module, else to ``pkg``. A package's ``__init__`` is
the module named after the package; importing a submodule is not counted as importing
its parents (an ``__init__`` that imports its own submodules would otherwise be a
circle with each of them).

The rules:

- no import circle among router's modules;
- router and worker are separate processes: neither imports the other, and ``shared``
  imports neither;
- only the HTTP layer (``router.api`` and the entry points ``router.app``,
  ``router.cli``, ``router.__main__``) imports ``router.api``;
- each package of router says in its ``__init__`` docstring, in a paragraph that begins
  ``Must not import:``, the modules or packages (in double backquotes) none of its
  modules may import; every package directly under ``router/`` has one.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TOPS = ("router", "worker", "shared")
ENTRY_POINTS = {"router.app", "router.cli", "router.__main__"}
RULE = re.compile(r"^\s*Must not import:(.*?)(?:\n\s*\n|\Z)", re.MULTILINE | re.DOTALL)

Graph = Mapping[str, set[str]]


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name → file, for every module of router/, worker/ and shared/."""
    found: dict[str, Path] = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _target(name: str, known: Iterable[str]) -> str | None:
    """The longest known module that ``name`` is or lies in (a name may end in an
    attribute: ``router.errors.APIError`` is ``router.errors``)."""
    known = set(known)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def import_graph(files: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module → the modules of router/, worker/ and shared/ it imports, anywhere."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package up
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                names += [f"{base}.{alias.name}" for alias in node.names]
        targets = {_target(name, files) for name in names}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The import circles: each strongly connected component of more than one module,
    sorted (Tarjan's algorithm, iterative); ``circle`` draws one circle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop(0)
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def circle(graph: Graph, component: list[str]) -> list[str]:
    """One circle through ``component``, from its first module back to it (BFS)."""
    first = component[0]
    paths = {first: [first]}
    queue = [first]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & set(component)):
            if nxt == first:
                return [*paths[node], first]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"no circle through {sorted(component)}")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden_by_docstrings(files: Mapping[str, Path]) -> dict[str, list[str]]:
    """Package → what its ``__init__`` docstring says it must not import."""
    rules: dict[str, list[str]] = {}
    for module, path in files.items():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        match = RULE.search(doc)
        if match:
            rules[module] = re.findall(r"``([\w.]+)``", match.group(1))
    return rules


def violations(graph: Graph, rules: Mapping[str, list[str]]) -> list[str]:
    """Every import that breaks a rule of this module's doc, as ``a -> b (why)``."""
    found: list[str] = []
    router = sorted(m for m in graph if _within(m, "router"))
    for module in router:
        for target in sorted(graph[module]):
            if _within(target, "worker"):
                found.append(f"{module} -> {target} (router and worker share only shared/)")
            if (_within(target, "router.api") and not _within(module, "router.api")
                    and module not in ENTRY_POINTS):
                found.append(f"{module} -> {target} (only the HTTP layer imports router.api)")
            for package, banned in rules.items():
                if _within(module, package):
                    found += [f"{module} -> {target} ({package} must not import {name})"
                              for name in banned if _within(target, name)]
    for module in sorted(m for m in graph if _within(m, "worker")):
        found += [f"{module} -> {t} (worker never imports router)"
                  for t in sorted(graph[module]) if _within(t, "router")]
    for module in sorted(m for m in graph if _within(m, "shared")):
        found += [f"{module} -> {t} (shared imports neither process's code)"
                  for t in sorted(graph[module]) if not _within(t, "shared")]
    return found


def test_no_import_circle_in_router() -> None:
    graph = import_graph(source_files())
    router = {m: {t for t in ts if _within(t, "router")}
              for m, ts in graph.items() if _within(m, "router")}
    found = cycles(router)
    assert found == [], "import circles in router/:\n" + "\n".join(
        f"{', '.join(c)}: {' -> '.join(circle(router, c))}" for c in found)


def test_every_package_of_router_says_what_it_must_not_import() -> None:
    files = source_files()
    rules = forbidden_by_docstrings(files)
    packages = sorted(m for m, p in files.items()
                      if p.name == "__init__.py" and m.count(".") == 1 and _within(m, "router"))
    assert packages, "router/ has no packages"
    missing = [p for p in packages if not rules.get(p)]
    assert missing == [], f"no 'Must not import:' paragraph in the docstring of {missing}"
    unknown = sorted({name for banned in rules.values() for name in banned
                      if _target(name, files) != name})
    assert unknown == [], f"rules name modules that do not exist: {unknown}"


def test_no_import_crosses_a_layer() -> None:
    files = source_files()
    found = violations(import_graph(files), forbidden_by_docstrings(files))
    assert found == [], "imports across the layers:\n" + "\n".join(found)


def test_architecture_md_has_a_row_for_every_module() -> None:
    """docs/architecture.md is redrawn with every move: each module of router/, worker/
    and shared/ (but ``__init__.py``, whose docstring speaks for its package) has a row
    of its own or lies in a folder that has one (``router/api/openai/``), and every path a
    row names exists."""
    named: set[str] = set()
    for line in ARCHITECTURE.read_text().splitlines():
        first = re.match(r"^\| (`[^|]*`) \|", line)
        if first:
            named.update(re.findall(r"`([^`]+)`", first.group(1)))
    missing = [str(path.relative_to(ROOT)) for top in TOPS
               for path in sorted((ROOT / top).rglob("*.py"))
               if path.name != "__init__.py" and str(path.relative_to(ROOT)) not in named
               and not any(f"{folder}/" in named for folder in path.relative_to(ROOT).parents)]
    assert missing == [], f"no row in docs/architecture.md for {missing}"
    gone = sorted(name for name in named if not (ROOT / name.rstrip("/")).exists())
    assert gone == [], f"docs/architecture.md has rows for paths that do not exist: {gone}"


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """The walker and the rules on a made-up tree that breaks each of them."""
    tree = {
        "router/__init__.py": "",
        "router/app.py": "from router.api import relay\n",
        "router/errors.py": "",
        "router/low/__init__.py": '"""Low.\n\nMust not import: ``router.high``.\n"""\n',
        "router/low/a.py": "from router.low import b\nfrom router.api.sse import x\n",
        "router/low/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    from router.low.a import A\n"
                            "def f():\n    from router.high.c import C\n"),
        "router/high/__init__.py": "",
        "router/high/c.py": "from . import d\nimport worker.engine\n",
        "router/high/d.py": "from ..errors import APIError\n",
        "router/api/__init__.py": "",
        "router/api/relay.py": "from router.low.a import A\n",
        "router/api/sse.py": "",
        "worker/__init__.py": "",
        "worker/engine.py": "from router.errors import APIError\n",
        "shared/__init__.py": "",
        "shared/config.py": "import worker\n",
    }
    for name, text in tree.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    files = source_files(tmp_path)
    graph = import_graph(files)
    assert graph["router.high.c"] == {"router.high.d", "worker.engine"}  # relative import
    assert graph["router.high.d"] == {"router.errors"}
    assert cycles(graph) == [["router.low.a", "router.low.b"]]
    assert circle(graph, ["router.low.a", "router.low.b"]) == [
        "router.low.a", "router.low.b", "router.low.a"]
    assert forbidden_by_docstrings(files) == {"router.low": ["router.high"]}
    assert violations(graph, forbidden_by_docstrings(files)) == [
        "router.high.c -> worker.engine (router and worker share only shared/)",
        "router.low.a -> router.api.sse (only the HTTP layer imports router.api)",
        "router.low.b -> router.high.c (router.low must not import router.high)",
        "worker.engine -> router.errors (worker never imports router)",
        "shared.config -> worker (shared imports neither process's code)",
    ]
