"""Figure export: real PNG/SVG/PDF files from kaleido, CSV equal to the plotted data, a complete sidecar."""
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import export, maps
from analysis.text import TextError, decode_upload, tokenize
from analysis.zoo import models_root
from models.checkpoint import load_model_dir
from models.files import file_sha256

REPO = Path(__file__).resolve().parent.parent
TEXT = "The bridge over the river was finished in the spring, and the town was glad of it."


@pytest.fixture(scope="module")
def mha():
    return load_model_dir(models_root() / "mha")


def test_bundle_files_are_what_they_claim(tmp_path, mha):
    toks = tokenize(mha.tokenizer, TEXT)
    m, kind = maps.mixing_maps(mha.model, toks.ids)
    fig = maps.map_figure(m[1, 2], toks.labels, "layer 1 head 2")
    table = maps.maps_table(m[1:2, 2:3], toks.labels)
    meta = export.sidecar(mha.path, TEXT, {"layer": 1, "head": 2}, "map")
    paths = {p.suffix: p for p in export.write_bundle(fig, table, tmp_path, "map", meta)}
    assert paths[".png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in paths[".svg"].read_bytes()[:400]
    assert paths[".pdf"].read_bytes()[:5] == b"%PDF-"
    assert all(p.stat().st_size > 500 for p in paths.values())
    # the CSV holds exactly the plotted (causal) entries
    csv = pd.read_csv(paths[".csv"])
    z = np.array(fig.data[0].z, dtype=float)
    assert len(csv) == np.isfinite(z).sum()
    np.testing.assert_allclose(csv["weight"].to_numpy(), z[csv["query_pos"], csv["key_pos"]], rtol=1e-6)
    side = json.loads(paths[".json"].read_text())
    assert side["checkpoint_sha256"] == file_sha256(mha.path / "model.safetensors")
    assert side["text_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    assert side["settings"] == {"layer": 1, "head": 2} and {"torch", "plotly", "kaleido"} <= set(side["versions"])


def test_cli_writes_every_figure_for_a_model(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    res = subprocess.run([sys.executable, "-m", "analysis.export", str(models_root() / "mhe-mul"), "--text", str(text),
                          "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    names = {p.name for p in (tmp_path / "out").iterdir()}
    for stem in ("maps_overview", "surprisal", "attribution_last", "heads_pca_e_Q", "heads_pca_g"):
        assert {f"{stem}.{ext}" for ext in ("png", "svg", "pdf", "csv", "json")} <= names
    side = json.loads((tmp_path / "out" / "surprisal.json").read_text())
    assert side["precision"] == {"device": "cpu", "dtype": "float32"}     # where and how the model ran


def test_cli_refuses_bad_text(tmp_path):
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"\xff\xfe\x00\x00binary")
    res = subprocess.run([sys.executable, "-m", "analysis.export", str(models_root() / "me"), "--text", str(bad),
                          "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "binary" in res.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name,data,message", [
    ("a.txt", b"", "is empty"),
    ("a.md", b"  \n\t", "is empty"),
    ("a.txt", b"caf\xe9 au lait", "not UTF-8 text (invalid byte 0xe9 at position 3)"),
    ("a.txt", b"PK\x03\x04\x00\x00zip", "binary file"),
    ("a.pdf", b"%PDF-1.4", "only .txt and .md files"),
    ("a.txt", b"x" * 20_001, "the limit is 20,000"),
])
def test_uploads_are_refused_with_a_reason(name, data, message):
    with pytest.raises(TextError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_upload(name, data)


def test_good_upload_keeps_text():
    assert decode_upload("n.md", "\ufeffĀ café — ok\n".encode("utf-8")) == "Ā café — ok\n"


def test_the_weights_hash_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    from models import files
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"first")
    calls = []
    real = files.file_sha256
    monkeypatch.setattr(files, "file_sha256", lambda p: calls.append(p) or real(p))
    first = export.sidecar(tmp_path, None, {}, "x")["checkpoint_sha256"]
    assert export.sidecar(tmp_path, None, {}, "x")["checkpoint_sha256"] == first and len(calls) == 1
    f.write_bytes(b"second, longer")   # (a new size: a new key even where mtime does not move)
    assert export.sidecar(tmp_path, None, {}, "x")["checkpoint_sha256"] == real(f) != first and len(calls) == 2


def test_render_redraws_an_exported_figure_from_its_sidecar_alone(tmp_path, mha):
    """The sidecar holds the figure's spec: `mixscope render` writes it again (another format, size, title)
    without the model; it refuses to overwrite, and says why a sidecar without a spec cannot be redrawn."""
    from analysis import render
    toks = tokenize(mha.tokenizer, TEXT)
    m, _ = maps.mixing_maps(mha.model, toks.ids)
    fig = maps.map_figure(m[1, 2], toks.labels, "layer 1 head 2")
    meta = export.sidecar(mha.path, TEXT, {"layer": 1, "head": 2}, "map", fig)
    export.write_bundle(fig, maps.maps_table(m[1:2, 2:3], toks.labels), tmp_path, "map", meta)
    side = tmp_path / "map.json"
    again = render.load_figure(side)
    assert json.loads(again.to_json())["data"] == json.loads(fig.to_json())["data"]   # (z as plotly's typed array)
    out = tmp_path / "paper"
    assert render.main([str(side), "--format", "svg", "--out", str(out), "--width", "500",
                        "--title", "Figure 3: a head"]) == 0
    svg = (out / "map.svg").read_text()
    assert "Figure 3: a head" in svg and 'width="500"' in svg[:400]
    before = (out / "map.svg").read_bytes()
    assert render.main([str(side), "--format", "svg", "--out", str(out)]) == 2      # refused: nothing rewritten
    assert (out / "map.svg").read_bytes() == before
    assert render.main([str(side), "--format", "svg", "--out", str(out), "--force"]) == 0
    assert "layer 1 head 2" in (out / "map.svg").read_text()
    old = tmp_path / "old.json"
    old.write_text(json.dumps({k: v for k, v in meta.items() if k != "plotly"}))
    with pytest.raises(export.ExportError, match="holds no figure spec"):
        render.load_figure(old)
    (tmp_path / "junk.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(export.ExportError, match="not a JSON sidecar"):
        render.load_figure(tmp_path / "junk.json")
    deep = tmp_path / "deep.json"
    deep.write_text('{"plotly": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert render.main([str(deep)]) == 2                                            # a message, not a traceback
    for bad in ({"plotly": None}, {"plotly": {"data": [], "layout": {"images": [{"source": "http://x/y.png"}]}}},
                {"plotly": {"data": [], "layout": {"template": {"layout": {"images": [{"source": "http://x"}]}}}}},
                {"plotly": {"data": [{"type": "image", "source": "http://x/y.png"}], "layout": {}}},
                {"plotly": {"data": [{"type": "choropleth"}], "layout": {}}},
                {"plotly": {"data": [], "layout": {"geo": {"scope": "europe"}}}},
                {"plotly": {"data": [], "layout": {"width": 10 ** 7}}}):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(export.ExportError):
            render.load_figure(tmp_path / "bad.json")
    assert render.main([str(side), "--out", str(out), "--width", "5"]) == 2
    assert render.main([str(side), "--out", str(out), "--format", "png", "--width", "8000", "--height", "8000",
                        "--scale", "10"]) == 2 and not (out / "map.png").exists()


def test_a_figure_in_plotlys_own_template_is_redrawn():
    """plotly's default template styles geo and map subplots; a figure carrying it (any figure made outside a
    streamlit process, which sets its own) is not refused for that."""
    import plotly.graph_objects as go

    from analysis import render
    fig = go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]), layout={"template": "plotly"})
    spec = json.loads(fig.to_json())
    assert spec["layout"]["template"]["layout"].get("geo")
    assert render.refused(spec) is None


def test_a_sidecar_names_a_deltas_base_and_the_codes_commit():
    delta = models_root() / "smollm2-pruned-window"
    pinned = json.loads((delta / "base.json").read_text())
    meta = export.sidecar(delta, None, {}, "x")
    assert meta["base"] == {"source": pinned["source"], "weights_sha256": pinned["weights_sha256"]}
    assert export.sidecar(models_root() / "mha", None, {}, "x")["base"] is None
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert meta["code"]["commit"] == (head.stdout.strip() if head.returncode == 0 else None)   # (None: no checkout)
    assert meta["code"]["uncommitted_changes"] in ((True, False) if head.returncode == 0 else (None,))


@pytest.mark.parametrize("name, summary", [("she", "fro"), ("we", "mean")])
def test_an_extractor_exports_the_lag_summary_its_attention_page_opens_on(name, summary):
    """SHE's overview is the norm of d x_ext_i / d x_j, not the signed mean of its d x d lags (which cancels); the
    others' is the signed mean, the matrix the forward records."""
    from analysis import lags
    loaded = load_model_dir(models_root() / name)
    figs = {n: (table, settings) for n, _, table, settings in export.model_figures(loaded, TEXT)}
    table, settings = figs["maps_overview"]
    assert settings["summary"] == summary == lags.default_summary(name)
    assert figs[f"lags_profile_{name}"][1] == {"value": {"she": "fro", "we": "mean and rms"}[name]}  # Extractors page's
    t = settings["tokens"]
    want = lags.lag_maps(loaded.model, t, summary)[:, 0]
    np.testing.assert_allclose(table["weight"].to_numpy(), want[table["layer"], table["query_pos"], table["key_pos"]],
                               rtol=1e-6, atol=1e-7)
    if summary == "fro":   # the norms are sizes: never negative, and not what the signed mean gives
        signed = maps.mixing_maps(loaded.model, tokenize(loaded.tokenizer, TEXT).ids[:t])[0][:, 0]
        assert (table["weight"] >= 0).all() and not np.allclose(want, signed, atol=1e-3)


def test_stable_svg_renames_the_drawings_ids_and_nothing_else():
    """plotly.js's random id is replaced where it names a def, a clip path or a gradient (and where those are used),
    never where the same six characters are data or text."""
    svg = (b'<svg><defs id="defs-abc123"><clipPath id="clipabc123xy"/></defs><g clip-path="url(#clipabc123xy)">'
           b'<text>abc123 = 0xabc123</text><rect style="fill: url(\'#gabc123-cb0\');"/></g></svg>')
    out = export.stable_svg(svg)
    new = re.search(rb'defs-([0-9a-f]{6})', out).group(1)
    assert new != b"abc123" and out.count(new) == 4
    assert b"<text>abc123 = 0xabc123</text>" in out
    assert out == export.stable_svg(svg.replace(b"abc123", b"fff000").replace(b"<text>fff000 = 0xfff000",
                                                                              b"<text>abc123 = 0xabc123"))
    starts = set()
    for i in range(40):   # other drawings' ids: a new id may start with a digit (not read as a group number)
        other = f"{i:06x}".encode()
        renamed = export.stable_svg(svg.replace(b"abc123", other).replace(b"<text>" + other, b"<text>abc123"))
        starts.add(re.search(rb'defs-([0-9a-f]{6})', renamed).group(1)[:1].isdigit())
    assert starts == {True, False}
