"""Real Claude Code sessions as a block trace: the kv-cache-tester trace format.

A file (``.json`` or ``.json.gz``) is one session: ``block_size`` (64 tokens) and ``requests``
in order, each with ``t`` (seconds from the session's start), ``in``/``out`` tokens and
``hash_ids``, one per full 64-token block of the prompt; ids are local to a file and name a
block with its whole prefix. A ``subagent`` request is a nested agent that becomes a session
of its own, sharing the file's ids. Sessions start at offsets drawn uniformly over
``window_s`` or from a Poisson process of ``rate_per_s`` (with ``seed``; all at 0 when neither
is given), and requests are taken in order of their absolute time. A block of
``block_tokens`` = k x 64 tokens groups k consecutive ids and is named by its last; under
vLLM's rules at most ``(in - 1) // block_tokens`` may hit (:mod:`kvkeep.plan.trace`).
The format in full: docs/notes/traces.md.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvkeep.plan.trace import BlockTrace, Request, TraceError, make_request

TRACE_BLOCK_TOKENS = 64
SUFFIXES = (".json", ".json.gz")


@dataclass(frozen=True)
class Arrival:
    """When each file's session starts: uniform over ``window_s``, Poisson at
    ``rate_per_s`` sessions per second, or all at 0. Deterministic for a ``seed``."""

    window_s: float | None = None
    rate_per_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.window_s is not None and self.rate_per_s is not None:
            raise ValueError("give --window or --rate, not both")
        if self.window_s is not None and self.window_s < 0:
            raise ValueError(f"--window must be >= 0 seconds, got {self.window_s}")
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ValueError(
                f"--rate must be positive (sessions per second), got {self.rate_per_s}"
            )

    def offsets(self, count: int) -> list[float]:
        rng = random.Random(self.seed)
        if self.window_s is not None:
            return [rng.uniform(0.0, self.window_s) for _ in range(count)]
        if self.rate_per_s is not None:
            t, out = 0.0, []
            for _ in range(count):
                out.append(t)
                t += rng.expovariate(self.rate_per_s)
            return out
        return [0.0] * count

    def describe(self) -> str:
        if self.window_s is not None:
            return f"starts uniform over {self.window_s:g} s (seed {self.seed})"
        if self.rate_per_s is not None:
            return f"Poisson arrivals at {self.rate_per_s:g}/s (seed {self.seed})"
        return "all sessions start at once"


class TraceCall(NamedTuple):
    """One model call of a session: ``time_s`` from the session's start, the prompt's 64-token
    ``ids``, its ``tokens`` and ``output_tokens``, and ``think_s``, the pause between the
    previous reply and this call (the trace's ``think_time``, else the gap in ``t``)."""

    time_s: float
    ids: Sequence[int]
    tokens: int
    output_tokens: int
    think_s: float


class TraceSession(NamedTuple):
    """A session (a file's top-level agent or one of its sub-agents): ``file`` indexes the
    files read (ids are local to a file, so sessions of one file share blocks), ``start_s``
    is its absolute start under the arrival model, ``where`` names it in messages."""

    file: int
    start_s: float
    calls: tuple[TraceCall, ...]
    where: str


class _Call(NamedTuple):
    time_s: float
    file: int
    session: int
    ids: Sequence[int]
    tokens: int
    output_tokens: int


def is_claude_code(path: Path) -> bool:
    """Whether ``path`` is a directory of, or one, Claude Code trace file."""
    if path.is_dir():
        return any(_trace_files(path))
    if not path.name.endswith(SUFFIXES):
        return False
    head = _open(path).read(4096)
    return '"hash_id_scope"' in head or ('"requests"' in head and '"block_size"' in head)


def read_claude_code(
    path: Path,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    vllm_blocks: bool = False,
    arrival: Arrival = Arrival(),
) -> BlockTrace:
    """One file or a directory of files as one interleaved block trace. Raises TraceError
    naming the file and request that is wrong."""
    if block_tokens % TRACE_BLOCK_TOKENS:
        raise TraceError(
            f"--block-tokens {block_tokens}: Claude Code traces have {TRACE_BLOCK_TOKENS}-token "
            f"blocks; use a multiple of {TRACE_BLOCK_TOKENS}"
        )
    files = trace_files(path)
    calls: list[_Call] = []
    found = load_sessions(files, arrival)
    for n, session in enumerate(found):
        calls += [
            _Call(session.start_s + c.time_s, session.file, n, c.ids, c.tokens, c.output_tokens)
            for c in session.calls
        ]
    sessions = len(found)
    calls.sort(key=lambda c: c.time_s)
    blocks = _requests(calls, block_tokens // TRACE_BLOCK_TOKENS, block_tokens, vllm_blocks)
    source = (
        f"{path}: {len(files)} Claude Code traces, {sessions} sessions (sub-agents included), "
        f"{len(blocks)} requests; {arrival.describe()}"
    )
    rules = "vllm" if vllm_blocks else "trace"
    return BlockTrace(tuple(blocks), block_tokens, source, rules, sessions=sessions)


def trace_files(path: Path) -> list[Path]:
    """``path`` itself, or the trace files of a directory in name order. TraceError if none."""
    files = [path] if path.is_file() else list(_trace_files(path))
    if not files:
        raise TraceError(f"{path}: no .json or .json.gz trace files")
    return files


def load_sessions(files: Sequence[Path], arrival: Arrival = Arrival()) -> list[TraceSession]:
    """Every session of ``files`` (file order; a file's sub-agents, depth first, after the
    calls around them), each file offset by the arrival model. Raises TraceError naming the
    file and request that is wrong."""
    out: list[TraceSession] = []
    for index, (file, offset) in enumerate(zip(files, arrival.offsets(len(files)), strict=True)):
        doc = _load(file)
        for start, requests, where in _sessions(doc.get("requests"), offset, f"{file}"):
            calls = [
                _call(r, f"{where}[{i}]", requests[i - 1] if i else None)
                for i, r in enumerate(requests)
            ]
            out.append(TraceSession(index, start, tuple(calls), where))
    return out


def _trace_files(directory: Path) -> Iterator[Path]:
    return (p for p in sorted(directory.iterdir()) if p.is_file() and p.name.endswith(SUFFIXES))


def _open(path: Path) -> Any:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _load(path: Path) -> dict[str, Any]:
    try:
        with _open(path) as f:
            doc = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceError(f"{path}: expected an object with a 'requests' list (a Claude Code trace)")
    size = doc.get("block_size", TRACE_BLOCK_TOKENS)
    if size != TRACE_BLOCK_TOKENS:
        raise TraceError(f"{path}: block_size {size}; this reader knows {TRACE_BLOCK_TOKENS}")
    return doc


def _sessions(
    requests: Any, start: float, where: str
) -> Iterator[tuple[float, list[dict[str, Any]], str]]:
    """(start time, model calls, location) of a session and, depth first, its sub-agents."""
    calls = []
    for i, r in enumerate(requests):
        if not isinstance(r, dict):
            raise TraceError(f"{where}[{i}]: a request must be an object")
        if r.get("type") == "subagent":
            nested = r.get("requests")
            if not isinstance(nested, list):
                raise TraceError(f"{where}[{i}]: a subagent needs a 'requests' list")
            yield from _sessions(nested, start + _number(r, "t", f"{where}[{i}]"), f"{where}[{i}]")
        else:
            calls.append(r)
    if calls:
        yield start, calls, where


def _call(r: dict[str, Any], where: str, previous: dict[str, Any] | None) -> TraceCall:
    ids = r.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    tokens = int(_number(r, "in", where))
    if len(ids) != tokens // TRACE_BLOCK_TOKENS:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for 'in' = {tokens} tokens; expected "
            f"{tokens // TRACE_BLOCK_TOKENS} (one per full {TRACE_BLOCK_TOKENS}-token block)"
        )
    out = int(_number(r, "out", where, default=0))
    t = _number(r, "t", where)
    gap = t - float(previous.get("t", 0.0)) if previous else 0.0
    think = _number(r, "think_time", where, default=max(0.0, gap))
    return TraceCall(t, ids, tokens, out, think)


def _number(r: dict[str, Any], name: str, where: str, default: float | None = None) -> float:
    value = r.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise TraceError(f"{where}: {name!r} must be a non-negative number, got {value!r}")
    return float(value)


def _requests(
    calls: Sequence[_Call], k: int, block_tokens: int, vllm_blocks: bool
) -> list[Request]:
    """Global block ids: (file, the id that ends each group of k) -> a dense integer. Under
    trace rules a trailing partial group counts as a block of its own, as Mooncake's last
    id does; under vLLM's rules ``make_request`` keeps full blocks only."""
    names: dict[tuple[int, int], int] = {}
    out = []
    for c in calls:
        ends = [c.ids[min(j + k, len(c.ids)) - 1] for j in range(0, len(c.ids), k)]
        blocks = [names.setdefault((c.file, e), len(names)) for e in ends]
        extra = {"time_s": c.time_s, "output_tokens": c.output_tokens, "stream": c.session}
        out.append(make_request(blocks, c.tokens, block_tokens, vllm_blocks, **extra))
    return out
