"""The app's one entry point: every page is declared here (st.navigation); `make run` / `mixscope run` start it.
Each page file also runs alone (the tests open them one by one)."""
import streamlit as st

# url paths kept from the pages/ layout, so addresses such as /Attention?model=mhe-mul still open a page
PAGES = [
    st.Page("Models.py", title="Models", default=True),
    st.Page("pages/1_Generate.py", title="Generate", url_path="Generate"),
    st.Page("pages/2_Attention.py", title="Attention", url_path="Attention"),
    st.Page("pages/3_Heads.py", title="Heads", url_path="Heads"),
    st.Page("pages/4_Extractors.py", title="Extractors", url_path="Extractors"),
    st.Page("pages/5_Attribution.py", title="Attribution", url_path="Attribution"),
    st.Page("pages/6_Compare.py", title="Compare", url_path="Compare"),
    st.Page("pages/7_Pruning.py", title="Pruning", url_path="Pruning"),
]

st.navigation(PAGES).run()
