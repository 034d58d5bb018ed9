"""kernels.settings: every MIXSCOPE_* variable declared there and read only there, the docs table generated from the
declarations, and the one parser per type with its one message for a bad value."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kernels import settings

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("models", "kernels", "analysis", "app", "bench")
NAME = re.compile(r"MIXSCOPE_[A-Z_]+")
TABLE = re.compile(r"<!-- settings table: python -m kernels\.settings --markdown -->\n(.*?)<!-- end -->", re.S)


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


# ---- the declarations, the code and the docs agree ---------------------------------------------------------------
def test_the_docs_table_is_the_generated_one():
    found = TABLE.search((ROOT / "docs" / "settings.md").read_text(encoding="utf-8"))
    assert found, "docs/settings.md has lost its table markers"
    assert found[1].strip() == settings.markdown().strip(), \
        "docs/settings.md's table is stale: paste `python -m kernels.settings --markdown` between its markers"


def test_the_command_prints_the_table():
    done = subprocess.run([sys.executable, "-m", "kernels.settings", "--markdown"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout == settings.markdown(), done.stderr
    assert "Warning" not in done.stderr   # (runpy's about the module imported twice included)


def test_every_name_the_code_mentions_is_declared():
    unknown = sorted({f"{path.relative_to(ROOT)}: {name}" for path in _python_files(*FLOORS)
                      for name in NAME.findall(path.read_text(encoding="utf-8")) if name not in settings.SETTINGS})
    assert not unknown, "not declared in kernels/settings.py:\n" + "\n".join(unknown)


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name)
                                                                            and node.id == "environ")


def _mixscope(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(NAME.fullmatch(node.value))


def env_reads(tree: ast.AST) -> list[int]:
    """Lines that read a MIXSCOPE_ variable from the environment: os.environ.get / os.getenv / os.environ[...] /
    `in os.environ` with the name spelled out. Writes (a subprocess's env=os.environ | {...}, os.environ[...] = ...,
    pop) are not reads."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _mixscope(node.args[0]):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)) or \
                    (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name)
                                                                               and f.id == "getenv"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value) \
                and _mixscope(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and _mixscope(node.left) and any(isinstance(op, (ast.In, ast.NotIn))
                                                                             for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_finder_sees_each_way_of_reading_and_no_write():
    reads = ('os.environ.get("MIXSCOPE_A")\nos.getenv("MIXSCOPE_B", "1")\nos.environ["MIXSCOPE_C"]\n'
             '"MIXSCOPE_D" in os.environ\nenviron.get("MIXSCOPE_E")\n')
    writes = ('os.environ["MIXSCOPE_A"] = "1"\nenv = os.environ | {"MIXSCOPE_B": "1"}\nos.environ.pop("MIXSCOPE_C")\n'
              'os.environ.get("PYTHONPATH")\nsettings.get("MIXSCOPE_D")\n')
    assert env_reads(ast.parse(reads)) == [1, 2, 3, 4, 5] and env_reads(ast.parse(writes)) == []


def test_only_the_settings_module_reads_mixscope_variables():
    """Anywhere in the project's code (tests/ aside: they set the environment up and check what a benchmark left
    in it), kernels/settings.py alone reads a MIXSCOPE_ variable."""
    tops = [d.name for d in ROOT.iterdir() if d.is_dir() and d.name not in ("tests", "node_modules")
            and not d.name.startswith(".")]
    files = [*ROOT.glob("*.py"), *(p for p in _python_files(*tops)
                                   if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))]
    assert ROOT / "kernels" / "settings.py" in files
    found = [f"{p.relative_to(ROOT)}:{line}" for p in files if p != ROOT / "kernels" / "settings.py"
             for line in env_reads(ast.parse(p.read_text(encoding="utf-8"), filename=str(p)))]
    assert not found, "read MIXSCOPE_ variables through kernels.settings.get:\n" + "\n".join(found)


def test_each_declaration_is_complete():
    for s in settings.DECLARED:
        assert s.meaning and "\n" not in s.meaning and s.who in settings.WHO and s.kind in settings.KINDS, s.name
        if s.default_value() is None:
            assert s.shown, f"{s.name}: a default the reading code computes says what it is (shown)"


# ---- the parsers -------------------------------------------------------------------------------------------------
def test_unset_empty_and_blank_are_the_default(monkeypatch):
    for name in ("MIXSCOPE_HEAVY_QUEUE", "MIXSCOPE_MEMORY_MB", "MIXSCOPE_KERNELS", "MIXSCOPE_SERVE",
                 "MIXSCOPE_USER_HEADER", "MIXSCOPE_POLICIES", "MIXSCOPE_CAUSAL_BIAS"):
        monkeypatch.delenv(name, raising=False)
        unset = settings.get(name)
        assert unset == settings.default(name) and not settings.is_set(name)
        for raw in ("", "   "):
            monkeypatch.setenv(name, raw)
            assert settings.get(name) == unset and not settings.is_set(name)
    assert settings.get("MIXSCOPE_HEAVY_QUEUE") == 16 and settings.get("MIXSCOPE_CAUSAL_BIAS") == "1"
    monkeypatch.setenv("MIXSCOPE_CACHE", "")
    assert settings.get("MIXSCOPE_CACHE") == Path.home() / ".cache" / "mixscope"


def test_typed_values(monkeypatch):
    monkeypatch.setenv("MIXSCOPE_HEAVY_QUEUE", " 0 ")
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", "1.5e3")
    monkeypatch.setenv("MIXSCOPE_KERNELS", " Triton ")
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.setenv("MIXSCOPE_POLICIES", os.pathsep.join(["a.py", "", "  ", "dir/b.py"]))
    monkeypatch.setenv("MIXSCOPE_CACHE", "/tmp/c")
    assert settings.get("MIXSCOPE_HEAVY_QUEUE") == 0 and settings.get("MIXSCOPE_MEMORY_MB") == 1500.0
    assert settings.get("MIXSCOPE_KERNELS") == "triton" and settings.get("MIXSCOPE_SERVE") is True
    assert settings.get("MIXSCOPE_POLICIES") == (Path("a.py"), Path("dir/b.py"))
    assert settings.get("MIXSCOPE_CACHE") == Path("/tmp/c") and settings.is_set("MIXSCOPE_CACHE")


@pytest.mark.parametrize("name, raw, message", [
    ("MIXSCOPE_HEAVY_QUEUE", "many", "MIXSCOPE_HEAVY_QUEUE must be a whole number, got 'many'"),
    ("MIXSCOPE_SERVE_MAX_CHARS", "2.5", "MIXSCOPE_SERVE_MAX_CHARS must be a whole number of characters, got '2.5'"),
    ("MIXSCOPE_MEMORY_MB", " lots", "MIXSCOPE_MEMORY_MB must be a number of megabytes, got 'lots'"),
    ("MIXSCOPE_KERNELS", "Cuda-Please", "MIXSCOPE_KERNELS must be reference or triton, got 'cuda-please'"),
    ("MIXSCOPE_CAUSAL_BIAS", "yes", "MIXSCOPE_CAUSAL_BIAS must be 0, 1 or triton, got 'yes'"),
    ("MIXSCOPE_SERVE", "true", "MIXSCOPE_SERVE must be 0 or 1, got 'true'"),
])
def test_a_bad_value_names_the_variable_and_what_it_takes(monkeypatch, name, raw, message):
    monkeypatch.setenv(name, raw)
    for _ in range(2):   # (a bad value is not cached as a good one)
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            settings.get(name)


def test_a_changed_environment_is_read_at_once(monkeypatch):
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    assert settings.get("MIXSCOPE_KERNELS") == "reference"
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    assert settings.get("MIXSCOPE_KERNELS") == "triton"
    monkeypatch.delenv("MIXSCOPE_KERNELS")
    assert settings.get("MIXSCOPE_KERNELS") is None


def test_an_undeclared_name_is_refused():
    with pytest.raises(KeyError, match="MIXSCOPE_NOPE is not declared"):
        settings.get("MIXSCOPE_NOPE")
    with pytest.raises(KeyError, match="MIXSCOPE_NOPE is not declared"), settings.override(MIXSCOPE_NOPE="1"):
        pass


# ---- override ----------------------------------------------------------------------------------------------------
def test_override_holds_for_the_block_and_restores_what_was_there(monkeypatch):
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    with settings.override(MIXSCOPE_KERNELS="reference", MIXSCOPE_KEEP_PASS="1"):
        assert settings.get("MIXSCOPE_KERNELS") == "reference" and settings.get("MIXSCOPE_KEEP_PASS") is True
        with settings.override(MIXSCOPE_KERNELS=None):   # None: as if unset, whatever the environment says
            assert settings.get("MIXSCOPE_KERNELS") is None and not settings.is_set("MIXSCOPE_KERNELS")
            assert settings.get("MIXSCOPE_KEEP_PASS") is True   # (the outer block's others still hold)
        assert settings.get("MIXSCOPE_KERNELS") == "reference"
    assert settings.get("MIXSCOPE_KERNELS") == "triton" and settings.get("MIXSCOPE_KEEP_PASS") is False
    with pytest.raises(RuntimeError), settings.override(MIXSCOPE_KERNELS="reference"):
        raise RuntimeError   # restored on the way out of an error too
    assert settings.get("MIXSCOPE_KERNELS") == "triton" and settings.overrides() == {}


def test_override_refuses_a_bad_value_before_the_block_runs():
    ran = []
    with pytest.raises(ValueError, match="MIXSCOPE_KERNELS must be reference or triton, got 'cuda'"):
        with settings.override(MIXSCOPE_KERNELS="cuda"):
            ran.append(1)
    with pytest.raises(TypeError, match="takes the string"), settings.override(MIXSCOPE_KEEP_PASS=True):
        ran.append(1)
    assert not ran and settings.overrides() == {}


def test_override_is_this_threads_alone(monkeypatch):
    """Another thread reads the environment, not this block's override, unless it is handed overrides()."""
    monkeypatch.delenv("MIXSCOPE_KERNELS", raising=False)
    seen = {}

    def read(key, carried=None):
        with settings.override(**(carried or {})):
            seen[key] = settings.get("MIXSCOPE_KERNELS")

    with settings.override(MIXSCOPE_KERNELS="reference"):
        threads = [threading.Thread(target=read, args=("plain",)),
                   threading.Thread(target=read, args=("carried", settings.overrides()))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert settings.get("MIXSCOPE_KERNELS") == "reference"
    assert seen == {"plain": None, "carried": "reference"}


def test_the_kernel_switches_follow_the_override(monkeypatch):
    import torch

    import kernels
    from kernels import efficient
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    monkeypatch.setenv("MIXSCOPE_KEEP_PASS", "1")
    q = torch.zeros(1, 1, 2, 4)
    with settings.override(MIXSCOPE_KERNELS="reference", MIXSCOPE_KEEP_PASS="0", MIXSCOPE_CAUSAL_BIAS="triton"):
        assert kernels.backend_for("attention", q) == "reference" and kernels.keep_pass() is False
        assert efficient.choice() == "triton"
    assert kernels.keep_pass() is True and efficient.choice() == "1"


def test_a_backward_on_another_thread_reads_the_overrides_its_forward_saw(monkeypatch):
    """On CUDA autograd runs the keep structure's backward on a thread of its own, which does not inherit context
    variables: the forward hands its overrides on (models.pruning.interaction). Here the backward runs on a thread
    of this test's, outside the block, with the environment asking for the other path."""
    import torch

    import kernels
    from models.pruning.interaction import ContextPruning
    if "log_keep" not in kernels.TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under TRITON_INTERPRET=1 (the tests' setting)")
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    torch.manual_seed(0)
    rule = ContextPruning(12, 6, 0.5).train()
    rule.alpha = 1.7
    x = torch.randn(1, 9, 12).requires_grad_(True)
    with kernels.record_paths() as paths:
        with settings.override(MIXSCOPE_KERNELS="reference"):
            _, keep = rule.log_keep(x, None)
        worker = threading.Thread(target=keep.sum().backward)
        worker.start()
        worker.join()
    assert x.grad is not None and paths == {"log_keep": "reference", "log_keep_grad": "reference"}
