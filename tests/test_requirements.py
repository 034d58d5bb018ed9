"""requirements.txt, the pinned set `make install` installs with, agrees with pyproject.toml: torch first and pinned
as the project pins it, every direct dependency (and each extra `make` installs) at a version its specifier
allows, each package once, nothing a registry squatter names 999.9.9, and the Makefile installs with it."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("app", "test", "gpu", "cluster")


def _pins() -> list[tuple[str, Version]]:
    pins = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"requirements.txt: {line!r} is not one exact pin"
        pins.append((canonicalize_name(req.name), Version(spec[0].version)))
    return pins


def _direct() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in EXTRAS for r in project["optional-dependencies"][extra]]
    return [Requirement(r) for r in reqs]


def test_torch_comes_first_pinned_as_the_project_pins_it():
    pins = _pins()
    assert pins[0] == ("torch", Version("2.13.0"))


def test_every_direct_dependency_is_pinned_within_its_specifier():
    pins = dict(_pins())
    assert len(pins) == len(_pins()), "a package is pinned twice"
    for req in _direct():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not in requirements.txt: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"requirements.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}"


def test_no_squatted_versions():
    assert not [n for n, v in _pins() if v == Version("999.9.9")]


def test_make_installs_with_the_lock():
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(STAMP\): (.*)\n((?:\t.*\n)+)", make, re.M)
    assert recipe and "requirements.txt" in recipe.group(1)
    lines = recipe.group(2).splitlines()
    torch_at = next(i for i, ln in enumerate(lines) if "torch==2.13.0" in ln)
    lock_at = next(i for i, ln in enumerate(lines) if "-c requirements.txt" in ln)
    assert torch_at < lock_at
    installed = re.search(r'-e "\.\[([^\]]*)\]"', lines[lock_at])
    assert installed and set(installed.group(1).split(",")) == set(EXTRAS), "make installs other extras than these"
