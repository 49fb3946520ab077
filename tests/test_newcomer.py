"""What a newcomer does first works on a fresh clone: the README's `make` targets exist and
plan to set up what they need, and every `kvkeep` command the README names is one the CLI
lists. The clone is of what is committed, as a new user gets it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _named(pattern: str) -> set[str]:
    return set(re.findall(pattern, README, re.M))


def test_the_readme_names_its_two_commands() -> None:
    assert {"demo", "test"} <= _named(r"(?:^|`)make ([a-z]+)")


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.fail("git and make are what a newcomer runs; install them")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    out = tmp_path_factory.mktemp("newcomer") / "kvkeep"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(out)], check=True, timeout=120)
    return out


@pytest.mark.parametrize("target", ["demo", "test"])
def test_each_make_target_of_the_readme_plans_its_own_setup(clone: Path, target: str) -> None:
    """`make -n TARGET` on a fresh clone (no .venv, no .cache): the plan creates the
    virtualenv, installs the package, writes the tiny model and then runs the target."""
    assert target in _named(r"(?:^|`)make ([a-z]+)")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    plan = subprocess.run(
        ["make", "-n", "--no-print-directory", target],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,  # as a newcomer's shell has it, not `make test`'s, which runs this test
    )
    assert plan.returncode == 0, plan.stderr
    steps = plan.stdout
    assert "-m venv .venv" in steps and "pip install" in steps
    assert "kvkeep model tiny .cache/tiny-model" in steps
    last = {"demo": "kvkeep demo", "test": "pytest"}[target]
    assert last in steps.splitlines()[-1], steps.splitlines()[-1]


def test_every_kvkeep_command_the_readme_names_is_listed() -> None:
    named = _named(r"(?:^|`)kvkeep ([a-z]+)")
    assert {"serve", "plan", "bench"} <= named
    top = subprocess.run(
        [sys.executable, "-m", "kvkeep.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    listed = set(re.findall(r"^  ([a-z]+)  ", top.stdout, re.M))
    assert named <= listed, f"the README names {sorted(named - listed)}, kvkeep lists {listed}"
