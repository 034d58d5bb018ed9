"""Token mixers by registry name (docs/methods.md: attention variants, head embeddings, Extractors):

attention.py   mha sha mqa skv el-att, and gqa for imported models
mhe.py         mhe-add mhe-mul (head embeddings)
extractor.py   she he we me
"""
from models.mixers.base import MIXERS, LayerRecord, Mixer, register
from models.mixers import attention, mhe, extractor  # noqa: F401  (fill the registry)


def build_mixer(cfg) -> Mixer:
    return MIXERS[cfg.mixer](cfg)


__all__ = ["MIXERS", "LayerRecord", "Mixer", "register", "build_mixer"]
