"""The app's one entry point: every page is declared here (st.navigation); `make run` / `mixscope run` start it.
Each page file also runs alone (the tests open them one by one)."""
import streamlit as st

# url paths kept from the old pages/ layout, so addresses such as /Attention?model=mhe-mul still open a page. The
# folder is views/: one named pages/ beside this file switches Streamlit to its legacy multipage mode, in which a
# first visit to /Pruning runs that page alone and this navigation never takes over.
PAGES = [
    st.Page("Models.py", title="Models", default=True),
    st.Page("views/1_Generate.py", title="Generate", url_path="Generate"),
    st.Page("views/2_Attention.py", title="Attention", url_path="Attention"),
    st.Page("views/3_Heads.py", title="Heads", url_path="Heads"),
    st.Page("views/4_Extractors.py", title="Extractors", url_path="Extractors"),
    st.Page("views/5_Attribution.py", title="Attribution", url_path="Attribution"),
    st.Page("views/6_Compare.py", title="Compare", url_path="Compare"),
    st.Page("views/7_Pruning.py", title="Pruning", url_path="Pruning"),
    st.Page("views/8_Corpus.py", title="Corpus", url_path="Corpus"),
]

st.navigation(PAGES).run()
