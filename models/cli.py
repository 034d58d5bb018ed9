"""mixscope: one command for the project's entry points, each the same as its `python -m` form.

    mixscope run [--host 127.0.0.1] [--port 8501]    the app for one user (make run)
    mixscope serve [--host H] [--port P]             the app for a lab: serve mode (make serve, docs/deployment.md)
    mixscope SUBCOMMAND ARGS ...                     the rest below; `mixscope SUBCOMMAND --help` for their options

Installed by `pip install -e .` (pyproject.toml); without installing, `python -m models.cli` is the same command.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # the checkout: app/, assets/ and the shipped models live there

# subcommand -> (module whose main(argv) runs it, arguments put first, what it does)
COMMANDS = {
    "generate": ("models.generate", [], "generate text from a model directory (python -m models.generate)"),
    "evaluate": ("models.evaluate", [], "perplexity and sparsity of a model directory (python -m models.evaluate)"),
    "train": ("models.train", [], "train a model from a config (python -m models.train)"),
    "export": ("analysis.export", [],
               "every page's figures for a model and a text, or a corpus report (python -m analysis.export)"),
    "render": ("analysis.render", [], "redraw an exported figure from its JSON sidecar (python -m analysis.render)"),
    "import": ("models.import_hf", [], "import a Hugging Face checkpoint (python -m models.import_hf)"),
    "fetch": ("models.fetch", [], "fetch the registry bases of the shipped deltas (python -m models.fetch)"),
    "data": ("models.data.build", [], "build the corpus (python -m models.data prepare)"),
    "bench": ("bench.kernels", [], "kernel benchmark against the reference (python -m bench.kernels)"),
}

# what `make run` and `make serve` pass to streamlit; serve mode adds the lab's limits (docs/deployment.md)
STREAMLIT_FLAGS = ["--server.headless", "true", "--server.fileWatcherType", "none",
                   "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer"]
SERVE_FLAGS = ["--server.maxUploadSize", "1", "--client.showErrorDetails", "none"]


def app_command(host: str, port: int, serve: bool) -> tuple[list[str], dict]:
    """The streamlit command line and environment that start the app."""
    cmd = [sys.executable, "-m", "streamlit", "run", str(ROOT / "app" / "main.py"), *STREAMLIT_FLAGS,
           "--server.address", host, "--server.port", str(port), *(SERVE_FLAGS if serve else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # the server (uvicorn) would otherwise let an X-Forwarded-For header from this machine replace the connection's
    # address, so anyone on the box could name themselves anew per tab; who a proxy's user is comes from
    # MIXSCOPE_USER_HEADER, believed only from MIXSCOPE_TRUSTED_PROXIES (app/heavy.py)
    env["FORWARDED_ALLOW_IPS"] = ""
    if serve:
        env["MIXSCOPE_SERVE"] = "1"
    return cmd, env


def start_app(argv: list[str], serve: bool) -> int:
    ap = argparse.ArgumentParser(prog=f"mixscope {'serve' if serve else 'run'}",
                                 description="Start the app" + (" in serve mode (docs/deployment.md)" if serve else ""))
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface, behind a proxy)")
    ap.add_argument("--port", type=int, default=8501)
    ap.add_argument("--no-fetch", action="store_true", help="skip fetching the shipped deltas' missing bases first")
    args = ap.parse_args(argv)
    # loading never fetches: bases come before the app starts (a failure is reported, not fatal)
    if not args.no_fetch:
        try:
            from models import fetch
            fetch.main([str(ROOT / "assets" / "models")])
        except Exception as e:  # noqa: BLE001 - the app opens without the bases; the Models page says what is missing
            print(f"mixscope: fetching the shipped deltas' bases failed ({e}); the app starts without them",
                  file=sys.stderr)
    cmd, env = app_command(args.host, args.port, serve)
    print(f"mixscope{' (serve mode)' if serve else ''}: open http://{args.host}:{args.port} (Ctrl-C stops it)",
          file=sys.stderr)
    sys.stderr.flush()
    # streamlit takes this process's place, so Ctrl-C and a supervisor's SIGTERM reach it directly; from the
    # checkout, where it reads .streamlit/config.toml (the upload cap among it)
    os.chdir(ROOT)
    os.execve(cmd[0], cmd, env)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mixscope", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", metavar="SUBCOMMAND")
    sub.add_parser("run", help="start the app for one user on this machine (make run)", add_help=False)
    sub.add_parser("serve", help="start the app for a lab, untrusted users (make serve)", add_help=False)
    for name, (_, _, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser().print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in ("run", "serve"):
        return start_app(rest, serve=name == "serve")
    if name not in COMMANDS:
        parser().error(f"unknown subcommand {name!r}; one of: run, serve, {', '.join(COMMANDS)}")
    module, first, _ = COMMANDS[name]
    return importlib.import_module(module).main(first + rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
