"""Workloads as block traces: which prefix blocks each request reads, in arrival order.

A block id names a block *and its whole prefix* (like a chained block key): two requests that
share block id ``x`` at position ``i`` share their first ``i + 1`` blocks. Readers:
:func:`read_mooncake` (Mooncake-format JSONL), :mod:`kvkeep.plan.claude_code` (Claude Code
sessions), :func:`read_runner_output` (``kvkeep bench session`` JSON);
:mod:`kvkeep.plan.workloads` builds traces from kvkeep's session generator and tile order.

Under vLLM's rules (``vllm_blocks``) a request of ``n`` tokens holds ``n // B`` blocks, of
which at most ``(n - 1) // B`` may hit, and a request generating ``o`` tokens caches
``(n + o - 1) // B - n // B`` more (``tail_blocks``: never read again, but they take LRU
slots); otherwise every id counts as a block. Every error raised while reading is a
:class:`TraceError` naming the file, the line and what is wrong with it.
The formats and the reasons for vLLM's rules: docs/notes/traces.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file, line and problem."""


class Request(NamedTuple):
    """One request of a block trace.

    ``blocks`` are prefix block ids in prompt order; ``tokens`` the prompt length; at most the
    first ``hit_cap`` blocks may hit. ``stream`` names the agent or session it belongs to;
    ``tail_blocks`` counts the blocks its output fills (cached, never read again).
    """

    blocks: tuple[int, ...]
    tokens: int
    hit_cap: int
    time_s: float = 0.0
    output_tokens: int = 0
    stream: int = 0
    tail_blocks: int = 0


@dataclass(frozen=True)
class BlockTrace:
    """Requests in arrival order, with ``block_tokens`` tokens per block."""

    requests: tuple[Request, ...]
    block_tokens: int
    source: str
    rules: str  # "trace" (every id is a block) or "vllm" (full blocks, >= 1 token computed)
    sessions: int = 0  # agent sessions interleaved in the trace, where the format says

    def max_concurrent(self) -> int:
        """Most sessions (``Request.stream``) active at once: between a session's first and
        last request."""
        spans: dict[int, tuple[float, float]] = {}
        for r in self.requests:
            lo, hi = spans.get(r.stream, (r.time_s, r.time_s))
            spans[r.stream] = (min(lo, r.time_s), max(hi, r.time_s))
        starts = [(lo, 1) for lo, _ in spans.values()]
        ends = [(hi, -1) for _, hi in spans.values()]
        edges = sorted(starts + ends, key=lambda e: (e[0], -e[1]))
        best = now = 0
        for _, step in edges:
            now += step
            best = max(best, now)
        return best

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"--block-tokens must be positive, got {self.block_tokens}")

    @property
    def references(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    def distinct_blocks(self) -> int:
        return len({b for r in self.requests for b in r.blocks})

    def mean_prompt_tokens(self) -> float:
        return self.prompt_tokens / max(1, len(self.requests))


def make_request(
    blocks: Sequence[int],
    tokens: int,
    block_tokens: int,
    vllm_blocks: bool,
    **extra: Any,
) -> Request:
    """A request under trace rules (all ``blocks`` count) or vLLM's rules (see module doc)."""
    if not vllm_blocks:
        return Request(tuple(blocks), tokens, len(blocks), **extra)
    full = tuple(blocks[: tokens // block_tokens])
    written = tokens + max(0, extra.get("output_tokens", 0) - 1)
    tail = written // block_tokens - tokens // block_tokens
    return Request(full, tokens, max(0, (tokens - 1) // block_tokens), tail_blocks=tail, **extra)


def read_mooncake(path: Path, block_tokens: int = 512, vllm_blocks: bool = False) -> BlockTrace:
    """Read a Mooncake JSONL trace. Raises TraceError naming the first bad line."""
    requests = [
        _mooncake_request(obj, where, block_tokens, vllm_blocks) for obj, where in _json_lines(path)
    ]
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    return BlockTrace(tuple(requests), block_tokens, str(path), "vllm" if vllm_blocks else "trace")


def _json_lines(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """(object, "FILE:LINE") for each non-blank line; TraceError on a line that is not JSON."""
    try:
        lines: Iterable[str] = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield obj, where


def _mooncake_request(
    obj: dict[str, Any], where: str, block_tokens: int, vllm_blocks: bool
) -> Request:
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(_is_count(i) for i in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    tokens = _field(obj, "input_length", where, default=len(ids) * block_tokens)
    if tokens > len(ids) * block_tokens or tokens <= (len(ids) - 1) * block_tokens:
        raise TraceError(
            f"{where}: input_length {tokens} does not fit {len(ids)} blocks of {block_tokens} "
            f"tokens; is --block-tokens right (Mooncake traces use 512)?"
        )
    extra = {
        "time_s": _field(obj, "timestamp", where, default=0) / 1000.0,
        "output_tokens": _field(obj, "output_length", where, default=0),
    }
    return make_request(ids, tokens, block_tokens, vllm_blocks, **extra)


def _field(obj: dict[str, Any], name: str, where: str, default: int) -> int:
    value = obj.get(name, default)
    if not _is_count(value):
        raise TraceError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return int(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_runner_output(path: Path, block_tokens: int, mode: str | None = None) -> BlockTrace:
    """The session of ``kvkeep bench session --json`` output, one mode's turns, as a trace.

    The runner records sizes, not token ids: turn ``t`` is modelled as extending turn
    ``t - 1``'s prompt (true of kvkeep's session generator), so its first
    ``min(n_t, n_{t-1}) // B`` blocks are shared. vLLM's rules always apply.
    """
    doc = _load_json(path)
    turns = _runner_turns(doc, path, mode)
    requests = []
    for i, turn in enumerate(turns):
        where = f"{path}: turn {i}"
        tokens = _field(turn, "prompt_tokens", where, default=-1)
        blocks = range(tokens // block_tokens)
        out = _field(turn, "output_tokens", where, default=0)
        requests.append(make_request(blocks, tokens, block_tokens, True, output_tokens=out))
    return BlockTrace(tuple(requests), block_tokens, f"{path} ({mode or 'first mode'})", "vllm")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from exc


def _runner_turns(doc: Any, path: Path, mode: str | None) -> list[dict[str, Any]]:
    modes = doc.get("modes") if isinstance(doc, dict) else None
    if not isinstance(modes, dict) or not modes:
        raise TraceError(f"{path}: no 'modes' object; expected `kvkeep bench session --json`")
    name = mode or next(iter(modes))
    if name not in modes:
        raise TraceError(f"{path}: no mode {name!r}; it has {', '.join(modes)}")
    turns = modes[name].get("turns") if isinstance(modes[name], dict) else None
    if not isinstance(turns, list) or not turns:
        raise TraceError(f"{path}: mode {name!r} has no 'turns' list")
    return turns


def measured_hit_rate(path: Path, mode: str | None = None) -> float:
    """cached / prompt tokens over one mode's turns of a runner output (what vLLM reported)."""
    turns = _runner_turns(_load_json(path), path, mode)
    prompt = sum(int(t.get("prompt_tokens", 0)) for t in turns)
    return sum(int(t.get("cached_tokens", 0)) for t in turns) / max(1, prompt)


def read_trace(path: Path, block_tokens: int, vllm_blocks: bool, mode: str | None) -> BlockTrace:
    """A Mooncake JSONL trace or a runner JSON output, told apart by their first character."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"{") and b'"modes"' in head:
        return read_runner_output(path, block_tokens, mode)
    return read_mooncake(path, block_tokens, vllm_blocks)
