"""The planner as a new user would run it, on real sessions it has never seen, against an
explicit LRU cache with vLLM's eviction order (issue 15's acceptance: within 1 point).

Everything on the simulation's side reads the raw files itself: the arrival offsets (uniform
over the window, one draw per file in name order, as the planner documents), the sub-agents,
the 128-token blocks under vLLM's rules and the blocks the outputs fill. The held-out files
are used by no other test and by none of the replay's presets.
"""

from __future__ import annotations

import gzip
import json
import random
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

from kvkeep.plan.main import main

from .test_claude_code import traces  # noqa: F401  (fixture)

HELD_OUT = ("trace_0699.json.gz", "trace_0705.json.gz", "trace_0715.json.gz",
            "trace_0720.json.gz", "trace_0724.json.gz")  # fmt: skip
BLOCK = 128  # tokens per engine block: two 64-token trace blocks
WINDOW_S, SEED = 900, 5
CAPACITIES = (100, 400, 1500, 6000)


class Call(NamedTuple):
    time_s: float
    file: str
    ids: list[int]
    tokens: int
    output: int


def calls_of(requests: list[dict[str, Any]], start: float, file: str) -> list[Call]:
    """A session's model calls and, recursively, its sub-agents' (``t`` relative to theirs)."""
    out = []
    for r in requests:
        if r["type"] == "subagent":
            out += calls_of(r["requests"], start + r["t"], file)
        else:
            out.append(Call(start + r["t"], file, r["hash_ids"], r["in"], r.get("out", 0)))
    return out


def interleaved(directory: Path) -> list[Call]:
    files = sorted(directory.glob("*.json.gz"))
    rng = random.Random(SEED)
    offsets = [rng.uniform(0, WINDOW_S) for _ in files]
    calls = []
    for path, offset in zip(files, offsets, strict=True):
        with gzip.open(path, "rt") as f:
            calls += calls_of(json.load(f)["requests"], offset, path.name)
    return sorted(calls, key=lambda c: c.time_s)


def lru_hit_rate(calls: list[Call], capacity: int) -> float:
    """An LRU cache of ``capacity`` engine blocks as vLLM runs it: a request's full blocks hit
    up to the first miss, never past ``(in - 1) // BLOCK`` (one token is always computed);
    then its blocks and its output's full blocks are freed last first, so the prompt's first
    block is evicted last."""
    cache: OrderedDict[object, None] = OrderedDict()
    hits = refs = 0
    for n, c in enumerate(calls):
        full = c.tokens // BLOCK
        names = [(c.file, c.ids[2 * j + 1]) for j in range(full)]  # the id ending each block
        refs += full
        cap = (c.tokens - 1) // BLOCK
        hit = 0
        while hit < cap and names[hit] in cache:
            hit += 1
        hits += hit
        tail = (c.tokens + max(0, c.output - 1)) // BLOCK - full
        for block in reversed([*names, *((n, j) for j in range(tail))]):
            cache[block] = None
            cache.move_to_end(block)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits / refs


def test_plan_equals_an_explicit_lru_on_unseen_sessions(traces: Path, tmp_path: Path) -> None:  # noqa: F811
    for name in HELD_OUT:
        shutil.copy(traces / name, tmp_path / name)
    out = tmp_path / "p.json"
    argv = ["--trace", str(tmp_path), "--window", str(WINDOW_S), "--seed", str(SEED),
            "--block-tokens", str(BLOCK), "--vllm-blocks",
            "--capacity-blocks", ",".join(map(str, CAPACITIES)), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    planned = json.loads(out.read_text())["hit_rate_by_capacity"]
    calls = interleaved(tmp_path)
    rates = [lru_hit_rate(calls, c) for c in CAPACITIES]
    assert rates == sorted(rates) and 0 < rates[0] < rates[-1] < 1  # the capacities matter
    for capacity, simulated in zip(CAPACITIES, rates, strict=True):
        assert abs(planned[str(capacity)] - simulated) <= 0.01, capacity
