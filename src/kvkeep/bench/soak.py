"""`kvkeep bench soak --minutes M`: agents on kvkeep while the cache server and vLLM die.

For M minutes, N closed-loop coding agents replay their sessions (turn 0..T-1, again and
again) against vLLM in mode kvkeep, while a schedule of faults runs beside them:

- the cache server is SIGKILLed, stays down for ``down_s``, and is started again on the same
  directory (RAM is lost; the disk tier survives). With ``corrupt`` on, bytes of its disk
  segments are flipped while it is down (every other kill) and while it runs (half-way
  between kills);
- vLLM itself is restarted (SIGTERM to its process group, then a fresh start).

What it reports:

- ``failed_requests``: requests that did not complete while vLLM was up (must be 0: a dead,
  slow or corrupt cache costs speed, never a request). A request in flight when *vLLM* is
  restarted fails through no fault of kvkeep; it is counted in
  ``requests_lost_to_engine_restart`` and retried once the new engine answers.
- ``wrong_outputs``: replies that are wrong by ``kvkeep.bench.criterion``'s rule for a cold
  reference: a token differs where the reference had no tie, or a logprob differs by more
  than ``DRIFT_TOL`` where the tokens agree. The reference for each distinct prompt is
  computed once, before the clock starts, by the same engine with a fresh random
  ``cache_salt``: a salt roots both vLLM's and kvkeep's block hashes, so that request can hit
  no cache and is computed from scratch. Under 8 concurrent agents the KV of a turn comes
  from differently batched and chunked steps, so the exact rule (equal to vLLM's own hit on
  the same copy) does not apply here; the end-to-end tests check that one.
  ``replies_compared`` and ``tokens_compared`` say how much was judged, ``ties_broken`` how
  many replies went the other way at a tie, and ``max_logprob_diff`` is the largest
  difference where tokens agreed.
- the hit rate per time window (cached prompt tokens from vLLM's usage, and blocks kvkeep's
  server served), and the private RSS of the cache server and of vLLM's process tree over
  time, with the growth between the middle and the last third of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil

from kvkeep.bench.criterion import DRIFT_TOL, TOP_ALTERNATIVES, Verdict, same_as_cold
from kvkeep.bench.criterion import Reply as Judged
from kvkeep.bench.launch import LaunchConfig, VLLMServer
from kvkeep.serve import CacheServerConfig, CacheServerProcess
from kvkeep.workload import HFTokenizer, SessionSpec, Turn, generate_sessions

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SoakSpec:
    """One soak run. Fault intervals default to fractions of the run: with ``minutes=10``
    the cache server is killed 6 times and vLLM restarted twice."""

    minutes: float = 10.0
    agents: int = 8
    turns: int = 6
    scale: float = 0.02
    max_output_tokens: int = 8
    kill_every_s: float | None = None
    restart_every_s: float | None = None
    down_s: float = 2.0
    corrupt: bool = True
    sample_every_s: float = 5.0
    cache_ram: str = "256MiB"
    cache_disk: str = "1GiB"
    num_blocks: int = 96  # a small device pool, so kvkeep serves what vLLM evicted
    max_model_len: int = 4096
    timeout_s: float = 1.0
    seed: int = 0

    @property
    def duration_s(self) -> float:
        return self.minutes * 60

    @property
    def kill_interval_s(self) -> float:
        return self.kill_every_s or self.duration_s / 6.5

    @property
    def restart_interval_s(self) -> float:
        return self.restart_every_s or self.duration_s / 2.5

    def validate(self) -> None:
        """Raise ValueError naming the option to change."""
        if self.minutes <= 0:
            raise ValueError("--minutes must be positive")
        if self.agents < 1 or self.turns < 1:
            raise ValueError("--agents and --turns must be at least 1")
        if self.kill_interval_s <= self.down_s:
            raise ValueError("--kill-every must be longer than the downtime (--down)")


class Event(NamedTuple):
    """A fault, ``t_s`` seconds into the run."""

    t_s: float
    kind: str  # server_kill | engine_restart | corrupt_live
    took_s: float = 0.0
    detail: str = ""


def schedule(spec: SoakSpec) -> list[Event]:
    """The faults of a run, in time order. Pure.

    Kills fall every ``kill_interval_s``, engine restarts every ``restart_interval_s`` (a
    kill that would land within 10 s of a restart moves 10 s later), and with ``corrupt``
    a live corruption half-way after every other kill."""
    end = spec.duration_s
    restarts = _ticks(spec.restart_interval_s, end)
    kills = [_avoid(t, restarts) for t in _ticks(spec.kill_interval_s, end)]
    events = [Event(t, "engine_restart") for t in restarts]
    events += [Event(t, "server_kill") for t in kills if t < end]
    if spec.corrupt:
        half = spec.kill_interval_s / 2
        events += [Event(t + half, "corrupt_live") for t in kills[::2] if t + half < end]
    return sorted(events)


def _ticks(every: float, end: float) -> list[float]:
    return [every * k for k in range(1, int(end / every) + 1) if every * k < end]


def _avoid(t: float, others: Sequence[float], gap: float = 10.0) -> float:
    return t + gap if any(abs(t - o) < gap for o in others) else t


# --- the engine, restartable under the agents' feet -------------------------------------------


class Engine:
    """The current vLLM server. Agents take ``current()`` (waiting while it restarts); a
    request whose generation changed before it finished was cut by a restart."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.server = VLLMServer(cfg).start()
        self.generation = 0
        self._ready = threading.Event()
        self._ready.set()
        self._lock = threading.Lock()

    def current(self, timeout_s: float = 600.0) -> tuple[str, int]:
        """(url, generation) of a ready engine; blocks while one restarts."""
        if not self._ready.wait(timeout_s):
            raise RuntimeError("vLLM did not come back after a restart")
        with self._lock:
            return self.server.url, self.generation

    def restart(self) -> None:
        with self._lock:
            self._ready.clear()
            self.generation += 1
        try:
            # In-flight requests keep uvicorn waiting for their connections until the
            # engine is killed: a graceful stop would only add its timeout to the restart.
            self.server.stop(timeout_s=5.0)
            self.server = VLLMServer(self.cfg).start()
        finally:
            self._ready.set()

    def stop(self) -> None:
        self.server.stop()


