"""Strings the app did not write show as text: a model directory's name, a card's fields, pasted text and its
tokens, on every page, in Streamlit's Markdown (app/plain.py md), in the HTML of coloured and struck tokens
(analysis.tokens.html_text) and in plotly figures (analysis.plain.plotly_text); and serve mode shows no server path.

Three tiers: md() against a CommonMark parser and the patterns Streamlit's Markdown rewrites after parsing (ported
from its frontend bundle), here; every page under AppTest fed such names and text (full tier); and a real headless
chromium on the app, where a local listener counts the requests a page would make for an image, a CSS url() or a
link (browser tier)."""
from __future__ import annotations

import html
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from streamlit.testing.v1 import AppTest

from analysis.plain import spec_refusal, without_inert_template_parts
from app.plain import JOINER, md, plain

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "app"
PAGES = ["Models.py"] + sorted(p.name for p in (APP / "views").glob("*.py"))
CHROMIUM = "/usr/bin/chromium"


# ---- md(): random strings of Markdown, HTML, image, link, LaTeX, colour and emoji syntax ---------------------------

PIECES = ["![", "](", ")", "(", "[", "]", "<", ">", "<b>", "</b>", "<img src=x>", '<span style="color:red">',
          "</span>", "<!-- c -->", "&amp;", "&#60;", "&", "*", "**", "_", "__", "~", "~~", "`", "```", "$", "$$",
          "\\", ":", ":red[", ":color[x]{foreground=red}", ":material/home:", ":material_home:", ":smile:", ":+1:",
          ":-1:", ":streamlit:", "::: note", "http://", "https://", "HTTP://", "www.", "WWW.", "@", "a@b.co",
          "mailto:", "example.com", "127.0.0.1:9", "#", "# ", "> ", "- ", "+ ", "* ", "1. ", "2) ", "|", "| a |",
          "---", "===", "{", "}", "^", "[^1]", "->", "<-", "<->", "--", ">=", "<=", "~=", " ", "  ", "    ", "\t",
          "\n", "\r\n", "\r", "\n\n", "x", "word", "W_Q", "_x_", "é", "日本", "😀", "\u00a0", "!", "'", '"', "%",
          "%{x}", "=", ".", "/", "?", ";", ",", JOINER]
FIXED = ["![n](http://127.0.0.1:9/x.png)", "<img src=http://127.0.0.1:9/y.png>", "[a](http://example.com)",
         "http://127.0.0.1:9/z", "see www.example.com now", "me@example.com", ":red[alert]", ":material/home: icon",
         ":smile: and :+1:", ":streamlit:", "$x^2$ and $$y$$", "**bold** _it_ ~~s~~ `code`", "# head", "- item",
         "1. one", "2) two", "a -> b <- c <-> d -- e >= f <= g ~= h", "  lead and trail  ", "two\n\nparas\n    code",
         "tab\there", "&amp; &lt;b&gt; &#60;", "| a | b |\n|---|---|\n| 1 | 2 |", "a\\*b\\",
         '<span style="background:url(http://127.0.0.1:9/s)">x</span>', ":color[x]{foreground=red}",
         "[^1]\n\n[^1]: note", "\\$x$", "a\r\nb", "<!-- c -->", ">quote", "***", "x\n===", "café 日本 😀",
         ":material_home:", "HTTPS://EXAMPLE.COM", "<https://example.com>", "x:y:z", "::: note\nhi\n:::",
         "[x]: http://a.b", "<javascript:alert(1)>", "<a@b.co>", "blocks.0.mixer.W_Q", "__init__", "mha (shipped)",
         "<root 1>/m", "![i](http:127.0.0.1:9)", "", " ", "\n", "x\n  \ny", " \t lead", "trail \t "]


def random_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))) for _ in range(n)]


CASES = FIXED + random_strings(600)
COMMONMARK = MarkdownIt("commonmark").enable(["table", "strikethrough"])

