"""The shape the core keeps: no long functions outside kernels/ and tests/, a short model forward that does not
branch on the kind of attention state (each state runs its own attention: models.backends)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LONGEST = 80   # lines of one function, docstring included
CODE = ("app", "models", "analysis", "bench")


def functions(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            owner = parents.get(node)
            name = f"{owner.name}.{node.name}" if isinstance(owner, ast.ClassDef) else node.name
            yield name, node


def method(path: Path, name: str) -> ast.FunctionDef:
    return next(node for n, node in functions(REPO / path) if n == name)


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_function_outside_kernels_and_tests_is_longer_than_80_lines():
    long = [f"{path.relative_to(REPO)}: {name} ({lines(node)} lines)"
            for top in CODE for path in sorted((REPO / top).rglob("*.py"))
            for name, node in functions(path) if lines(node) > LONGEST]
    assert not long, long


def test_the_model_forward_is_short_and_never_asks_what_kind_of_state_it_holds():
    forward = method(Path("models/transformer.py"), "DecoderLM.forward")
    assert lines(forward) <= 40
    calls = [n.func.id for n in ast.walk(forward) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "isinstance" not in calls and "type" not in calls
    assert lines(method(Path("models/mixers/attention.py"), "Attention.forward")) <= 30


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST))
    (tmp_path / "m.py").write_text(f"class C:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n")
    assert [(n, lines(node)) for n, node in functions(tmp_path / "m.py")] == [("C.f", LONGEST + 1)]
