"""Models: the zoo as a table, with the efficiency view (perplexity vs attention parameters)."""
import pandas as pd
import streamlit as st

from app import access
from app.common import MAX_PATH, add_path, export_buttons, listing, model_paths, public, setup, shown_path
from app.plain import md

from analysis.zoo import efficiency_figure, models_root

setup("Models")
st.caption("Small decoder language models whose token mixer is MHA, SHA, MQA, SKV, EL-ATT, MHE-ADD, MHE-MUL "
           "or an Extractor (SHE, HE, WE, ME). Pick a page on the left to look inside one.")

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
paths = model_paths()
if not paths:
    st.info(f"No models found in {md(shown_path(models_root()))}."
            + " Train one (see README), or add a model directory by path above.")
    st.stop()

table = listing(paths)  # configs, cards and weight headers only, in a slot: no model is loaded to list it
for col in table.columns.drop("path"):  # what the browser sees names server directories by label (cards' too)
    if table[col].dtype == object or pd.api.types.is_string_dtype(table[col]):
        table[col] = table[col].map(lambda v: public(v) if isinstance(v, str) else v)
good = table[table["error"].isna()].drop(columns=["error", "path"])
first = ["model", "mixer", "test ppl", "PRR", "PEoP", "attention params", "total params", "KV-cache bytes/token",
         "adapter", "trainable %"]
good = good[[c for c in first if c in good] + [c for c in good if c not in first]]
st.subheader(f"{len(good)} model(s) found")
for _, row in table[table["error"].notna()].iterrows():
    st.error(md(public(f"{row['model']}: {row['error']}")))
if len(good):
    # the name column as wide as its longest name (SmolLM2's deltas were cut to "smollm2-pr..."), kept in view
    name_px = int(min(420, 40 + 8 * good["model"].astype(str).str.len().max()))
    st.dataframe(good, hide_index=True, width="stretch",
                 column_config={"model": st.column_config.TextColumn("model", width=name_px, pinned=True)})
    st.caption("attention params: the token mixer without its output projection. PRR vs the MHA model, PEoP vs the SHA "
               "model (docs/methods.md). KV-cache bytes/token: decode state each new token adds, all layers, float32. "
               "PRR, PEoP and the figure cover the models scored on the zoo's test set (column data): a model scored "
               "in another tokenizer (SmolLM2's) has its own perplexity scale. Listed from configs, cards and weight "
               "headers: weight values (NaN, a base's checksum) are checked when a page opens the model.")
    if good["test ppl"].notna().any():
        fig = efficiency_figure(good)
        st.plotly_chart(fig, width="stretch")
        drawn = table[table["error"].isna() & table["test ppl"].notna()]   # (each named with its weights' hash)
        export_buttons(fig, good, "zoo_efficiency", dict(zip(drawn["model"], drawn["path"])),
                       settings={"models": list(good["model"])})
