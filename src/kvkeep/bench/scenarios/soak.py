"""`kvkeep bench soak --minutes M`: agents on kvkeep while the cache server and vLLM die.

For M minutes, N closed-loop coding agents replay their sessions against vLLM in mode kvkeep
while `soak_faults.schedule`'s faults run beside them: cache-server SIGKILLs (RAM is lost, the
disk tier survives; with ``corrupt``, disk bytes are flipped), vLLM restarts, and faults at a
restarted vLLM's first kvkeep load (`SoakSpec.ready_faults`). Every reply is judged against
its prompt's no-cache reference by `kvkeep.bench.criterion.same_as_cold`.

Its contract (exit 1 otherwise): ``failed_requests`` is 0 (a dead, slow or corrupt cache costs
speed, never a request; one cut by a vLLM restart is counted in
``requests_lost_to_engine_restart`` and retried) and ``wrong_outputs`` is 0. Every figure of
`SoakResult`, and how it is measured: docs/notes/bench-soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from kvkeep.bench.command import Command
from kvkeep.bench.context import RunContext
from kvkeep.bench.criterion import DRIFT_TOL, Verdict, same_as_cold
from kvkeep.bench.deploy.rpcproxy import RpcProxy
from kvkeep.bench.deploy.vllm import VLLMServer
from kvkeep.bench.http import agent_loop
from kvkeep.bench.judged import Judged, ask_async, chat_body
from kvkeep.bench.scenario import Needs
from kvkeep.bench.scenarios.soak_faults import (
    Faults,
    Sample,
    Sampler,
    SoakSpec,
    background,
    rss_growth,
)
from kvkeep.traffic.endpoint import discover_model
from kvkeep.traffic.workload import HFTokenizer, SessionSpec, Turn, generate_sessions

# A soak turn (a small session) takes seconds: one stuck this long is a failed request, and
# the run goes on (the bench's own REQUEST_TIMEOUT_S waits for 16k-token cold prefills).
TURN_TIMEOUT_S = 300.0


@dataclass
class SoakScenario:
    """The whole soak on the context's vLLM and cache server, which it kills and restarts."""

    spec: SoakSpec
    name: str = "soak"

    def needs(self) -> Needs:
        return Needs(
            modes=("kvkeep",),
            own_engine=True,
            tokens=self.spec.max_model_len,
            num_blocks=self.spec.num_blocks,
        )

    def run(self, ctx: RunContext) -> SoakResult:
        spec = self.spec
        session = SessionSpec(
            turns=spec.turns,
            scale=spec.scale,
            max_output_tokens=spec.max_output_tokens,
            seed=spec.seed,
        )
        sessions = generate_sessions(session, HFTokenizer(ctx.model), spec.agents)
        print(f"soak: {sum(map(len, sessions))} reference replies, no cache", file=sys.stderr)
        t_ref = time.monotonic()
        model = asyncio.run(served_model(ctx.url))
        refs = asyncio.run(references(ctx.url, model, sessions))
        ref_s = time.monotonic() - t_ref
        print(f"soak: {spec.minutes} min of agents and faults", file=sys.stderr)
        t0 = time.monotonic()
        sampler = Sampler(ctx.cache, ctx.engine, spec.sample_every_s, t0)
        # a unix socket's path has at most 107 bytes: the proxy's lives in a short directory
        where = Path(tempfile.mkdtemp(prefix="kvkeep-soak-"))
        proxy = RpcProxy(str(where / "proxy.sock"), ctx.cache.socket)
        faults = Faults(spec, ctx.cache, ctx.engine, sampler, proxy)
        tally = Tally(ctx.engine, model, refs, t0)
        try:
            with background("soak-sampler", sampler.loop), background("soak-faults", faults.run):
                asyncio.run(agent_loop(sessions, tally.turn, until=t0 + spec.duration_s))
        finally:
            proxy.close()
            shutil.rmtree(where, ignore_errors=True)
        sampler.sample()  # the counts since the last sample
        return summarize(spec, tally, faults, sampler.samples, ref_s, time.monotonic() - t0)


class Result(NamedTuple):
    """One judged turn: when it started (seconds into the run), how long it took, the reply
    and the criterion's verdict on it."""

    t_s: float
    latency_s: float
    reply: Judged
    verdict: Verdict


def request(model: str, turn: Turn, salt: str | None = None) -> dict[str, Any]:
    """A turn as a judged chat request (`kvkeep.bench.judged`)."""
    return chat_body(model, turn.messages, turn.max_tokens, turn.tools, salt)


