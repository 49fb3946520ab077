"""RunContext: what a scenario gets to measure one mode; `Needs`, what it asks for; `Setup`, a
run's deployment settings; and `deployment`, which builds the first from the others."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvkeep.bench.deploy import exit_on_sigterm
from kvkeep.bench.deploy.cache import CacheServer, CacheSpec, shared_store
from kvkeep.bench.deploy.vllm import LaunchConfig, VLLMServer
from kvkeep.bench.metrics import Probe
from kvkeep.bench.turns import Turnstile


@dataclass(frozen=True)
class Needs:
    """What the mode loop must deploy for a scenario.

    - ``engine``: vLLM at all (`store` measures the cache server alone);
    - ``modes``: the only modes it means anything in (None: every mode asked for); in the
      others its result is ``{}``, which the report shows as "not run";
    - ``own_engine``: it restarts or kills what it runs on, so `--endpoint` cannot serve it;
    - ``replicas`` vLLMs, each with its own cache server, on a ``shared_store`` if asked;
    - ``tokens``: the longest prompt plus output; ``num_blocks``,
      ``max_num_batched_tokens`` and ``scheduling`` override the run's vLLM settings;
    - ``turns``: its run marks its units with ``ctx.turn()``/``ctx.aturn()``, so modes run
      side by side take turns unit by unit; otherwise its whole run is one unit.
    """

    engine: bool = True
    modes: tuple[str, ...] | None = None
    own_engine: bool = False
    replicas: int = 1
    shared_store: bool = False
    tokens: int = 0
    num_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    scheduling: str | None = None  # `LaunchConfig.scheduling`
    turns: bool = False  # it marks its units with ctx.turn() (kvkeep.bench.turns)


@dataclass(frozen=True)
class Setup:
    """A run's deployment settings, the same for every scenario and mode: vLLM's (the mode is
    set per deployment), the cache server's, an endpoint to measure instead of launching, a
    shared store's URL (None: a private redis-server where a scenario needs one), and whether
    the modes' deployments are up at once, taking turns per scenario (`suite.run_modes`)."""

    base: LaunchConfig
    cache: CacheSpec = field(default_factory=CacheSpec)
    endpoint: str | None = None
    store: str | None = None
    together: bool = False


@dataclass
class RunContext:
    """One mode's deployment. ``engines[i]`` runs on ``caches[i]`` (mode kvkeep only)."""

    mode: str
    model: Path
    engines: list[VLLMServer] = field(default_factory=list)
    caches: list[CacheServer] = field(default_factory=list)
    endpoint: str | None = None
    turnstile: Turnstile | None = None  # modes taking turns (kvkeep.bench.turns)

    def turn(self) -> contextlib.AbstractContextManager[None]:
        """One unit of the scenario: this mode's turn among the modes taking turns (a quiet
        machine awaited first); nothing where the mode runs alone."""
        if self.turnstile is None:
            return contextlib.nullcontext()
        return self.turnstile.turn(self.mode)

    @contextlib.asynccontextmanager
    async def aturn(self) -> AsyncIterator[None]:
        """`turn` for a coroutine: the wait runs on a thread, not on the event loop."""
        if self.turnstile is None:
            yield
            return
        await asyncio.to_thread(self.turnstile.acquire, self.mode)
        try:
            yield
        finally:
            self.turnstile.release(self.mode)

    @property
    def url(self) -> str:
        """The (first) server's URL now; it changes when the engine restarts."""
        return self.endpoint or self.engine.url

    @property
    def urls(self) -> list[str]:
        return [self.endpoint] if self.endpoint else [e.url for e in self.engines]

    @property
    def engine(self) -> VLLMServer:
        if not self.engines:
            raise RuntimeError("this scenario needs a vLLM it launches; --endpoint cannot serve")
        return self.engines[0]

    @property
    def cache(self) -> CacheServer:
        """The (first) cache server; raises RuntimeError outside mode kvkeep."""
        if not self.caches:
            raise RuntimeError(f"this needs a kvkeep cache server; mode {self.mode} has none")
        return self.caches[0]

    def probe(self, replica: int = 0) -> Probe:
        """Counters of one replica, following its engine across restarts."""
        if self.endpoint:
            return Probe(self.endpoint)
        engine = self.engines[replica]
        cache = self.caches[replica] if self.caches else None
        return Probe(lambda: engine.url, cache.stats if cache else None)


@contextlib.contextmanager
def deployment(mode: str, cfg: LaunchConfig, needs: Needs, setup: Setup) -> Iterator[RunContext]:
    """A ready RunContext for ``needs`` in ``mode``: a shared store if asked, in mode kvkeep one
    cache server per replica, and the vLLM replicas (from ``cfg``, started in parallel); with
    ``setup.endpoint`` (or no engine needed) nothing, the context holding only the URL.
    Everything is stopped on exit. Raises LaunchError (or RuntimeError from a cache server) if
    something won't start."""
    if setup.endpoint or not needs.engine:
        yield RunContext(mode, cfg.model, endpoint=setup.endpoint)
        return
    exit_on_sigterm()  # from the main thread: the engines may start on others
    with contextlib.ExitStack() as stack:
        store = None
        if needs.shared_store and mode == "kvkeep":
            store = stack.enter_context(shared_store(setup.store))
        caches: list[CacheServer] = []
        for i in range(needs.replicas if mode == "kvkeep" else 0):
            caches.append(stack.enter_context(CacheServer(setup.cache, store, f"replica{i}")))
        sockets: list[str | None] = [c.socket for c in caches] or [None] * needs.replicas
        # Replicas share the machine's cores and serve at once: the engine-core binding
        # (kvkeep.host.placement) is measured for one engine at a time. Two engines bound alike
        # slowed one's prefills 4-9x when their requests alternated 0.3 s apart: each engine
        # polls for 1 s after its last step, on the core of the other's forward thread.
        bind = cfg.bind_scheduler and len(sockets) == 1
        engines = [
            VLLMServer(replace(cfg, mode=mode, cache_socket=s, bind_scheduler=bind))
            for s in sockets
        ]
        for engine in engines:
            stack.callback(engine.stop)
        if len(engines) == 1:
            engines[0].start()
        else:  # in parallel: each start is ~25 s of waiting
            with ThreadPoolExecutor(len(engines)) as pool:
                for future in [pool.submit(e.start) for e in engines]:
                    future.result()
        yield RunContext(mode, cfg.model, engines, caches)
