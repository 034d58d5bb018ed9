"""The `mixscope` command: every subcommand is its `python -m` form; run and serve start the app as make does."""
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from models import cli

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_command_is_this_module_and_lists_every_subcommand(capsys):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["mixscope"] == "models.cli:main"
    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in ("run", "serve", *cli.COMMANDS):
        assert f"    {name} " in listed
    with pytest.raises(SystemExit):
        cli.main(["nope"])
    assert "unknown subcommand 'nope'" in capsys.readouterr().err


def test_a_subcommand_equals_its_python_m_form():
    args = ["assets/models/mha", "--prompt", "The", "--max-new-tokens", "3", "--seed", "1", "--json", "--device", "cpu"]
    run = [subprocess.run(cmd + args, capture_output=True, text=True, cwd=ROOT, check=True)
           for cmd in ([sys.executable, "-m", "models.cli", "generate"], [sys.executable, "-m", "models.generate"])]
    ours, theirs = (json.loads(r.stdout) for r in run)
    assert ours["text"] == theirs["text"] and ours["perplexity"] == theirs["perplexity"] and ours["new_tokens"] == 3


def test_serve_adds_the_lab_limits_to_what_run_starts():
    run_cmd, run_env = cli.app_command("127.0.0.1", 8600, serve=False)
    serve_cmd, serve_env = cli.app_command("0.0.0.0", 8601, serve=True)
    assert run_cmd[1:4] == ["-m", "streamlit", "run"] and Path(run_cmd[4]) == ROOT / "app" / "main.py"
    assert run_env.get("MIXSCOPE_SERVE") == __import__("os").environ.get("MIXSCOPE_SERVE")  # run adds nothing
    assert serve_env["MIXSCOPE_SERVE"] == "1" and str(ROOT) in serve_env["PYTHONPATH"]
    flag = dict(zip(serve_cmd[5::2], serve_cmd[6::2]))
    assert flag["--server.address"] == "0.0.0.0" and flag["--server.port"] == "8601"
    assert flag["--server.maxUploadSize"] == "1" and flag["--server.fileWatcherType"] == "none"
    assert "--server.maxUploadSize" not in run_cmd