# what Streamlit's Markdown (1.x frontend, StreamlitMarkdown) rewrites in a text node after parsing, where escapes are
# already gone: GFM's autolink literals (mdast-util-gfm-autolink-literal), remark-emoji, its own icons, logo and
# arrows; and, on the source before parsing, ':material/' and the test that loads KaTeX
JS_WS = "\t\n\x0b\x0c\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
TEXT_REWRITES = [
    ("autolink", re.compile(r"(https?://|www(?=\.))([-.\w]+)", re.I | re.A)),
    ("e-mail autolink", re.compile(r"[-.\w+]@[-\w]", re.A)),
    ("emoji", re.compile(r":\+1:|:-1:|:[\w-]+:", re.A)),
    ("icon", re.compile(r":material_\w+:", re.A)),
    ("logo", re.compile(r":streamlit:")),
    ("arrow", re.compile(rf"(?:(?<=[{JS_WS}])|^)(?:<->|->|<-|--|>=|<=|~=)(?=[{JS_WS}]|$)")),
]
_CODE = re.compile(r"(?:(?<=\n)|^) {0,3}(`{3,}|~{3,})[\s\S]*?(?:\n[ \t]*\1|$)|(?<!`)(`+)[^`\n]+\2(?!`)|\\[\\$`]")
_DISPLAY_MATH = re.compile(r"(?<!\$)\$\$+(?!\$)[\s\S]*?\$\$")
_INLINE_MATH = re.compile(r"(?<!\$)\$(?![\s$])[^$\n]*?[^\s$]\$(?!\d)")


def streamlit_math(source: str) -> bool:
    """StreamlitMarkdown's test for math (which loads remark-math and KaTeX), ported."""
    if "$" not in source:
        return False
    rest = _CODE.sub("_", source)
    return bool(_DISPLAY_MATH.search(rest) or _INLINE_MATH.search(rest))


def shown_text(source: str) -> str:
    """The text CommonMark makes of `source`, which must be one paragraph of text (no other element)."""
    out = COMMONMARK.render(source)
    if not out:
        return ""
    assert out.startswith("<p>") and out.endswith("</p>\n"), out
    inner = out[3:-5]
    assert "<" not in inner, f"markup from {source!r}: {inner!r}"
    return html.unescape(inner)


@pytest.mark.parametrize("chunk", range(0, len(CASES), 100))
def test_md_is_one_paragraph_of_exactly_the_text(chunk):
    """CommonMark (with GFM tables and strikethrough) reads md(s) as one paragraph whose text is s (joiners aside):
    no link, image, emphasis, code, heading, list, table, HTML or entity made from it."""
    for s in CASES[chunk:chunk + 100]:
        text = shown_text(md(s))
        assert plain(text) == s.replace(JOINER, ""), (s, md(s), text)


@pytest.mark.parametrize("chunk", range(0, len(CASES), 100))
def test_md_leaves_nothing_streamlit_rewrites_after_parsing(chunk):
    """The patterns Streamlit's Markdown turns into links, emoji, icons and arrows in a text node (escapes already
    read), and math and ':material/' in the source, are broken in md(s)."""
    for s in CASES[chunk:chunk + 100]:
        source = md(s)
        text = shown_text(source)
        for what, pattern in TEXT_REWRITES:
            assert not pattern.search(text), (what, s, text)
        assert ":material/" not in source and not streamlit_math(source), s
        # (every ':' escaped: a bare one before any character ends the text node, as a directive's attempt, and
        # the arrows' and autolinks' patterns then match at the node's edge: 'a <=:b' was drawn 'a ≤:b')
        assert not re.search(r"(?<!\\):", source), ("a bare ':'", s, source)


def test_the_checks_see_markup_in_the_raw_strings():
    """(The checks above are not blind: the same strings unescaped are caught.)"""
    caught = 0
    for s in FIXED:
        out = COMMONMARK.render(s)
        text = html.unescape(re.sub(r"<[^>]*>", "", out))
        caught += bool(re.search(r"<(?!p>|/p>)", out) or any(p.search(text) for _, p in TEXT_REWRITES)
                       or streamlit_math(s))
    assert caught >= 30


