"""The README and docs/: every relative link resolves (file and #anchor), the README stays short, the index lists
every page; docs/methods.md names only symbols its linked files define; the repository cites no file outside it."""
import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # no headings inside code
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue   # http(s), mailto: not checked offline
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short_and_the_index_lists_every_page():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    linked = {t.partition("#")[0] for t in LINK.findall(index)}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md" and p.name not in linked]
    assert not missing, f"docs/index.md does not list: {', '.join(missing)}"


# ---- docs/methods.md: every code link names symbols the linked file defines ---------------------------------------

METHODS = ROOT / "docs" / "methods.md"
# a link to a Python file, then one or more backticked symbols separated by commas (the convention methods.md states)
CODE_LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+\.py)\)((?:\s*,?\s*`[^`]+`)*)")
SYMBOL = re.compile(r"`([^`]+)`")


def defined(path: Path) -> set[str]:
    """Names a module defines: module-level functions, classes and assignments, and Class.member for what a class
    body defines (methods, properties, class attributes)."""
    def own(body) -> dict[str, ast.AST]:
        names = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            names[name.id] = node
        return names
    top = own(ast.parse(path.read_text(encoding="utf-8")).body)
    out = set(top)
    for name, node in top.items():
        if isinstance(node, ast.ClassDef):
            out |= {f"{name}.{member}" for member in own(node.body)}
    return out


def test_every_code_link_in_methods_names_symbols_the_file_defines():
    text = re.sub(r"```.*?```", "", METHODS.read_text(encoding="utf-8"), flags=re.S)
    problems, checked = [], 0
    for target, tail in CODE_LINK.findall(text):
        path = (METHODS.parent / target).resolve()
        symbols = SYMBOL.findall(tail)
        if not path.is_file():
            problems.append(f"{target}: no such file")
            continue
        if not symbols:
            problems.append(f"{target}: the link names no symbol (write `name` right after it)")
        have = defined(path)
        problems += [f"{target}: no `{sym}` in it" for sym in symbols if sym not in have]
        checked += len(symbols)
    assert checked >= 50, f"only {checked} symbols found: has the link convention in methods.md changed?"
    assert not problems, "\n".join(problems)


def test_methods_covers_every_method_section():
    want = {"attention-variants", "head-embeddings", "extractors", "adaptively-sparse-attention",
            "the-alpha-sigmoid-and-its-schedule", "interaction-scores", "the-keep-structure-i", "the-survival-rule",
            "sparsity-loss-and-sparsity", "our-two-deviations-distance-and-sinks", "the-compacted-cache",
            "adapters-and-compacter", "kv-cache-eviction-policies", "the-imitation-target", "sources"}
    assert want <= anchors(METHODS), f"docs/methods.md lacks: {sorted(want - anchors(METHODS))}"


# ---- the repository stands alone: no file cites the notes it was built from ---------------------------------------

# (spelled in pieces so this file does not match itself)
OUTSIDE = ("papers" + ".md", ".." + "/shared")


def repository_files() -> list[Path]:
    """Tracked files and new files git does not ignore."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode("utf-8", "replace")
    return [ROOT / name for name in dict.fromkeys(out.split("\0")) if name]


def test_every_methods_anchor_cited_in_the_repository_exists():
    """Code and docs cite a section as the page's name, '#' and the heading's anchor: each must be a heading there."""
    have, missing = anchors(METHODS), []
    for path in repository_files():
        if path.suffix not in (".py", ".md", ".txt", ".toml", ".cfg", ".ini", ".sh") and path.name != "Makefile":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, IsADirectoryError, PermissionError, UnicodeDecodeError):
            continue
        cited = re.findall(r"methods\.md#([\w-]+)", text)
        missing += [f"{path.relative_to(ROOT)}: #{a}" for a in cited if a not in have]
    assert not missing, "no such heading in docs/methods.md:\n" + "\n".join(missing)


def without_sources_section(text: str) -> str:
    """methods.md's own "## Sources" section may say what the page replaces; the rest of the page may not."""
    return re.sub(r"^## Sources\b.*?(?=^## |\Z)", "", text, flags=re.S | re.M)


def test_no_file_refers_to_notes_outside_the_repository():
    found = []
    for path in repository_files():
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            continue  # (a temporary file gone since git listed it, a submodule)
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", "replace")
        if path == METHODS:
            text = without_sources_section(text)
        for number, line in enumerate(text.splitlines(), 1):
            if any(s in line for s in OUTSIDE):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, (f"{len(found)} lines cite files outside the repository (cite docs/methods.md instead):\n"
                       + "\n".join(found))
