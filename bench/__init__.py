"""End-to-end benchmarks; results/ holds their JSON."""
import os
from contextlib import contextmanager


def cpu_model() -> str:
    """The CPU's model name and core count (results from different hosts differ: say which host)."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def proc_status_kb(field: str, pid: int | str = "self") -> int:
    """One field of a Linux process's /proc status, in KiB (VmRSS: resident now; VmHWM: its peak so far)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def report(result: dict, path: str | None) -> int:
    """Print a benchmark's JSON result and, when a path is given, write it there too; 0 for the exit status."""
    import json
    from pathlib import Path
    text = json.dumps(result, indent=1)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    print(text)
    return 0


@contextmanager
def env(name: str, value: str | None = None):
    """Inside the block the environment variable `name` is `value` (left as it is when None); after it, what it was
    before, set or unset (a benchmark's A/B switches must not leak into its caller)."""
    prior = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if prior is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = prior