def test_streamlit_keeps_md_as_it_is_written():
    """st.markdown(md(s)) reaches the browser as md(s) (nothing in Streamlit's Python side rewrites it)."""
    cases = [s for s in CASES[:120] if s.strip()]
    script = ("import streamlit as st\nfrom app.plain import md\n"
              f"for s in {cases!r}:\n    st.markdown(md(s))\n")
    at = AppTest.from_string(script, default_timeout=60).run()
    assert not at.exception
    assert [m.value for m in at.markdown] == [md(s) for s in cases]


def test_html_text_keeps_tokens_out_of_markdown():
    """The HTML of coloured, faded and struck tokens is one <div> on one line (an HTML block, which Markdown hands
    whole to the HTML parser), and each token's text entity-escaped, ':' and line breaks as references."""
    import numpy as np
    import pandas as pd

    from analysis.live import faded_text_html
    from analysis.pruning import struck_text_html
    from analysis.tokens import colored_tokens_html
    toks = ["![i](http:127.0.0.1:9)", "\n\n", "<b>x</b>", " :material/home: ", "a\r\n  b", "$x$", "&amp;"]
    table = pd.DataFrame({"layer": 0, "position": range(len(toks)), "token": toks, "dropped": [True, False] * 3 + [1],
                          "dropped_at": 3, "trigger_token": toks[::-1], "drop_share": 0.5})
    for out in (colored_tokens_html(toks, [0.5] * len(toks)), faded_text_html(toks, 2, np.ones(len(toks) - 1)),
                struck_text_html(table, 0)):
        assert out.startswith("<div") and "\n" not in out and "\r" not in out
        assert ":material" not in out and "<b>" not in out and "](" in out   # (the brackets stay: HTML is not Markdown)


# ---- a browser: Streamlit's own Markdown, and the app ---------------------------------------------------------------

class Listener:
    """A local HTTP server that records every request: what a page fetched for an image, a CSS url() or a link."""

    def __init__(self):
        seen = self.requests = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):   # noqa: N802 - http.server's name
                seen.append(self.path)
                self.send_response(404)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    got = Listener()
    yield got
    got.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env))
    for _ in range(240):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail("streamlit did not start: " + proc.stdout.read().decode()[-2000:])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield b
        b.close()


MARKDOWN_PAGE = '''
import json, sys
import numpy as np, pandas as pd, streamlit as st
from app.plain import md
from analysis.live import faded_text_html
from analysis.pruning import struck_text_html
from analysis.tokens import colored_tokens_html
cases = json.load(open(sys.argv[1]))
for i, s in enumerate(cases):
    with st.container(key=f"case{i}"):
        st.markdown("[" + md(s) + "]")
        st.caption("[" + md(s) + "]")
        st.metric("[" + md(s) + "]", 1, help="[" + md(s) + "]")
toks = cases[:40]
with st.container(key="colored"):
    st.markdown(colored_tokens_html(toks, [0.5] * len(toks)), unsafe_allow_html=True)
with st.container(key="faded"):
    st.markdown(faded_text_html([t.replace("\\n", "⏎") for t in toks], 3, np.ones(len(toks) - 1)),
                unsafe_allow_html=True)
table = pd.DataFrame({"layer": 0, "position": range(len(toks)), "token": toks, "dropped": [i % 2 == 0 for i in
                      range(len(toks))], "dropped_at": 1, "trigger_token": toks[::-1], "drop_share": 0.5})
with st.container(key="struck"):
    st.markdown(struck_text_html(table, 0), unsafe_allow_html=True)
with st.container(key="done"):
    st.write("done")
'''

# what the page's own HTML builders may make (anything else came from a token)
OUR_TAGS = {"div", "span", "s", "u", "br", "p"}


