"""The training corpus: registry sources (sources.py, with an R database reader in rdata.py), the prepared data
directory and its readers (corpus.py), and `python -m models.data prepare` (build.py)."""
from models.data.build import main, prepare
from models.data.corpus import (HELD_OUT_FRACTION, SPLITS, DataError, load_documents, load_tokens, manifest_sha256,
                                normalize, sha256_bytes, split_documents)
from models.data.sources import DEFAULT_SOURCES, SOURCES, chapters

__all__ = ["main", "prepare", "HELD_OUT_FRACTION", "SPLITS", "DataError", "load_documents", "load_tokens",
           "manifest_sha256", "normalize", "sha256_bytes", "split_documents", "DEFAULT_SOURCES", "SOURCES", "chapters"]
