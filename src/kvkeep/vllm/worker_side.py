"""The connector's worker side: copies between the engine's KV blocks and arena slots.

Synchronous loads run before the forward (ACQUIRE, verify, copy in, RELEASE); asynchronous
ones on a background thread, reported through ``finished_loads`` (:mod:`kvkeep.vllm.loader`).
Saves copy out after the forward into staging memory and are stored by a background thread
(:mod:`kvkeep.vllm.saver`); a step with a failed synchronous load saves nothing. See
:mod:`kvkeep.vllm.connector` for the whole flow.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvkeep.host.background import start_thread, unbind
from kvkeep.keys import BlockKey
from kvkeep.server.client import CacheUnavailable, KVKeepClient, Session, SlotRef
from kvkeep.vllm import compat, cuda
from kvkeep.vllm.counters import Counters, timed
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.loader import BackgroundLoads, BlockLoader, LoadResult, result_of
from kvkeep.vllm.mover import Mover
from kvkeep.vllm.plan import RequestLoad, StepPlan
from kvkeep.vllm.saver import Saver, staging_shape

log = logging.getLogger("vllm.kvkeep")
SUMMARY_EVERY_S = 10.0

WINDOW_COUNTED = frozenset({"loaded_tokens", "load_failed_tokens", "saved_tokens"})
AUDIT_DRIFT = 0.1  # largest element difference of two valid copies of a block (audit only)


def block_difference(stored: np.ndarray, engine: np.ndarray, dtype: Any) -> float:
    """The largest absolute difference between two copies of a block, as numbers of the KV
    dtype (0.0 when the bytes are identical; inf when either holds a non-finite value)."""
    import torch

    if np.array_equal(stored, engine):
        return 0.0
    a = torch.frombuffer(bytearray(stored.tobytes()), dtype=dtype).float()
    b = torch.frombuffer(bytearray(engine.tobytes()), dtype=dtype).float()
    worst = (a - b).abs().max().item()
    return float(worst) if np.isfinite(worst) else float("inf")


class WorkerSide:
    """Copies between the engine's KV blocks and arena slots, for KV cache group ``group``.
    Loads are synchronous and run before the forward, or asynchronous; saves copy out on
    the step and are stored in the background.

    ``client`` serves loads (on the step); saves use a second connection of their own
    (``client.sibling()``), so a step's ACQUIRE never queues behind a background COMMIT."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        client: KVKeepClient,
        audit: bool = False,
        staging_bytes: int | None = None,
        group: int = 0,
    ) -> None:
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.group = group
        self.windows = compat.group_windows(kv_cache_config)
        self.states = compat.group_states(kv_cache_config, len(self.windows))
        self.state = self.states[group] if group < len(self.states) else False
        self.client = client
        self.audit = audit
        self.staging_bytes = staging_bytes
        self.saver: Saver | None = None
        self.loader: BlockLoader | None = None
        self.background: BackgroundLoads | None = None
        self._unstarted: list[LoadResult] = []
        self.mover = Mover()
        self.tp_rank, _ = compat.tp_rank_size(vllm_config)
        # An MLA latent is the same on every TP rank: one copy is kept, under rank 0's keys,
        # rank 0 saves it and every rank loads it. Other KV is a per-rank shard.
        self.replicated = compat.latent(kv_cache_config, group)
        self.key_rank = 0 if self.replicated else self.tp_rank
        self.saves = self.tp_rank == 0 or not self.replicated
        self.layout: KVLayout | None = None
        self.counters = Counters()
        self.totals = Counters()
        self._load_errors: set[int] = set()
        self._failed_this_step = False
        self._sessions: dict[bytes, Session] = {}
        self._last_summary = time.monotonic()

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Build the layout adapter; an unsupported layout raises here and stops start-up."""
        description = compat.layout_description(self.vllm_config, self.kv_cache_config, self.group)
        self.layout = KVLayout.build(description, kv_caches)
        self.mover = cuda.mover_for(self.layout)
        steps = compat.step_blocks(self.vllm_config, description.block_size)
        shape = staging_shape(steps, self.layout.block_bytes, self.staging_bytes)
        self.saver = Saver(
            self.client.sibling(), self.layout, self._count, self._timed, shape, self.mover
        )
        self.loader = BlockLoader(self.client, self.layout, self.mover, self._count, self._timed)
        background = BlockLoader(
            self.client.sibling(), self.layout, self.mover, self._count, self._timed
        )
        self.background = BackgroundLoads(background, self._count)
        log.info(
            "kvkeep: group %d: %d layers, %s pages of %d bytes (%s), %d-byte blocks, %s copies, "
            "staging %d x %d blocks",
            self.group,
            self.layout.num_layers,
            description.layout,
            self.layout.page_bytes,
            self.layout.dtype,
            self.layout.block_bytes,
            "fused" if self.layout.fused else "per-layer",
            *shape,
        )
        start_thread(self._connect_early, "kvkeep-connect")

    def _connect_early(self) -> None:
        """Map the cache server's arena while the engine starts, not on the first request
        (``kvkeep.server.arenamap`` populates it in the background). Never raises: with the
        server down, loads and saves find out for themselves. On a GPU the first load has it
        registered as pinned memory (``kvkeep.vllm.cuda.Pins``), not this: vLLM captures
        CUDA graphs after start-up, and CUDA refuses a registration meanwhile."""
        unbind()
        assert self.layout is not None
        ns = compat.namespace(self.vllm_config, self.kv_cache_config, self.group)
        if self.key_rank:
            ns = replace(ns, tp_rank=self.key_rank)
        label = compat.group_label(f"worker{self.tp_rank}", self.group, self.windows, self.states)
        try:
            self.client.hello(ns, self.layout.block_bytes, label)
        except Exception as exc:
            log.debug("kvkeep: no cache server at start-up (%s); connecting on first use", exc)

    def _session(self, plan: StepPlan) -> Session:
        assert self.layout is not None
        digest = plan.namespace.digest()
        if digest not in self._sessions:
            ns = plan.namespace
            if self.key_rank:
                ns = replace(ns, tp_rank=self.key_rank)
            label = compat.group_label(
                f"worker{self.tp_rank}", self.group, self.windows, self.states
            )
            self._sessions[digest] = self.client.session(ns, self.layout.block_bytes, label)
        return self._sessions[digest]

    # loads ---------------------------------------------------------------------------------

    def load(self, plan: StepPlan) -> None:
        """Fill every synchronous load's blocks now, or report them in the load errors; start
        the asynchronous ones (reported by ``finished_loads``). Never raises."""
        now = [r for r in plan.loads if not r.background]
        later = [r for r in plan.loads if r.background]
        if later:
            self._start_background(plan, later)
        if not now:
            return
        t0 = time.perf_counter()
        results = [result_of(r, self._load_now(plan, r)) for r in now]
        failed = self._note_results(results)
        self._failed_this_step = self._failed_this_step or failed > 0
        elapsed = time.perf_counter() - t0
        self._count("load_s", elapsed)
        log.info(
            "kvkeep: loaded %d blocks (%d failed) in %.1f ms",
            sum(r.loaded for r in results),
            failed,
            1e3 * elapsed,
        )
        self._maybe_summarize()

    def _load_now(self, plan: StepPlan, request: RequestLoad) -> int:
        if self.loader is None:
            return 0
        try:
            session = self._session(plan)
        except Exception:
            return 0
        return self.loader.load(session, request)

    def _start_background(self, plan: StepPlan, requests: list[RequestLoad]) -> None:
        """Queue asynchronous loads behind a fence on the engine's work so far. Without a
        loader (no KV cache registered) they end at once, failed, in the next report."""
        if self.background is None or self.layout is None:
            self._unstarted += [result_of(r, 0) for r in requests]
            return
        try:
            after = self.mover.fence()
            session = self._session(plan)
        except Exception:
            log.exception("kvkeep: could not start asynchronous loads; vLLM recomputes them")
            self._unstarted += [result_of(r, 0) for r in requests]
            return
        for request in requests:
            self.background.submit(session, request, after)

    def finished_loads(self) -> set[str] | None:
        """Requests whose asynchronous load ended since the last call (vLLM's
        ``finished_recving``); their failed blocks join this step's load errors, which vLLM
        reads in the same step. None when there are none. Never raises."""
        return {r.req_id for r in self.finished_results()} or None

    def finished_results(self) -> list[LoadResult]:
        """How the asynchronous loads that ended since the last call ended (each once), as
        ``finished_loads`` reports them. Never raises."""
        results, self._unstarted = self._unstarted, []
        if self.background is not None:
            results += self.background.take_finished()
        if not results:
            return []
        failed = self._note_results(results)
        self._count("async_loads_failed", sum(1 for r in results if r.failed))
        log.info(
            "kvkeep: %d asynchronous loads finished, %d blocks loaded (%d failed)",
            len(results),
            sum(r.loaded for r in results),
            failed,
        )
        return results

    def _note_results(self, results: Sequence[LoadResult]) -> int:
        """Count loads and record their failed blocks as load errors; the failed count."""
        block_size = self.layout.description.block_size if self.layout is not None else 0
        loaded = sum(r.loaded for r in results)
        failed = sum(len(r.failed) for r in results)
        for r in results:
            self._load_errors.update(r.failed)
        self._count("loaded_tokens", loaded * block_size)
        self._count("load_failed_tokens", failed * block_size)
        return failed

    def _release(self, slots: Sequence[SlotRef]) -> None:
        with contextlib.suppress(CacheUnavailable), self._timed("release_rpc_s"):
            self.client.release(slots)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # saves ---------------------------------------------------------------------------------

    def end_step(self, plan: StepPlan | None) -> None:
        """After the forward: save the plan's new blocks, unless a load of this step failed.
        Then the forward ran on top of blocks that hold no valid KV, so every block it
        computed may be wrong (vLLM recomputes them; the scheduler side re-plans the saves)."""
        failed, self._failed_this_step = self._failed_this_step, False
        if plan is None or not plan.saves:
            if self.saver is not None:
                self.saver.flush()  # prefills ended or paused: what waits is stored now
            return
        if failed:
            self._count("saves_dropped", len(plan.saves))
            log.info(
                "kvkeep: a load failed in this step; not saving its %d new blocks", len(plan.saves)
            )
            return
        self.save(plan)

    def save(self, plan: StepPlan) -> None:
        """Copy newly full blocks out of the KV cache into staging memory; the saver stores
        them in the background. Never raises, never waits for the cache server."""
        if self.layout is None or self.saver is None or not self.saves:
            return
        t0 = time.perf_counter()
        try:
            session = self._session(plan)
            if self.audit:
                self._audit(session, {b.key: b.block_id for b in plan.saves})
            self.saver.stage(session, plan.saves)
        except Exception as exc:
            self._count("save_failures", 1)
            log.debug("kvkeep: save skipped: %s", exc)
        self._count("save_s", time.perf_counter() - t0)
        self._maybe_summarize()

    # debugging -----------------------------------------------------------------------------

    def _audit(self, session: Session, computed: dict[BlockKey, int]) -> None:
        """Compare blocks vLLM computed although kvkeep holds them with the stored copy
        (one ACQUIRE per block, on the step: a debugging aid, not for production).

        A difference of numeric drift (chunked attention adds in another order) is the
        expected case and logged at INFO; anything else is a fault and logged as a warning.
        The stored copy is what later hits get: kvkeep keeps the first copy it was given.
        """
        assert self.layout is not None
        slots = [s for key in computed for s in self.client.acquire(session, [key])]
        computed_again = {s.key: computed[s.key] for s in slots}
        try:
            engine = np.empty(self.layout.block_bytes, dtype=np.uint8)
            for slot in slots:
                self.layout.gather(computed_again[slot.key], engine)
                worst = block_difference(self.client.slot_view(slot), engine, self.layout.dtype)
                self._count("audit_blocks", 1)
                if worst:
                    self._count("audit_mismatches", 1)
                level = logging.WARNING if worst > AUDIT_DRIFT else logging.INFO
                log.log(
                    level,
                    "kvkeep audit: block %s (engine block %d): stored copy differs "
                    "from vLLM's by at most %.4g",
                    slot.key.hex()[:12],
                    computed_again[slot.key],
                    worst,
                )
        finally:
            self._release(slots)

    # bookkeeping ---------------------------------------------------------------------------

    def _count(self, name: str, amount: float) -> None:
        if self.state and name in WINDOW_COUNTED:  # a state is one snapshot, not tokens
            block_size = self.layout.description.block_size if self.layout is not None else 1
            name, amount = "states_" + name.removesuffix("_tokens"), amount // block_size
        elif self.windows[self.group] is not None and name in WINDOW_COUNTED:
            name = "window_" + name  # a sliding group's blocks are not the prompt's tokens
        self.counters.add(name, amount)
        self.totals.add(name, amount)

    def _timed(self, name: str) -> contextlib.AbstractContextManager[None]:
        return timed(self._count, name)

    def _maybe_summarize(self) -> None:
        now = time.monotonic()
        if now - self._last_summary < SUMMARY_EVERY_S:
            return
        self._last_summary = now
        t = self.totals.values
        log.info(
            "kvkeep totals: loaded %d tokens (%d failed) in %.3f s, saved %d tokens in %.3f s, "
            "%d save failures",
            t["loaded_tokens"],
            t["load_failed_tokens"],
            t["load_s"],
            t["saved_tokens"],
            t["save_s"],
            t["save_failures"],
        )

    def shutdown(self) -> None:
        """Store what is staged (bounded by the RPC timeouts), then close both connections."""
        if self.background is not None:
            self.background.shutdown()
        if self.saver is not None:
            self.saver.shutdown()
        if self.loader is not None:
            self.loader.verifier.close()
        self.client.close()