@pytest.mark.browser
@pytest.mark.full
def test_streamlit_shows_md_and_token_html_as_their_text_in_chromium(browser, listener, tmp_path):
    """Streamlit's real Markdown in chromium: each hostile string through md() in st.markdown, st.caption and a
    metric's label is one paragraph whose text is the string (joiners aside) and makes no element; coloured,
    faded and struck tokens make only our tags; no request reaches the listener."""
    target = f"127.0.0.1:{listener.port}"
    cases = [s.replace("127.0.0.1:9", target) for s in FIXED] + random_strings(150, seed=1)
    cases = [s for s in cases if s.strip()]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "page.py").write_text(MARKDOWN_PAGE)
    port = free_port()
    proc = start([sys.executable, "-m", "streamlit", "run", str(tmp_path / "page.py"), "--server.headless", "true",
                  "--server.port", str(port), "--browser.gatherUsageStats", "false", "--",
                  str(tmp_path / "cases.json")],
                 port, {})
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector(".st-key-done", timeout=120_000)
        page.wait_for_timeout(2000)
        got = page.evaluate("""n => { const out = [], MADE = 'img, a, svg, math, .katex, code, strong, em, del, span';
            for (let i = 0; i < n; i++) {
                const shown = Array.from(document.querySelectorAll(`.st-key-case${i} :is(
                    [data-testid='stMarkdownContainer'], [data-testid='stCaptionContainer'])`))
                    .filter(c => !c.closest("[data-testid='stMetricValue']"));   // (the metric's value: 1)
                out.push(shown.map(c => ({text: c.textContent, made: c.querySelectorAll(MADE).length,
                                          tags: Array.from(c.querySelectorAll('*')).map(e => e.tagName)})));
            }
            return out; }""", len(cases))
        for s, containers in zip(cases, got):
            assert len(containers) == 3, s   # the markdown, the caption and the metric's label
            for c in containers:
                assert plain(c["text"]) == f"[{plain(s)}]", (s, c["text"])   # (the joiners: md's and the input's)
                assert c["tags"] == ["P"] and not c["made"], (s, c["tags"])
        for key in ("colored", "faded", "struck"):
            tags = page.evaluate(f"""() => Array.from(document.querySelectorAll(
                ".st-key-{key} [data-testid='stMarkdownContainer'] *")).map(e => e.tagName.toLowerCase())""")
            assert tags and set(tags) <= OUR_TAGS, (key, sorted(set(tags) - OUR_TAGS))
        colored = page.inner_text(".st-key-colored [data-testid='stMarkdownContainer']")
        assert cases[0] in colored and ":material/home:" in colored and '<span style="background:url(' in colored
        page.close()
    finally:
        stop(proc)
    assert listener.requests == [], listener.requests


# ---- every page, fed such names and text ---------------------------------------------------------------------------

def hostile(port: int | str, tag: str) -> str:
    """A directory name (no '/') that, taken as Markdown or plotly text, fetches from 127.0.0.1:port: an image
    ('http:host' is read as 'http://host/'), a CSS url() in plotly's <span style>, plus HTML, a colour, math,
    emphasis and a bare URL."""
    return (f'{tag} ![i](http:127.0.0.1:{port}) <b>b <span style="background:url(http:127.0.0.1:{port})">s'
            f" :red[r] $m$ _u_ www.x.co")   # (no '/': one directory; plotly closes an open tag itself)


def hostile_text(port: int | str) -> str:
    return (f"The river rose. ![t](http:127.0.0.1:{port}) <span style=\"background:url(http:127.0.0.1:{port})\">"
            f"s</span> <b>bold</b> :red[red] :material/home: $x^2$ http://127.0.0.1:{port}/u www.x.co a@b.co "
            "[link](http:127.0.0.1) the end")


