"""End-to-end benchmarks; results/ holds their JSON."""
import os


def cpu_model() -> str:
    """The CPU's model name and core count (results from different hosts differ: say which host)."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"
