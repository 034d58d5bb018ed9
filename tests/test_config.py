import pytest

from models.config import ConfigError, ModelConfig
from tests.helpers import ALL_MIXERS


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_json_round_trip(mixer, tmp_path):
    cfg = ModelConfig(mixer=mixer, d_model=48, n_heads=6, context=64, dropout=0.1)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    cfg.save(tmp_path / "c.json")
    assert ModelConfig.load(tmp_path / "c.json") == cfg


def test_defaults_are_derived():
    cfg = ModelConfig(d_model=64, n_heads=4)
    assert (cfg.d_head, cfg.d_ff) == (16, 256)


@pytest.mark.parametrize("kwargs,message", [
    (dict(mixer="flash"), "unknown mixer 'flash'; choose one of: mha, sha"),
    (dict(d_model=30, n_heads=4), "not divisible by n_heads"),
    (dict(mixer="el-att", d_model=32, n_heads=4, d_head=6), "el-att slices the input"),
    (dict(context=0), "context must be a positive integer"),
    (dict(dropout=1.5), "dropout"),
])
def test_bad_configs_are_explained(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)


def test_unknown_field_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="unknown config field.*n_head"):
        ModelConfig.from_dict({"n_head": 4})
    (tmp_path / "c.json").write_text("{nope")
    with pytest.raises(ConfigError, match="c.json: not valid JSON"):
        ModelConfig.load(tmp_path / "c.json")