async def references(
    url: str, model: str, sessions: Sequence[Sequence[Turn]]
) -> dict[tuple[int, int], Judged]:
    """The no-cache reply of every distinct prompt: a fresh random cache_salt per request
    roots its block hashes in vLLM and in kvkeep where nothing is cached."""
    out: dict[tuple[int, int], Judged] = {}
    gate = asyncio.Semaphore(2)
    async with httpx.AsyncClient(timeout=TURN_TIMEOUT_S) as client:

        async def one(agent: int, turn: Turn) -> None:
            async with gate:
                body = request(model, turn, f"soak-ref-{uuid.uuid4().hex}")
                out[(agent, turn.index)] = await ask_async(client, url, body, TURN_TIMEOUT_S)

        await asyncio.gather(*(one(a, t) for a, turns in enumerate(sessions) for t in turns))
    return out


async def served_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        return await discover_model(client, url)


@dataclass
class Tally:
    """The agents' turns on ``engine``, each judged against its reference in ``refs``; what
    they saw. Mutated only on the event loop's thread."""

    engine: VLLMServer
    model: str  # the served model's name
    refs: dict[tuple[int, int], Judged]
    t0: float
    results: list[Result] = field(default_factory=list)
    failed: int = 0
    lost_to_engine_restart: int = 0
    errors: list[str] = field(default_factory=list)

    async def turn(self, client: httpx.AsyncClient, agent: int, turn: Turn) -> None:
        """One turn, retried after an engine restart cut it; a failure of any other kind is
        counted in ``failed`` (and retried too, so the agent moves on)."""
        engine, ref = self.engine, self.refs[(agent, turn.index)]
        for _ in range(5):
            url, generation = await asyncio.to_thread(engine.current)
            start = time.monotonic()
            try:
                body = request(self.model, turn)
                reply = await ask_async(client, url, body, TURN_TIMEOUT_S)
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                if engine.generation != generation or engine.restarting:
                    self.lost_to_engine_restart += 1
                else:
                    self.failed += 1
                    self.errors.append(f"agent {agent} turn {turn.index}: {exc!r}"[:300])
                    await asyncio.sleep(1.0)
                continue
            if engine.generation != generation:
                # vLLM's shutdown aborts requests in flight, and may answer them with 200 and
                # a truncated output: a reply that spans a restart is the restart's
                self.lost_to_engine_restart += 1
                continue
            verdict = same_as_cold(reply.reply, ref.reply)
            if not verdict:
                self.errors.append(
                    f"agent {agent} turn {turn.index} at {start - self.t0:.1f} "
                    f"s: {verdict.why}: {list(reply.reply.token_ids)} vs "
                    f"reference {list(ref.reply.token_ids)}"
                )
            self.results.append(Result(start - self.t0, time.monotonic() - start, reply, verdict))
            return


@dataclass(frozen=True)
class SoakResult:
    """A run's figures (see the module doc), over time, and the faults as done."""

    spec: SoakSpec
    requests: int
    failed_requests: int
    requests_lost_to_engine_restart: int
    wrong_outputs: int
    replies_compared: int
    tokens_compared: int
    ties_broken: int
    max_logprob_diff: float
    server_kills: int
    engine_restarts: int
    ready_faults: int
    ready_faults_missed: int
    guard: dict[str, float]
    live_corruptions: int
    bytes_flipped: int
    disk_checksum_failures: float
    kvkeep_hit_blocks: float
    kvkeep_loaded_tokens: float
    kvkeep_load_failed_tokens: float
    cached_fraction: float
    latency_p50_s: float | None
    latency_p99_s: float | None
    hit_rate_over_time: list[dict[str, Any]]
    rss_over_time: list[dict[str, Any]]
    rss_growth_mb: dict[str, float | None]
    events: list[dict[str, Any]]
    fault_errors: list[str]
    errors: list[str]
    reference_s: float
    wall_s: float
    scenario: str = "soak"
    drift_tolerance: float = DRIFT_TOL


