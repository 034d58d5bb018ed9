"""The python_docs reader on a tiny .deb laid out like python3.11-doc: prose paragraphs only, code-heavy and
near-empty pages dropped (no network)."""
import shutil
import subprocess

import pytest

from models.data import normalize
from models.data.sources import SOURCES, read_python_docs

pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")

PROSE = ("Python is an easy to learn, powerful programming language. It has efficient high-level data structures "
         "and a simple but effective approach to object-oriented programming. ") * 4


def page(body: str) -> str:
    """A page shaped like Sphinx's: navigation and footer around div.body."""
    return f"""<html><body><div class="related" role="navigation"><p>Navigation bar</p></div>
<div class="document"><div class="documentwrapper"><div class="bodywrapper">
<div class="body" role="main"><section id="s">
<h1>A Heading<a class="headerlink" href="#s">&#182;</a></h1>
{body}
</section></div></div></div>
<div class="sphinxsidebar"><p class="topless">Previous topic</p><p>Sidebar text</p></div></div>
<div class="footer"><p>&copy; Copyright 2001-2023, Python Software Foundation.</p></div></body></html>"""


INTRO = page(f"""<dl class="field-list simple"><dt>Author<dd><p>Guido van Rossum</p></dd></dl>
<p>{PROSE}</p>
<p>The <a class="reference internal" href="#print"><code class="xref py py-func docutils literal notranslate">
<span class="pre">print()</span></code></a> function writes &quot;text&quot; to <em>standard
output</em>, and it&#8217;s simple.</p>
<div class="highlight-python3 notranslate"><div class="highlight">\
<pre><span class="gp">&gt;&gt;&gt; </span>print("hello")
hello</pre></div></div>
<div class="admonition note"><p class="admonition-title">Note</p><p>Notes are prose too.</p></div>
<p class="availability">Availability: Unix, Windows.</p>
<table class="docutils"><tr><td><p>cell text</p></td></tr></table>
<dl class="py function"><dt class="sig sig-object py" id="print">print(*objects)</dt>
<dd><p>Print <em>objects</em> to the stream.</p><ul><li><p>A list item.</p></li></ul></dd></dl>""")

COOKBOOK = page(f"<p>{PROSE}</p><pre>" + "x = compute(1, 2, 3)\n" * 60 + "</pre>")  # about 40 % prose
INDEX = page('<p>Contents of the library.</p><div class="toctree-wrapper"><ul><li>os</li></ul></div>')


@pytest.fixture
def fake_deb(tmp_path):
    root = tmp_path / "pkg"
    html = root / "usr/share/doc/python3.11/html"
    pages = {"tutorial/intro.html": INTRO, "howto/cookbook.html": COOKBOOK, "library/index.html": INDEX,
             "_sources/tutorial/intro.rst.txt": "Python is :func:`print`\n", "whatsnew/changelog.html.gz": "x"}
    for rel, text in pages.items():
        (html / rel).parent.mkdir(parents=True, exist_ok=True)
        (html / rel).write_text(text, encoding="utf-8")
    outside = tmp_path / "host_file.html"  # prose outside the package: a link to it must not be read
    outside.write_text(page(f"<p>{PROSE}</p>"), encoding="utf-8")
    (html / "library/leak.html").symlink_to(outside)
    (html / "library/latin1.html").write_bytes(page(f"<p>{PROSE} caf\xe9</p>").encode("latin-1"))  # not UTF-8
    (root / "usr/share/doc/python3.11-doc").mkdir(parents=True)
    (root / "usr/share/doc/python3.11-doc/html").symlink_to("../python3.11/html")  # as Debian ships it
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text("Package: python3.11-doc\nVersion: 3.11.2-6+deb12u9\nArchitecture: all\n"
                                         "Maintainer: Test <t@example.org>\nDescription: fake\n")
    deb = tmp_path / "python3.11-doc_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)], check=True,
                   capture_output=True)
    return deb


def test_python_docs_reader_keeps_prose_and_drops_markup_and_code_pages(fake_deb):
    docs = list(read_python_docs(fake_deb))
    # cookbook (mostly code), index (too short) and the link out of the package dropped; no doubles; a page that is
    # not UTF-8 is read with replacement characters, not lost with the whole source
    assert [d for d, _ in docs] == ["library/latin1", "tutorial/intro"]
    assert docs[0][1].endswith("caf\ufffd")
    assert normalize(docs[1][1]).split("\n") == [
        " ".join(PROSE.split()),
        "The print() function writes \"text\" to standard output, and it\u2019s simple.",
        "Notes are prose too.",
        "Print objects to the stream.",
        "A list item.",
    ]


def test_python_docs_reader_refuses_a_package_without_the_pages(tmp_path):
    from models.data.corpus import DataError
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "usr/share/doc").mkdir(parents=True)
    (root / "DEBIAN/control").write_text("Package: x\nVersion: 1\nArchitecture: all\nMaintainer: T <t@e.org>\n"
                                         "Description: fake\n")
    deb = tmp_path / "x.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True)
    with pytest.raises(DataError, match="no usr/share/doc/python3.11/html"):
        list(read_python_docs(deb))


def test_python_docs_source_is_pinned_and_held_out():
    src = SOURCES["python_docs"]
    assert (src.registry, src.package, src.version) == ("debian", "python3.11-doc", "3.11.2-6+deb12u9")
    from models.data.sources import DEFAULT_SOURCES
    assert "python_docs" not in DEFAULT_SOURCES
