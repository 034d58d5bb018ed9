"""The README and docs/: every relative link resolves (file and #anchor), the README stays short, the index lists
every page."""
import re
from pathlib import Path

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