def build_zoo(root: Path, port: int | str, serve_outside: Path | None = None) -> dict:
    """A models folder of tiny models with hostile names: a pruned MHA (its dense base elsewhere, also hostile:
    outside the roots in serve mode), a dense MHA and an Extractor; and one more (by path) in root/lab."""
    import torch

    from analysis.zoo import models_root
    from models.checkpoint import load_model_dir, save_model_dir
    from models.config import ModelConfig
    from models.transformer import DecoderLM
    tok = load_model_dir(models_root() / "mha").tokenizer
    cfg = dict(mixer="mha", vocab_size=8192, context=64, d_model=32, n_layers=2, n_heads=4)
    names = {k: hostile(port, k) for k in ("a-pruned", "b-dense", "c-me", "d-added", "e-base")}
    secret = root / "secret" / names["e-base"]
    card = {"test_perplexity": 50.0, "status": names["b-dense"], "data": {"dir": str(root / "secret" / "data")}}
    torch.manual_seed(0)
    base = save_model_dir((serve_outside or root / "elsewhere") / names["e-base"], DecoderLM(ModelConfig(**cfg)),
                          tok, card)
    pruned = DecoderLM(ModelConfig(**cfg, prune=True, prune_r=8))
    for b in pruned.blocks:
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(0.0)   # some drops
    zoo = root / "zoo"
    paths = {"a-pruned": save_model_dir(zoo / names["a-pruned"], pruned, tok,
                                        card | {"train": {"init_from": str(base)}}),
             "b-dense": save_model_dir(zoo / names["b-dense"], DecoderLM(ModelConfig(**cfg)), tok, card),
             "c-me": save_model_dir(zoo / names["c-me"], DecoderLM(ModelConfig(**cfg | {"mixer": "me"})), tok, card),
             "d-added": save_model_dir(root / "lab" / names["d-added"], DecoderLM(ModelConfig(**cfg)), tok, card)}
    return {"zoo": zoo, "names": names, "paths": paths, "base": base, "secret": secret, "lab": root / "lab"}


def walk(node):
    yield node
    for child in getattr(node, "children", {}).values():
        yield from walk(child)


MARKDOWN_KINDS = ("markdown", "caption", "info", "warning", "error", "success", "title", "header", "subheader")


def markdown_texts(at) -> list[str]:
    """Every string of the page Streamlit renders as Markdown: elements, labels and help texts (HTML of our own,
    unsafe_allow_html, apart: html_texts)."""
    out = [e.value for kind in MARKDOWN_KINDS for e in at.get(kind) if not getattr(e.proto, "allow_html", False)]
    for node in walk(at._tree):
        proto = getattr(node, "proto", None)
        for field in ("label", "help"):
            value = getattr(proto, field, None)
            if isinstance(value, str) and value:
                out.append(value)
    return out


def markup(source: str) -> list[str]:
    """What Streamlit's Markdown would make of `source` beyond text and our own emphasis and code: images, links,
    HTML, autolinks, emoji, icons, directives (colours) and math."""
    found = []
    out = COMMONMARK.render(source)
    found += re.findall(r"<(?:img|a|span|b|script)\b[^>]*>", out)
    text = html.unescape(re.sub(r"<[^>]*>", " ", out))
    found += [what for what, p in TEXT_REWRITES[:4] if p.search(text)]
    found += re.findall(r"(?<![\\\w]):{1,3}[A-Za-z][\w-]*(?=[\[{])", source)
    found += [":material/"] * (":material/" in source) + ["math"] * streamlit_math(source)
    return found


def html_texts(at) -> list[str]:
    return [e.value for e in at.get("markdown") if getattr(e.proto, "allow_html", False)]


def html_markup(source: str) -> list[str]:
    """What HTML of coloured, faded or struck tokens holds beyond our own: another tag, a URL in CSS, a line break
    (a blank line would end the HTML block and let Markdown read the rest), an HTML block that does not open it."""
    found = [t for t in re.findall(r"</?([A-Za-z][\w-]*)", source) if t.lower() not in OUR_TAGS]
    found += ["url("] * ("url(" in source) + ["a line break"] * ("\n" in source or "\r" in source)
    return found + ["not one <div>"] * (not source.startswith("<div"))


def figures_refused(at) -> list[str]:
    return [why for c in at.get("plotly_chart")
            if (why := spec_refusal(without_inert_template_parts(json.loads(c.proto.spec))))]


