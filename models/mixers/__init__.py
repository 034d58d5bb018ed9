"""Token mixers by registry name: mha sha mqa skv el-att mhe-add mhe-mul she he we me."""
from models.mixers.base import MIXERS, Mixer, register
from models.mixers import attention, extractor  # noqa: F401  (fill the registry)


def build_mixer(cfg) -> Mixer:
    return MIXERS[cfg.mixer](cfg)


__all__ = ["MIXERS", "Mixer", "register", "build_mixer"]
