"""`bench soak`'s faults and what watches them: the schedule (`schedule`), the thread that
kills the cache server, corrupts its disk and restarts vLLM, then strikes again as the new
vLLM serves its first kvkeep load (`Faults`), and the thread that
samples counters and memory meanwhile (`Sampler`), each run by `background`, with counters
that survive the restarts (`Monotonic`) and the growth of memory within a process's lifetime
(`rss_growth`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx
import psutil

from kvkeep.bench.deploy.cache import CacheServer
from kvkeep.bench.deploy.rpcproxy import RpcProxy
from kvkeep.bench.deploy.vllm import VLLMServer
from kvkeep.bench.metrics import GUARD_EVENTS, kvkeep_events, kvkeep_tokens, scrape

READY_FAULT_WAIT_S = 60.0  # after a restart, how long an armed fault waits for an ACQUIRE


@dataclass(frozen=True)
class SoakSpec:
    """One soak run. Fault intervals default to fractions of the run: with ``minutes=10``
    the cache server is killed 6 times and vLLM restarted 3 times.

    ``ready_faults``: each vLLM restart arms a fault for the new engine's first ACQUIRE,
    between the LOOKUP that promised blocks and the load that reads them, while every agent
    retries its turn into an empty device cache over a shared system prompt (the moment a
    failed synchronous load's blocks are most likely to be shared): a server SIGKILL, and a
    byte flipped in the slot just handed out, in turn."""

    minutes: float = 10.0
    agents: int = 8
    turns: int = 6
    scale: float = 0.02
    max_output_tokens: int = 8
    kill_every_s: float | None = None
    restart_every_s: float | None = None
    down_s: float = 2.0
    corrupt: bool = True
    ready_faults: bool = True
    sample_every_s: float = 5.0
    cache_ram: str = "256MiB"
    cache_disk: str = "1GiB"
    num_blocks: int = 96  # a small device pool, so kvkeep serves what vLLM evicted
    max_model_len: int = 4096
    seed: int = 0

    @property
    def duration_s(self) -> float:
        return self.minutes * 60

    @property
    def kill_interval_s(self) -> float:
        return self.kill_every_s or self.duration_s / 6.5

    @property
    def restart_interval_s(self) -> float:
        return self.restart_every_s or self.duration_s / 4

    def __post_init__(self) -> None:
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
    kind: str  # server_kill | engine_restart | corrupt_live | ready_kill | ready_corrupt |
    # ready_missed | skipped (see `Faults.run`)
    took_s: float = 0.0
    detail: str = ""


def schedule(spec: SoakSpec) -> list[Event]:
    """The faults of a run, in time order. Pure.

    Kills fall every ``kill_interval_s``, engine restarts every ``restart_interval_s`` (a
    kill that would land within 10 s of a restart moves 10 s later, unless that brings it
    within half an interval of the next kill, which then stands for both), and with
    ``corrupt`` a live corruption half-way after every other kill."""
    end = spec.duration_s
    restarts = _ticks(spec.restart_interval_s, end)
    kills: list[float] = []
    for t in sorted(_avoid(t, restarts) for t in _ticks(spec.kill_interval_s, end)):
        if not kills or t - kills[-1] >= spec.kill_interval_s / 2:
            kills.append(t)
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
    """Hits and checksum failures, each summed over the RAM and disk tiers ({} while down)."""
    if not stats:
        return {}
    tiers = [stats.get("tiers", {}).get(tier, {}) for tier in ("ram", "disk")]
    return {
        name: float(sum(t.get(name, 0) for t in tiers)) for name in ("hits", "checksum_failures")
    }


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
    guard: dict[str, float]  # GUARD_EVENTS, summed over vLLM's lifetimes


@contextlib.contextmanager
def background(name: str, loop: Callable[[threading.Event], object]) -> Iterator[None]:
    """``loop(stop)`` on a daemon thread while the block runs; on leaving, ``stop`` is set and
    the thread joined."""
    stop = threading.Event()
    thread = threading.Thread(target=loop, args=(stop,), name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Sampler:
    """Samples memory and counters every ``every_s`` (``loop``, in `background`)."""

    def __init__(self, cache: CacheServer, engine: VLLMServer, every_s: float, t0: float) -> None:
        self.cache, self.engine, self.every_s, self.t0 = cache, engine, every_s, t0
        self.totals = Monotonic()  # the server's counters and vLLM's kvkeep_tokens
        self.samples: list[Sample] = []
        self._lock = threading.Lock()

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.every_s):
            self.sample()

    def sample(self, metrics_timeout_s: float = 3.0) -> None:
        """Read counters and memory now (thread-safe; the fault thread calls it before a
        kill so no counts are lost with the process)."""
        with self._lock:
            self.totals.see(server_counters(self.cache.stats()))
            with contextlib.suppress(httpx.HTTPError):
                # One page, and a short wait: vLLM's API server stalled for 27 s once under
                # the agents' load on 2 cores, and the fault thread samples before each kill
                # (a page missed there loses nothing: vLLM's counters outlive a server kill).
                page = scrape(self.engine.url, timeout_s=metrics_timeout_s)
                self.totals.see(kvkeep_tokens(self.engine.url, page=page))
                self.totals.see(kvkeep_events(self.engine.url, page=page))
            total = self.totals.total
            self.samples.append(
                Sample(
                    time.monotonic() - self.t0,
                    self.cache.pid,
                    self.engine.generation,
                    private_rss_mb(self.cache.pid, tree=False),
                    private_rss_mb(self.engine.pid, tree=True),
                    total("hits"),
                    total("checksum_failures"),
                    total("loaded"),
                    total("load_failed"),
                    {op: total(op) for op in GUARD_EVENTS},
                )
            )


class Faults:
    """Runs the schedule (``run``, in `background`); ``events`` records what was done and
    how long."""

    def __init__(
        self,
        spec: SoakSpec,
        cache: CacheServer,
        engine: VLLMServer,
        sampler: Sampler,
        proxy: RpcProxy | None = None,
    ) -> None:
        """``proxy``: between the cache server and vLLM from its first restart on, for the
        ready faults (``spec.ready_faults``)."""
        self.spec, self.cache, self.engine, self.sampler = spec, cache, engine, sampler
        self.proxy = proxy
        self._fired, self._struck = threading.Event(), ""  # the armed ready fault
        self.t0 = sampler.t0
        self.rng = random.Random(spec.seed)
        self.flipped = 0
        self.events: list[Event] = []
        self.errors: list[str] = []

    def run(self, stop: threading.Event) -> None:
        kills = restarts = 0
        for event in schedule(self.spec):
            late_s = time.monotonic() - (self.t0 + event.t_s)
            if time.monotonic() > self.t0 + self.spec.duration_s:
                return  # overdue after a long engine restart, and the run is over
            if late_s > self.spec.kill_interval_s / 2 and event.kind != "engine_restart":
                # It fell due while a long fault ran: fired now, the kills missed would come
                # back to back on an engine that has just started. An engine restart is never
                # dropped for being late (its ready fault is the moment that hurts most); it
                # fires late, unless it would come up after the run (below).
                why = f"{event.kind} due at {event.t_s:.0f} s fell due during another fault"
                self.events.append(Event(event.t_s, "skipped", 0.0, why))
                continue
            if stop.wait(max(0.0, -late_s)):
                return
            left_s = self.t0 + self.spec.duration_s - time.monotonic()
            last_start_s = self.engine.ready_s
            if event.kind == "engine_restart" and last_start_s and left_s < last_start_s + 5:
                # the new engine would come up as the agents stop: nothing would be measured
                why = f"engine_restart due at {event.t_s:.0f} s would end after the run"
                self.events.append(Event(event.t_s, "skipped", 0.0, why))
                continue
            started = time.monotonic()
            try:
                detail = self._do(event.kind, kills)
                took = time.monotonic() - started
                self.events.append(Event(started - self.t0, event.kind, took, detail))
                if event.kind == "engine_restart" and self.spec.ready_faults and self.proxy:
                    self.events.append(self._ready_fault(restarts, stop))
            except Exception as exc:  # recorded; the run goes on
                self.errors.append(f"{event.kind} at {event.t_s:.0f} s: {exc!r}")
                continue
            kills += event.kind == "server_kill"
            restarts += event.kind == "engine_restart"

    def _do(self, kind: str, kills: int) -> str:
        """Do one fault; returns what it did. A kill is a SIGKILL, ``down_s`` down (flipping
        disk bytes meanwhile on every other kill, with ``corrupt``), and a restart."""
        if kind == "corrupt_live":
            return self._corrupt()
        if kind == "engine_restart":
            self.sampler.sample(metrics_timeout_s=30.0)  # the counts the old engine will lose
            # In-flight requests keep uvicorn waiting for their connections until the engine
            # is killed: a graceful stop would only add its timeout to the restart.
            self.engine.restart(stop_timeout_s=5.0, before_start=self._arm_ready_fault)
            return f"ready in {self.engine.ready_s:.1f} s"
        self.sampler.sample()  # the counts the kill is about to lose
        self.cache.kill()
        detail = self._corrupt() if self.spec.corrupt and kills % 2 == 1 else ""
        time.sleep(self.spec.down_s)
        started = time.monotonic()
        self.cache.start()
        start_s = time.monotonic() - started
        if start_s > 5.0:  # said, so a slow start-up (a disk rebuild, a loaded host) is seen
            detail = f"{detail}; server took {start_s:.1f} s to listen again".lstrip("; ")
        return detail

    def _arm_ready_fault(self) -> None:
        """With the old engine gone and the new one not started: route the new one through
        the proxy and arm its first ACQUIRE (a kill on even restarts, a flipped slot on odd)."""
        if not (self.spec.ready_faults and self.proxy):
            return
        self._fired = threading.Event()
        self._struck = ""
        self.engine.cfg = dataclasses.replace(self.engine.cfg, cache_socket=self.proxy.listen_path)
        if self.count("engine_restart") % 2 == 0:
            self.proxy.arm("ACQUIRE", self._kill_now)
        else:
            self.proxy.arm_reply("ACQUIRE", self._flip_acquired)

    def _kill_now(self) -> None:
        """On the proxy's thread, holding the ACQUIRE: SIGKILL the server; the ACQUIRE then
        meets a closed connection."""
        self.cache.kill()
        self._struck = "server SIGKILLed before the first ACQUIRE"
        self._fired.set()

    def _flip_acquired(self, result: dict[str, Any]) -> None:
        """On the proxy's thread, holding the ACQUIRE's reply: flip a byte of its first slot
        (pinned for this load, its checksum already given)."""
        slots, path = result.get("slots") or [], self.proxy.arena_path if self.proxy else None
        if slots and path:
            with contextlib.suppress(OSError), open(path, "r+b") as f:
                f.seek(int(slots[0][0]) + 17)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
                self.flipped += 1
                self._struck = f"a byte flipped in the first of {len(slots)} slots acquired"
        self._fired.set()

    def _ready_fault(self, restart: int, stop: threading.Event) -> Event:
        """Wait for the fault armed before the restart to strike; a killed server is started
        again after ``down_s``. An ACQUIRE that never came (or the run ended first) is
        ``ready_missed``."""
        started = time.monotonic()
        kind = "ready_kill" if restart % 2 == 0 else "ready_corrupt"
        deadline = started + READY_FAULT_WAIT_S
        while not self._fired.wait(0.2) and not stop.is_set() and time.monotonic() < deadline:
            pass
        if not self._fired.is_set() or not self._struck:
            assert self.proxy is not None
            self.proxy.disarm()
            why = f"{kind}: no ACQUIRE with a slot within {READY_FAULT_WAIT_S:.0f} s"
            return Event(started - self.t0, "ready_missed", 0.0, why)
        if kind == "ready_kill":
            time.sleep(self.spec.down_s)
            self.cache.start()
        return Event(started - self.t0, kind, time.monotonic() - started, self._struck)

    def _corrupt(self, flips: int = 8) -> str:
        """Flip one byte at each of ``flips`` random places in the cache server's disk segment
        logs (in place: a running server reads the same inode), counted in ``flipped``.
        Returns what it did."""
        logs = sorted((self.cache.directory / "disk").glob("seg-*.log"))
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

    def count(self, kind: str) -> int:
        return sum(1 for e in self.events if e.kind == kind)


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