def run_page(name: str, zoo: dict, port, monkeypatch, added: bool = True) -> AppTest:
    monkeypatch.setenv("MIXSCOPE_MODELS", str(zoo["zoo"]))
    monkeypatch.setenv("MIXSCOPE_CORPUS_DIRS", str(zoo["zoo"].parent / "no-reports"))
    path = APP / "main.py" if name == "Models.py" else APP / "views" / name
    at = AppTest.from_file(str(path), default_timeout=300)
    at.session_state["shared_text"] = hostile_text(port)
    at.session_state["gen_prompt"] = f"<b>The ![t](http:127.0.0.1:{port}) :red[r]"   # (within a tiny context)
    if added and name != "Models.py":
        at.session_state["added_paths"] = [str(zoo["paths"]["d-added"])]
    at.run()
    if name == "Models.py" and added:
        at.text_input(key="extra_path").input(str(zoo["paths"]["d-added"])).run()
    if name == "1_Generate.py":
        at.number_input(key="gen_n").set_value(6)
        at.checkbox(key="gen_greedy").check()
        at.button(key="gen_go").click().run()
    if name == "4_Extractors.py":
        at.sidebar.selectbox(key="model").select(zoo["names"]["c-me"]).run()
    if name == "6_Compare.py":
        at.sidebar.selectbox(key="model2").select(zoo["names"]["b-dense"]).run()
    assert not at.exception, (name, at.exception)
    return at


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return build_zoo(tmp_path_factory.mktemp("hostile"), 9)


# where each page shows a model's name or the text's tokens in Markdown: what md() of it must appear
SHOWN = {"Models.py": lambda z: [md(str(z["paths"]["d-added"]))],
         "1_Generate.py": lambda z: [md(z["names"]["a-pruned"]), md(z["base"].name)],
         "4_Extractors.py": lambda z: [],
         "6_Compare.py": lambda z: [md(z["names"]["a-pruned"]), md(z["names"]["b-dense"])]}


@pytest.mark.full
@pytest.mark.parametrize("name", PAGES)
def test_every_page_shows_hostile_names_and_text_as_text(name, zoo, monkeypatch):
    """Models named with image, HTML, colour, math and URL syntax (a dense base and an added path too), a text
    holding the same: no Markdown element, label or help text of the page makes an image, link, HTML, colour,
    icon, emoji or math of them (the names appear escaped where the page shows them), and no figure's spec holds
    a tag with a style, a url() or a URL (analysis.plain.spec_refusal)."""
    at = run_page(name, zoo, 9, monkeypatch)
    texts = markdown_texts(at)
    bad = {t: m for t in texts if (m := markup(t))}
    assert not bad, bad
    bad_html = {t[:200]: m for t in html_texts(at) if (m := html_markup(t))}
    assert not bad_html, bad_html
    assert not figures_refused(at), figures_refused(at)
    joined = "\n".join(texts)
    for escaped in SHOWN.get(name, lambda z: [])(zoo):
        assert escaped in joined, (name, escaped)
    if name == "5_Attribution.py":
        assert any(t.startswith("Explaining **") for t in texts) and any(t.startswith("after ") for t in texts)


@pytest.mark.full
def test_the_extractors_page_names_a_model_it_cannot_show_escaped(zoo, monkeypatch):
    at = run_page("4_Extractors.py", zoo, 9, monkeypatch)
    at.sidebar.selectbox(key="model").select(zoo["names"]["b-dense"]).run()
    assert any(i.value.startswith(md(zoo["names"]["b-dense"]) + " (mha): not an Extractor") for i in at.info)
    assert not [m for i in at.info if (m := markup(i.value))]


# ---- serve mode: no server path ------------------------------------------------------------------------------------

@pytest.fixture
def serve_zoo(tmp_path, monkeypatch):
    z = build_zoo(tmp_path, 9)
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.setenv("MIXSCOPE_PATH_ROOTS", str(z["lab"]))
    monkeypatch.delenv("MIXSCOPE_MAX_WEIGHTS_MB", raising=False)
    return z


