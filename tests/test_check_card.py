"""python -m models.evaluate --check-card: each card's test perplexity re-measured, one row per directory."""
import json

import pytest

from models import evaluate
from models.checkpoint import CheckpointError


def card_dir(tmp_path, name, **card):
    d = tmp_path / name
    d.mkdir()
    (d / "card.json").write_text(json.dumps(card))
    return str(d)


def test_rows_say_which_cards_reproduce_and_one_bad_directory_does_not_stop_the_rest(tmp_path):
    measured = {"same": 100.0 * (1 + 5e-7), "off": 100.0 * (1 + 2e-6), "tokens": 100.0}

    def fake(d, split, stride, progress, **dev):
        name = d.rsplit("/", 1)[-1]
        if name == "broken":
            raise CheckpointError("broken/model.safetensors is not a readable safetensors file")
        assert split == "test" and stride == 128 and dev == {"device": "cpu"}
        return {"perplexity": measured[name], "tokens": 50 if name == "tokens" else 40, "data_matches_card": True}

    dirs = [card_dir(tmp_path, n, test_perplexity=100.0, test_tokens=40, eval_stride=128)
            for n in ("same", "off", "tokens", "broken")]
    dirs.append(card_dir(tmp_path, "unfinished", status="interrupted", test_perplexity=float("nan")))
    dirs.append(str(tmp_path / "missing"))
    rows = {r["model_dir"].rsplit("/", 1)[-1]: r for r in evaluate.check_cards(dirs, evaluate=fake, device="cpu")}
    assert rows["same"]["ok"] is True and rows["same"]["rel_error"] == pytest.approx(5e-7)
    assert rows["off"]["ok"] is False                         # 2e-6 relative: beyond 1e-6
    assert rows["tokens"]["ok"] is False                      # same perplexity over other tokens is not the card
    assert rows["broken"]["ok"] is False and "safetensors" in rows["broken"]["error"]
    assert rows["unfinished"]["ok"] is None
    assert rows["missing"]["ok"] is False and "error" in rows["missing"]


def test_the_cli_refuses_options_a_card_fixes(capsys):
    with pytest.raises(SystemExit):
        evaluate.main(["--check-card", "assets/models/mha", "--stride", "128"])
    assert "drop --stride" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["assets/models/mha", "assets/models/sha"])   # two directories only with --check-card
