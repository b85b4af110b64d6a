"""The code's shape: no import circle (lazy imports included), the core never imports goose.tools, and no
function longer than 100 lines (the benchmarks' scripts included). Read from the source files, so a change that breaks one fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package folders: goose/ itself, and the top-level folders installed as goose.<name> (pyproject.toml)
PACKAGES = {"goose": ROOT / "goose", "goose.plugins": ROOT / "plugins", "goose.policies": ROOT / "policies",
            "goose.verifiers": ROOT / "verifiers", "goose.theory": ROOT / "theory"}
MAX_LINES = 100


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every goose module ``name`` imports, at the top or inside a function."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    # a package's __init__ is imported with any of its modules; importing "goose" alone is not an edge
    return {m: {t for t in _imports(m, p, known) if t != "goose"} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_sees_a_lazy_circle(tmp_path):
    """The check above can fail: a circle of lazy imports, as compose -> decoding -> generation -> hf -> compose was."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    lazy = tmp_path / "generation.py"
    lazy.write_text((ROOT / "goose" / "generation.py").read_text() + "\n\ndef _lazy():\n    from goose.hf import hf_generate\n")
    graph = _graph()
    graph["goose.generation"] = _imports("goose.generation", lazy, set(graph))
    assert ["goose.compose", "goose.decoding", "goose.generation", "goose.hf"] in _cycles(graph)


def test_the_core_never_imports_the_tools():
    graph = _graph()
    # the core: goose/ outside goose/tools and __main__, the sources, policies and verifiers (goose.theory's
    # collect runs real models over the benchmark prompts: tooling, like goose.tools)
    core = [m for m in graph if not (m.startswith(("goose.tools", "goose.theory")) or m == "goose.__main__")]
    bad = {m: sorted(t for t in graph[m] if t == "goose.tools" or t.startswith("goose.tools.")) for m in core}
    assert {m: t for m, t in bad.items() if t} == {}


def _long_functions() -> list[str]:
    out = []
    scripts = {f"benchmarks.{p.stem}": p for p in (ROOT / "benchmarks").glob("*.py")}
    for name, path in {**_modules(), **scripts}.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    out.append(f"{name}.{node.name}: {n} lines")
    return out


def test_no_function_over_100_lines():
    assert _long_functions() == []


@pytest.mark.parametrize("lines", [MAX_LINES + 1])
def test_the_length_check_sees_a_long_function(lines, tmp_path, monkeypatch):
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    (tmp_path / "long.py").write_text(f"def long():\n{body}")
    monkeypatch.setitem(PACKAGES, "goose.fake", tmp_path)
    assert _long_functions()[-1:] == [f"goose.fake.long.long: {lines} lines"]


OUTSIDE_CORE = ("goose.plugins", "goose.policies", "goose.verifiers", "goose.tools", "goose.theory", "goose.testing",
                "goose.vllm", "goose.__main__")


def test_the_core_reaches_components_only_through_the_registry():
    """goose/'s core (the loop, the interfaces, the tree, the registry, errors, specs, the transformers bridge; not
    the integrations, tools and test kits) imports no module of the built-in sources, policies or verifiers, at
    the top or lazily: it builds them by name through the registry (goose.manager) and calls them through the
    interfaces."""
    graph = _graph()
    parts = ("goose.plugins", "goose.policies", "goose.verifiers")
    core = [m for m in graph if m.startswith("goose") and not m.startswith(OUTSIDE_CORE)]
    reach = {m: sorted(t for t in graph[m] if t.startswith(parts)) for m in core}
    assert {m: t for m, t in reach.items() if t} == {}


def _private_imports() -> list[str]:
    """``module: name`` for every underscore name an integration or tool (goose.vllm, goose.tools) or a built-in
    component imports from another goose module (private to that module)."""
    mods = _modules()
    out = []
    for name, path in mods.items():
        if not name.startswith(("goose.vllm", "goose.tools", "goose.plugins", "goose.policies", "goose.verifiers")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("goose") and node.level == 0:
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and node.module != name:
                        out.append(f"{name}: {node.module}.{a.name}")
    return out


def test_integrations_tools_and_components_import_only_public_names():
    assert _private_imports() == []


def test_the_core_holds_no_algorithm_module():
    """goose/ itself holds what a plugin author reads (module list below); algorithms live with the components
    that own them (policies/, verifiers/, plugins/), integrations and tools in their own subpackages."""
    core = sorted(p.stem for p in (ROOT / "goose").glob("*.py"))
    assert core == ["__init__", "__main__", "branches", "compose", "decoding", "errors", "generation", "hf",
                    "hookspecs", "interfaces", "manager", "sampling", "specs", "tree"]