@pytest.fixture
def downloads(monkeypatch):
    """What the pages offer for download: each button's data when it is text or bytes, and a CSV's or JSON's
    (built on a click) by calling it; figures (PNG, SVG, PDF) are left out."""
    from streamlit.delta_generator import DeltaGenerator
    got = []
    real = DeltaGenerator.download_button

    def record(self, label, data, *args, **kwargs):
        if callable(data):
            if label in ("CSV", "JSON"):
                got.append((label, data()))
        else:
            got.append((label, data))
        return real(self, label, data, *args, **kwargs)

    monkeypatch.setattr(DeltaGenerator, "download_button", record)
    return got


@pytest.mark.full
@pytest.mark.parametrize("name", PAGES)
def test_serve_mode_shows_no_server_path_on_any_page(name, serve_zoo, tmp_path, monkeypatch, downloads):
    """Serve mode, every page with the hostile models (one added by path inside the root, a pruned model's dense
    base outside every root, a card naming a data directory elsewhere): no element's text (captions, errors, tables,
    labels, options, figure specs) and no download (sidecars, CSVs, traces) holds an absolute path of the test's
    directories."""
    at = run_page(name, serve_zoo, 9, monkeypatch)
    places = {str(tmp_path), os.path.realpath(tmp_path)}
    seen = [str(getattr(node, "proto", "")) for node in walk(at._tree)]
    leaks = [s[max(0, s.find(p) - 80):s.find(p) + 120] for s in seen for p in places if p in s]
    assert not leaks, leaks
    for label, data in downloads:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
        assert not [p for p in places if p in text], (label, text[:300])
    if name == "Models.py":
        caption = [c.value for c in at.caption if c.value.startswith("Added this session")]
        assert caption == ["Added this session: " + md("<root 1>/" + serve_zoo["names"]["d-added"])]
    if name == "7_Pruning.py":   # the dense base outside the roots: by its name alone
        assert any(c.value.startswith(f"dense base {md('…/' + serve_zoo['base'].name)}: ") for c in at.caption)


# ---- the app in a browser: the Models page and two more, a listener counting requests ------------------------------

@pytest.mark.browser
@pytest.mark.full
def test_pages_with_hostile_models_make_no_request_in_chromium(browser, listener, tmp_path):
    """The app (`make run`'s command) on a models folder of hostile names, one more added by path, hostile text
    pasted: the Models page (its table, caption and figure), Attention and Pruning draw without a single request
    to the listener their names and text point at."""
    from tests.test_browser import wait_idle
    z = build_zoo(tmp_path, listener.port)
    port = free_port()
    proc = start([sys.executable, "-m", "models.cli", "run", "--no-fetch", "--host", "127.0.0.1", "--port",
                  str(port)], port, {"MIXSCOPE_MODELS": str(z["zoo"])})
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/")
        wait_idle(page)
        box = page.get_by_label("Add a model directory by path")
        box.fill(str(z["paths"]["d-added"]))
        box.press("Enter")
        wait_idle(page)
        page.wait_for_selector("text=Added this session", timeout=60_000)
        page.wait_for_function("() => document.querySelector('.js-plotly-plot .main-svg')", timeout=60_000)
        assert z["names"]["d-added"] in plain(page.inner_text("body"))   # the name, as text
        for where in ("Attention", "Pruning"):
            page.goto(f"http://127.0.0.1:{port}/{where}")
            wait_idle(page)
            area = page.locator("textarea").first
            area.fill(hostile_text(listener.port))
            area.press("Control+Enter")
            wait_idle(page)
            page.wait_for_function("() => document.querySelector('.js-plotly-plot .main-svg')", timeout=120_000)
            assert page.locator("[data-testid='stException']").count() == 0, where
        page.wait_for_timeout(1000)
        page.close()
    finally:
        stop(proc)
    assert listener.requests == [], listener.requests
