"""The house's floors, read from the code's own imports (function-level ones included: an import inside a function
that only dodges a circle is still a dependency).

kernels/ imports nothing of ours; models/ imports kernels/ only; analysis/ imports models/ and kernels/; app/ and
bench/ sit on top. Inside kernels/, models/ and analysis/ no module reaches itself through its imports."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "models", "analysis", "app", "bench")
# what each floor may import of ours, besides itself
ALLOWED = {"kernels": set(), "models": {"kernels"}, "analysis": {"models", "kernels"}}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            found[_module_name(path)] = path
    return found


def _targets(node: ast.AST, here: str, known: dict[str, Path]) -> list[str]:
    """The modules of ours one import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            base = here.split(".")
            package = base if known[here].name == "__init__.py" else base[:-1]
            parent = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            parent = node.module or ""
        # `from a import b` names the module a.b when there is one, else a (b is a name inside it)
        names = [f"{parent}.{alias.name}" if f"{parent}.{alias.name}" in known else parent for alias in node.names]
    else:
        return []
    out = []
    for name in names:
        while name and name not in known:  # `import a.b.c` of a name inside a module: its module
            name = name.rpartition(".")[0]
        if name and name.split(".")[0] in PACKAGES and name not in out:
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = {t for node in ast.walk(tree) for t in _targets(node, name, known) if t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph()


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_no_floor_imports_one_above_it(graph, floor):
    wrong = sorted(f"{src} -> {dst}" for src, dsts in graph.items() if src.split(".")[0] == floor
                   for dst in dsts if dst.split(".")[0] not in ALLOWED[floor] | {floor})
    assert not wrong, f"{floor}/ may import only {sorted(ALLOWED[floor]) or 'nothing of ours'}: " + "; ".join(wrong)


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_no_import_circle_inside_a_floor(graph, floor):
    inside = {src: {d for d in dsts if d.split(".")[0] == floor} for src, dsts in graph.items()
              if src.split(".")[0] == floor}
    assert _circles(inside) == []


def test_the_graph_is_the_code_s(graph):
    """The checks above read the real tree: every package's modules are there, with a top-level and a function-level
    import of each kind."""
    assert {name.split(".")[0] for name in graph} == set(PACKAGES) and len(graph) > 100
    assert "models.backends" in graph["models.transformer"]           # top level
    assert "models.params" in graph["models.evaluate"]                # inside a function
    assert any(dst.startswith("models.") for dst in graph["analysis.export"])


def test_the_circle_finder_finds_a_circle_and_the_floor_check_reads_function_level_imports(tmp_path):
    """The checks above cannot pass vacuously: a three-module loop is found, and an import inside a function counts."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("def f():\n    from models.transformer import DecoderLM\n")
    known = {"kernels.x": tmp_path / "x.py", "models.transformer": tmp_path / "transformer.py"}
    assert [t for node in ast.walk(tree) for t in _targets(node, "kernels.x", known)] == ["models.transformer"]
