"""mixscope home: which models were found, and what each one is. UI only: the table comes from analysis/."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `streamlit run app/Home.py` from anywhere

import streamlit as st  # noqa: E402

from analysis.zoo import find_model_dirs, models_root, zoo_table  # noqa: E402

st.set_page_config(page_title="mixscope", layout="wide")
st.title("mixscope")
st.caption("Look inside efficient token mixers: attention variants, head embeddings, Extractors, "
           "adaptively sparse attention.")

root = models_root()
paths = find_model_dirs(root)
extra = st.text_input("Add a model directory by path", key="extra_path").strip()
if extra:
    paths.append(Path(extra).expanduser())

if not paths:
    st.info(f"No models found in {root}. Train one (see README), or add a model directory by path above.")
else:
    table = zoo_table(paths)
    good = table[table["error"].isna()].drop(columns=["error"])
    st.subheader(f"{len(good)} model(s) found")
    if len(good):
        st.dataframe(good, hide_index=True, width="stretch")
    for _, row in table[table["error"].notna()].iterrows():
        st.error(f"{row['model']}: {row['error']}")
