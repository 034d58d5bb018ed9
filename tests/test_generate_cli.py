import json
import subprocess
import sys
from pathlib import Path

from models.checkpoint import save_model_dir
from models.tokenizer import train_bpe
from models.transformer import DecoderLM
from tests.helpers import tiny_config

REPO = Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, "-m", "models.generate", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_json_output_is_one_object(tmp_path):
    tok = train_bpe(["one two three four five six"] * 10, vocab_size=270, min_frequency=1)
    save_model_dir(tmp_path / "m", DecoderLM(tiny_config("mhe-add", vocab_size=300, context=32)), tok)
    res = run(str(tmp_path / "m"), "--prompt", "one two", "--max-new-tokens", "5", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["new_tokens"] == 5 and len(out["ms_per_token"]) == 5 and out["cache_bytes"] > 0


def test_bad_directory_is_a_clear_error(tmp_path):
    res = run(str(tmp_path / "nope"), "--prompt", "hi")
    assert res.returncode == 2 and "does not exist" in res.stderr and res.stdout == ""