# --- the cache server, killed and corrupted ---------------------------------------------------


class CacheUnderTest:
    """The kvkeep server of the run, with the faults done to it."""

    def __init__(self, spec: SoakSpec, directory: Path, seed: int) -> None:
        self.proc = CacheServerProcess(
            CacheServerConfig(directory, ram=spec.cache_ram, disk=spec.cache_disk)
        )
        self.directory = directory
        self.rng = random.Random(seed)
        self.flipped = 0

    @property
    def socket(self) -> str:
        return self.proc.cfg.socket_path

    def start(self) -> None:
        self.proc.ensure()

    def kill(self, down_s: float, corrupt: bool) -> str:
        """SIGKILL, stay down ``down_s`` (flipping disk bytes meanwhile if asked), restart."""
        pid = self.proc.pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.proc.stop(timeout_s=5)
        detail = self.corrupt_segments() if corrupt else ""
        time.sleep(down_s)
        self.start()
        return detail

    def corrupt_segments(self, flips: int = 8) -> str:
        """Flip one byte at each of ``flips`` random places in the disk tier's segment logs
        (in place: a running server reads the same inode). Returns what it did."""
        logs = sorted((self.directory / "disk").glob("seg-*.log"))
        logs = [p for p in logs if p.stat().st_size > 0]
        if not logs:
            return "no segment to corrupt"
        for _ in range(flips):
            path = self.rng.choice(logs)
            with contextlib.suppress(OSError), open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    continue
                f.seek(self.rng.randrange(size))
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
                self.flipped += 1
        return f"{flips} bytes flipped in {len(logs)} segments"

    def stats(self) -> dict[str, Any] | None:
        from kvkeep.server.client import CacheUnavailable, KVKeepClient

        client = KVKeepClient(socket_path=self.socket, timeout_s=2.0)
        try:
            return client.stats()
        except CacheUnavailable:
            return None
        finally:
            client.close()

    def stop(self) -> None:
        self.proc.stop()