def summarize(
    spec: SoakSpec,
    tally: Tally,
    faults: Faults,
    samples: Sequence[Sample],
    reference_s: float,
    wall_s: float,
) -> SoakResult:
    """The result; ``samples`` ends with one taken after the run."""
    results, last = tally.results, samples[-1]
    return SoakResult(
        spec,
        len(results),
        tally.failed,
        tally.lost_to_engine_restart,
        sum(not r.verdict for r in results),
        len(results),
        sum(r.verdict.compared for r in results),
        sum(r.verdict.ok and bool(r.verdict.why) for r in results),  # a tie broken
        max((r.verdict.worst for r in results), default=0.0),
        faults.count("server_kill"),
        faults.count("engine_restart"),
        faults.count("ready_kill") + faults.count("ready_corrupt"),
        faults.count("ready_missed"),
        last.guard,
        faults.count("corrupt_live"),
        faults.flipped,
        last.disk_checksum_failures,
        last.kvkeep_hit_blocks,
        last.loaded_tokens,
        last.load_failed_tokens,
        _fraction(results),
        _pct(results, 0.5),
        _pct(results, 0.99),
        hit_windows(results, samples, spec.duration_s),
        [{"t_s": round(s.t_s, 1), "server_mb": s.server_mb, "vllm_mb": s.vllm_mb} for s in samples],
        rss_growth(samples),
        [e._asdict() for e in faults.events],
        faults.errors,
        tally.errors[:20],
        reference_s,
        wall_s,
    )


def _fraction(results: Sequence[Result]) -> float:
    prompt = sum(r.reply.prompt_tokens for r in results)
    return sum(r.reply.cached_tokens for r in results) / prompt if prompt else 0.0


def _pct(results: Sequence[Result], q: float) -> float | None:
    lat = sorted(r.latency_s for r in results)
    return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None


def hit_windows(
    results: Sequence[Result], samples: Sequence[Sample], duration_s: float, windows: int = 12
) -> list[dict[str, Any]]:
    """Per window: requests, the cached fraction of prompt tokens (vLLM's usage, local and
    kvkeep), and blocks kvkeep served (server counters, across restarts)."""
    width = duration_s / windows
    out = []
    for w in range(windows):
        lo, hi = w * width, (w + 1) * width
        rows = [r for r in results if lo <= r.t_s < hi]
        out.append(
            {
                "t_s": round(lo, 1),
                "requests": len(rows),
                "cached_fraction": round(_fraction(rows), 4),
                "kvkeep_hit_blocks": _hits_before(samples, hi) - _hits_before(samples, lo),
            }
        )
    return out


def _hits_before(samples: Sequence[Sample], t: float) -> float:
    """kvkeep's hit blocks as last sampled before ``t``: a running total, so the largest."""
    return max((s.kvkeep_hit_blocks for s in samples if s.t_s < t), default=0.0)


def add_args(p: argparse.ArgumentParser) -> None:
    d = SoakSpec()
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--scale", type=float, default=d.scale)
    p.add_argument("--kill-every", type=float, help="seconds between cache-server SIGKILLs")
    p.add_argument("--restart-every", type=float, help="seconds between vLLM restarts")
    p.add_argument(
        "--down", type=float, default=d.down_s, help="seconds a killed server stays down"
    )
    p.add_argument("--no-corrupt", action="store_true", help="kill only; flip no disk bytes")
    p.add_argument(
        "--no-ready-faults",
        action="store_true",
        help="no fault at a restarted vLLM's first kvkeep load",
    )
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="vLLM's device pool")
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(modes=["kvkeep"], cache_ram=d.cache_ram, cache_disk=d.cache_disk)


def build(args: argparse.Namespace) -> list[SoakScenario]:
    spec = SoakSpec(
        minutes=args.minutes,
        agents=args.agents,
        turns=args.turns,
        scale=args.scale,
        kill_every_s=args.kill_every,
        restart_every_s=args.restart_every,
        down_s=args.down,
        corrupt=not args.no_corrupt,
        ready_faults=not args.no_ready_faults,
        num_blocks=args.num_blocks,
        seed=args.seed,
        cache_ram=args.cache_ram,
        cache_disk=args.cache_disk,
    )
    return [SoakScenario(spec)]


def output(doc: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the table; --json: the document and a PNG beside it. Exit 1 if a request failed
    or an output was wrong."""
    from kvkeep.bench.report.soak import plot, table

    if "error" in doc:
        return 1
    print(table(doc))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        png = plot(doc, args.json.with_suffix(".png"))
        print(f"JSON written to {args.json}, plot {png}", file=sys.stderr)
    return 0 if doc["failed_requests"] == 0 and doc["wrong_outputs"] == 0 else 1


COMMAND = Command(
    name="soak",
    help="agents while the cache and engine are killed",
    add_args=add_args,
    build=build,
    modes="kvkeep",
    compare=False,
    output=output,
)