# --- counters that survive restarts ------------------------------------------------------------


class Monotonic:
    """A sum of counters that reset when their process restarts: a value lower than the last
    one seen starts a new epoch. Call ``see`` often (and right before a planned kill)."""

    def __init__(self) -> None:
        self._base: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def see(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            last = self._last.get(name, 0.0)
            if value < last:
                self._base[name] = self._base.get(name, 0.0) + last
            self._last[name] = value

    def total(self, name: str) -> float:
        return self._base.get(name, 0.0) + self._last.get(name, 0.0)


def server_counters(stats: dict[str, Any] | None) -> dict[str, float]:
    if not stats:
        return {}
    tiers = stats.get("tiers", {})
    out: dict[str, float] = {}
    for tier in ("ram", "disk"):
        for name in ("hits", "checksum_failures"):
            out[f"{tier}_{name}"] = float(tiers.get(tier, {}).get(name, 0))
    return out


def engine_counters(url: str) -> dict[str, float]:
    """kvkeep's connector counters from vLLM's /metrics (tokens loaded, failed, offered)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {"loaded": 0.0, "load_failed": 0.0, "offered": 0.0, "saved": 0.0}
    for line in text.splitlines():
        if line.startswith("vllm:kvkeep_tokens_total{"):
            for op in out:
                if f'op="{op}"' in line:
                    out[op] += float(line.rsplit(" ", 1)[1])
    return out


def private_rss_mb(pid: int | None, tree: bool) -> float | None:
    """Resident bytes not shared with other processes (the arena's pages are shared), in MB,
    summed over the process's children when ``tree``."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)] if tree else [root]
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                info = p.memory_info()
                total += info.rss - info.shared
        return total / 1e6
    except psutil.Error:
        return None


class Sample(NamedTuple):
    t_s: float
    server_pid: int | None
    engine_generation: int
    server_mb: float | None
    vllm_mb: float | None
    kvkeep_hit_blocks: float
    disk_checksum_failures: float
    loaded_tokens: float
    load_failed_tokens: float


class Sampler:
    """Samples memory and counters every ``every_s`` on its own thread."""

    def __init__(self, cache: CacheUnderTest, engine: Engine, every_s: float, t0: float) -> None:
        self.cache, self.engine, self.every_s, self.t0 = cache, engine, every_s, t0
        self.server = Monotonic()
        self.vllm = Monotonic()
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        """Read counters and memory now (thread-safe; the fault thread calls it before a
        kill so no counts are lost with the process)."""
        with self._lock:
            self.server.see(server_counters(self.cache.stats()))
            with contextlib.suppress(httpx.HTTPError):
                self.vllm.see(engine_counters(self.engine.server.url))
            s = self.server
            self.samples.append(
                Sample(
                    time.monotonic() - self.t0,
                    self.cache.proc.pid,
                    self.engine.generation,
                    private_rss_mb(self.cache.proc.pid, tree=False),
                    private_rss_mb(self.engine.server.pid, tree=True),
                    s.total("ram_hits") + s.total("disk_hits"),
                    s.total("disk_checksum_failures") + s.total("ram_checksum_failures"),
                    self.vllm.total("loaded"),
                    self.vllm.total("load_failed"),
                )
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()


# --- faults thread ----------------------------------------------------------------------------


class Faults:
    """Runs the schedule on its own thread; ``events`` records what was done and how long."""

    def __init__(self, spec: SoakSpec, cache: CacheUnderTest, engine: Engine) -> None:
        self.spec, self.cache, self.engine = spec, cache, engine
        self.events: list[Event] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self.sampler: Sampler | None = None
        self.t0 = 0.0

    def start(self, t0: float, sampler: Sampler) -> None:
        self.t0, self.sampler = t0, sampler
        self._thread.start()

    def _run(self) -> None:
        kills = 0
        for event in schedule(self.spec):
            if time.monotonic() > self.t0 + self.spec.duration_s:
                return  # overdue after a long engine restart, and the run is over
            if self._stop.wait(max(0.0, self.t0 + event.t_s - time.monotonic())):
                return
            started = time.monotonic()
            try:
                detail = self._do(event.kind, kills)
            except Exception as exc:  # recorded; the run goes on
                self.errors.append(f"{event.kind} at {event.t_s:.0f} s: {exc!r}")
                continue
            kills += event.kind == "server_kill"
            took = time.monotonic() - started
            self.events.append(Event(started - self.t0, event.kind, took, detail))

    def _do(self, kind: str, kills: int) -> str:
        if kind == "server_kill":
            if self.sampler is not None:
                self.sampler.sample()
            corrupt = self.spec.corrupt and kills % 2 == 1
            return self.cache.kill(self.spec.down_s, corrupt)
        if kind == "corrupt_live":
            return self.cache.corrupt_segments()
        self.engine.restart()
        return f"ready in {self.engine.server.ready_s:.1f} s"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def count(self, kind: str) -> int:
        return sum(1 for e in self.events if e.kind == kind)


# --- agents -------------------------------------------------------------------------------------


class Reply(NamedTuple):
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int
    top: tuple[dict[int, float], ...] = ()

    def judged(self) -> Judged:
        return Judged(self.token_ids, self.logprobs, self.top)


class Result(NamedTuple):
    t_s: float
    agent: int
    turn: int
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    wrong: bool
    logprob_diff: float
    tokens_compared: int = 0
    tie_broken: bool = False


@dataclass
class Tally:
    """What the agents saw; mutated only on the event loop's thread."""

    results: list[Result] = field(default_factory=list)
    failed: int = 0
    lost_to_engine_restart: int = 0
    errors: list[str] = field(default_factory=list)


def chat_body(turn: Turn, salt: str | None = None) -> dict[str, Any]:
    """A greedy chat request that returns its output as token ids with logprobs."""
    body: dict[str, Any] = {
        "model": "kvkeep-tiny",
        "messages": turn.messages,
        "tools": turn.tools,
        "max_tokens": turn.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": TOP_ALTERNATIVES,  # the criterion tells a tie from a wrong token
        "return_tokens_as_token_ids": True,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


async def ask(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Reply:
    """POST one chat request; raises httpx.HTTPError on any transport or HTTP error."""
    r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    doc = r.json()
    content = doc["choices"][0]["logprobs"]["content"]
    usage = doc["usage"]
    return Reply(
        tuple(_token_id(c["token"]) for c in content),
        tuple(float(c["logprob"]) for c in content),
        int(usage["prompt_tokens"]),
        int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        tuple(
            {_token_id(t["token"]): float(t["logprob"]) for t in c.get("top_logprobs") or ()}
            for c in content
        ),
    )


def _token_id(text: str) -> int:
    return int(text.removeprefix("token_id:"))


async def references(url: str, sessions: Sequence[Sequence[Turn]]) -> dict[tuple[int, int], Reply]:
    """The no-cache reply of every distinct prompt: a fresh random cache_salt per request
    roots its block hashes in vLLM and in kvkeep where nothing is cached."""
    out: dict[tuple[int, int], Reply] = {}
    gate = asyncio.Semaphore(2)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:

        async def one(agent: int, turn: Turn) -> None:
            async with gate:
                body = chat_body(turn, salt=f"soak-ref-{uuid.uuid4().hex}")
                out[(agent, turn.index)] = await ask(client, url, body)

        await asyncio.gather(*(one(a, t) for a, turns in enumerate(sessions) for t in turns))
    return out


async def run_agents(
    engine: Engine,
    sessions: Sequence[Sequence[Turn]],
    refs: dict[tuple[int, int], Reply],
    until: float,
    t0: float,
) -> Tally:
    """Every agent replays its session in a loop until ``until`` (monotonic)."""
    tally = Tally()
    limits = httpx.Limits(max_connections=len(sessions) * 2)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:

        async def agent(a: int, turns: Sequence[Turn]) -> None:
            i = 0
            while time.monotonic() < until:
                turn = turns[i % len(turns)]
                await _turn(client, engine, a, turn, refs[(a, turn.index)], tally, t0)
                i += 1

        await asyncio.gather(*(agent(a, t) for a, t in enumerate(sessions)))
    return tally


async def _turn(
    client: httpx.AsyncClient,
    engine: Engine,
    agent: int,
    turn: Turn,
    ref: Reply,
    tally: Tally,
    t0: float,
) -> None:
    """One turn, retried after an engine restart cut it; a failure of any other kind is
    counted in ``tally.failed`` (and retried too, so the agent moves on)."""
    for _ in range(5):
        url, generation = await asyncio.to_thread(engine.current)
        start = time.monotonic()
        try:
            reply = await ask(client, url, chat_body(turn))
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            if engine.generation != generation or not engine._ready.is_set():
                tally.lost_to_engine_restart += 1
            else:
                tally.failed += 1
                tally.errors.append(f"agent {agent} turn {turn.index}: {exc!r}"[:300])
                await asyncio.sleep(1.0)
            continue
        if engine.generation != generation:
            # vLLM's shutdown aborts requests in flight, and may answer them with 200 and a
            # truncated output: a reply that spans a restart is the restart's, not kvkeep's
            tally.lost_to_engine_restart += 1
            continue
        verdict = same_as_cold(reply.judged(), ref.judged())
        if not verdict:
            tally.errors.append(f"agent {agent} turn {turn.index} at {start - t0:.1f} s: "
                                f"{verdict.why}: {reply.token_ids} vs reference "
                                f"{ref.token_ids}")  # fmt: skip
        tally.results.append(_result(start - t0, agent, turn.index, reply, verdict, start))
        return


def _result(
    t_s: float, agent: int, turn: int, reply: Reply, verdict: Verdict, start: float
) -> Result:
    return Result(
        t_s,
        agent,
        turn,
        time.monotonic() - start,
        reply.prompt_tokens,
        reply.cached_tokens,
        not verdict.ok,
        verdict.worst,
        verdict.compared,
        verdict.ok and bool(verdict.why),
    )


# --- the run --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakSetup:
    model: Path
    log_dir: Path
    reserved_cpus: int = 0


def run(spec: SoakSpec, setup: SoakSetup) -> dict[str, Any]:
    """The whole soak; owns (and always stops) every process it starts."""
    spec.validate()
    directory = Path(tempfile.mkdtemp(prefix="kvkeep-soak-"))
    cache = CacheUnderTest(spec, directory, spec.seed)
    engine: Engine | None = None
    try:
        cache.start()
        engine = Engine(_launch_config(spec, setup, cache.socket))
        return _soak(spec, setup, cache, engine)
    finally:
        if engine is not None:
            engine.stop()
        cache.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _launch_config(spec: SoakSpec, setup: SoakSetup, socket_path: str) -> LaunchConfig:
    return LaunchConfig(
        model=setup.model,
        mode="kvkeep",
        num_blocks=spec.num_blocks,
        max_model_len=spec.max_model_len,
        reserved_cpus=setup.reserved_cpus,
        log_dir=setup.log_dir,
        cache_socket=socket_path,
    )


def _soak(
    spec: SoakSpec, setup: SoakSetup, cache: CacheUnderTest, engine: Engine
) -> dict[str, Any]:
    session = SessionSpec(turns=spec.turns, scale=spec.scale,
                          max_output_tokens=spec.max_output_tokens, seed=spec.seed)  # fmt: skip
    sessions = generate_sessions(session, HFTokenizer(setup.model), spec.agents)
    print(f"soak: {sum(map(len, sessions))} reference replies, no cache", file=sys.stderr)
    t_ref = time.monotonic()
    refs = asyncio.run(references(engine.server.url, sessions))
    ref_s = time.monotonic() - t_ref
    print(f"soak: {spec.minutes} min of agents and faults", file=sys.stderr)
    t0 = time.monotonic()
    sampler = Sampler(cache, engine, spec.sample_every_s, t0)
    faults = Faults(spec, cache, engine)
    sampler.start()
    faults.start(t0, sampler)
    try:
        tally = asyncio.run(run_agents(engine, sessions, refs, t0 + spec.duration_s, t0))
    finally:
        faults.stop()
        sampler.stop()
    out = summarize(spec, tally, faults, sampler.samples, cache)
    out["reference_s"] = ref_s
    out["wall_s"] = time.monotonic() - t0
    return out


def summarize(
    spec: SoakSpec,
    tally: Tally,
    faults: Faults,
    samples: Sequence[Sample],
    cache: CacheUnderTest,
) -> dict[str, Any]:
    """The JSON document of a run."""
    results = tally.results
    last = samples[-1] if samples else None
    diffs = [r.logprob_diff for r in results]
    return {
        "scenario": "soak",
        "spec": asdict(spec),
        "requests": len(results),
        "failed_requests": tally.failed,
        "requests_lost_to_engine_restart": tally.lost_to_engine_restart,
        "wrong_outputs": sum(r.wrong for r in results),
        "replies_compared": len(results),
        "tokens_compared": sum(r.tokens_compared for r in results),
        "ties_broken": sum(r.tie_broken for r in results),
        "drift_tolerance": DRIFT_TOL,
        "max_logprob_diff": max(diffs, default=0.0),
        "server_kills": faults.count("server_kill"),
        "engine_restarts": faults.count("engine_restart"),
        "live_corruptions": faults.count("corrupt_live"),
        "bytes_flipped": cache.flipped,
        "disk_checksum_failures": last.disk_checksum_failures if last else 0,
        "kvkeep_hit_blocks": last.kvkeep_hit_blocks if last else 0,
        "kvkeep_loaded_tokens": last.loaded_tokens if last else 0,
        "kvkeep_load_failed_tokens": last.load_failed_tokens if last else 0,
        "cached_fraction": _fraction(results),
        "latency_p50_s": _pct(results, 0.5),
        "latency_p99_s": _pct(results, 0.99),
        "hit_rate_over_time": hit_windows(results, samples, spec.duration_s),
        "rss_over_time": [
            {"t_s": round(s.t_s, 1), "server_mb": s.server_mb, "vllm_mb": s.vllm_mb}
            for s in samples
        ],
        "rss_growth_mb": rss_growth(samples),
        "events": [e._asdict() for e in faults.events],
        "fault_errors": faults.errors,
        "errors": tally.errors[:20],
    }


def _fraction(results: Sequence[Result]) -> float:
    prompt = sum(r.prompt_tokens for r in results)
    return sum(r.cached_tokens for r in results) / prompt if prompt else 0.0


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
                "kvkeep_hit_blocks": _delta(samples, lo, hi),
            }
        )
    return out


def _delta(samples: Sequence[Sample], lo: float, hi: float) -> float:
    inside = [s.kvkeep_hit_blocks for s in samples if lo <= s.t_s < hi]
    before = [s.kvkeep_hit_blocks for s in samples if s.t_s < lo]
    if not inside:
        return 0.0
    return inside[-1] - (before[-1] if before else 0.0)


def rss_growth(samples: Sequence[Sample]) -> dict[str, float | None]:
    """Per process: the largest growth of private RSS within one lifetime (a cache server
    pid, a vLLM generation), as the mean of its last third minus that of its middle third
    (the first third is warm-up). None where no lifetime has 6 samples."""
    out: dict[str, float | None] = {}
    for name, life in (("server_mb", "server_pid"), ("vllm_mb", "engine_generation")):
        lives: dict[object, list[float]] = {}
        for s in samples:
            value = getattr(s, name)
            if value:
                lives.setdefault(getattr(s, life), []).append(value)
        growths = [_growth(v) for v in lives.values() if len(v) >= 6]
        out[name] = round(max(growths), 1) if growths else None
    return out


def _growth(values: Sequence[float]) -> float:
    third = len(values) // 3
    return statistics.fmean(values[2 * third :]) - statistics.fmean(values[third : 2 * third])


# --- output ---------------------------------------------------------------------------------------


def table(doc: dict[str, Any]) -> str:
    """The run's figures as a plain-text table."""
    keys = ("requests", "failed_requests", "requests_lost_to_engine_restart", "wrong_outputs",
            "replies_compared", "ties_broken", "max_logprob_diff", "server_kills",
            "engine_restarts",
            "live_corruptions", "bytes_flipped", "disk_checksum_failures", "kvkeep_hit_blocks",
            "kvkeep_loaded_tokens", "kvkeep_load_failed_tokens", "cached_fraction",
            "latency_p50_s", "latency_p99_s", "rss_growth_mb")  # fmt: skip
    lines = [f"{k:34} {_fmt(doc[k])}" for k in keys]
    lines.append("")
    lines.append(f"{'t (s)':>8} {'requests':>9} {'cached':>8} {'kvkeep blocks':>14}")
    for w in doc["hit_rate_over_time"]:
        lines.append(f"{w['t_s']:8.0f} {w['requests']:9d} {w['cached_fraction']:8.3f} "
                     f"{w['kvkeep_hit_blocks']:14.0f}")  # fmt: skip
    lines.append("")
    lines.append(f"{'t (s)':>8} {'server MB':>10} {'vLLM MB':>10}")
    for s in doc["rss_over_time"][:: max(1, len(doc["rss_over_time"]) // 12)]:
        lines.append(f"{s['t_s']:8.0f} {_fmt(s['server_mb']):>10} {_fmt(s['vllm_mb']):>10}")
    lines.append("")
    for e in doc["events"]:
        lines.append(f"  {e['t_s']:7.1f} s  {e['kind']:15} {e['took_s']:5.1f} s  {e['detail']}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    return str(v)


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """Hit rate and RSS over time with the faults marked; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    hits = doc["hit_rate_over_time"]
    top.plot([w["t_s"] for w in hits], [w["cached_fraction"] for w in hits], marker="o")
    top.set_ylabel("cached fraction of prompt")
    rss = doc["rss_over_time"]
    for name in ("server_mb", "vllm_mb"):
        bottom.plot([s["t_s"] for s in rss], [s[name] or float("nan") for s in rss], label=name)
    bottom.set_ylabel("private RSS (MB)")
    bottom.set_xlabel("seconds")
    bottom.legend()
    colours = {"server_kill": "red", "engine_restart": "black", "corrupt_live": "orange"}
    for e in doc["events"]:
        for ax in (top, bottom):
            ax.axvline(e["t_s"], color=colours.get(e["kind"], "grey"), alpha=0.4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    d = SoakSpec()
    p = argparse.ArgumentParser(prog="kvkeep bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--json", type=Path, help="write the results here (a PNG goes beside it)")
    p.add_argument("--model", type=Path, default=Path(".cache/tiny-model"))
    p.add_argument("--log-dir", type=Path, default=Path(".cache/logs"))
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--scale", type=float, default=d.scale)
    p.add_argument("--kill-every", type=float, help="seconds between cache-server SIGKILLs")
    p.add_argument("--restart-every", type=float, help="seconds between vLLM restarts")
    p.add_argument(
        "--down", type=float, default=d.down_s, help="seconds a killed server stays down"
    )
    p.add_argument("--no-corrupt", action="store_true", help="kill only; flip no disk bytes")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="vLLM's device pool")
    p.add_argument("--reserved-cpus", type=int, default=0)
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def main(argv: list[str]) -> int:
    """`kvkeep bench soak` (argv[0] is "soak"). Exit 1 if a request failed or an output was
    wrong, 2 on bad arguments."""
    args = parser().parse_args(argv[1:])
    spec = SoakSpec(minutes=args.minutes, agents=args.agents, turns=args.turns, scale=args.scale,
                    kill_every_s=args.kill_every, restart_every_s=args.restart_every,
                    down_s=args.down, corrupt=not args.no_corrupt, num_blocks=args.num_blocks,
                    seed=args.seed)  # fmt: skip
    try:
        spec.validate()
        doc = run(spec, SoakSetup(args.model, args.log_dir, args.reserved_cpus))
    except ValueError as exc:
        print(f"kvkeep bench soak: {exc}", file=sys.stderr)
        return 2
    from kvkeep.bench.environment import environment

    doc["environment"] = environment(args.model)
    print(table(doc))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        png = plot(doc, args.json.with_suffix(".png"))
        print(f"JSON written to {args.json}" + (f", plot {png}" if png else ""), file=sys.stderr)
    return 0 if doc["failed_requests"] == 0 and doc["wrong_outputs"] == 0 else 1
