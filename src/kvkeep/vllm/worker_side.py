"""The connector's worker side: copies between the engine's KV blocks and arena slots.

Loads run before the forward (ACQUIRE, verify, copy in, RELEASE); saves copy out after it
into staging memory and are stored by a background thread (:mod:`kvkeep.vllm.saver`); a step
with a failed load saves nothing. See :mod:`kvkeep.vllm.connector` for the whole flow.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from kvkeep.keys import BlockKey
from kvkeep.server.client import CacheUnavailable, KVKeepClient, Session, SlotRef
from kvkeep.vllm import compat, cuda
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.saver import Saver, staging_shape
from kvkeep.vllm.scheduling import (
    Counters,
    RequestLoad,
    StepPlan,
    timed,
)
from kvkeep.vllm.transfer import Mover, region_of

log = logging.getLogger("vllm.kvkeep")
SUMMARY_EVERY_S = 10.0

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
    """Copies between the engine's KV blocks and arena slots. Loads are synchronous and run
    before the forward; saves copy out on the step and are stored in the background.

    ``client`` serves loads (on the step); saves use a second connection of their own
    (``client.sibling()``), so a step's ACQUIRE never queues behind a background COMMIT."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        client: KVKeepClient,
        audit: bool = False,
        staging_bytes: int | None = None,
    ) -> None:
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.client = client
        self.audit = audit
        self.staging_bytes = staging_bytes
        self.saver: Saver | None = None
        self.mover = Mover()
        self.tp_rank, _ = compat.tp_rank_size(vllm_config)
        self.layout: KVLayout | None = None
        self.counters = Counters()
        self.totals = Counters()
        self._load_errors: set[int] = set()
        self._failed_this_step = False
        self._sessions: dict[bytes, Session] = {}
        self._last_summary = time.monotonic()

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Build the layout adapter; an unsupported layout raises here and stops start-up."""
        description = compat.layout_description(self.vllm_config, self.kv_cache_config)
        self.layout = KVLayout.build(description, kv_caches)
        self.mover = cuda.mover_for(self.layout)
        steps = compat.step_blocks(self.vllm_config, description.block_size)
        shape = staging_shape(steps, self.layout.block_bytes, self.staging_bytes)
        self.saver = Saver(
            self.client.sibling(), self.layout, self._count, self._timed, shape, self.mover
        )
        log.info(
            "kvkeep: %d layers, %s pages of %d bytes (%s), %d-byte blocks, %s copies, "
            "staging %d x %d blocks",
            self.layout.num_layers,
            description.layout,
            self.layout.page_bytes,
            self.layout.dtype,
            self.layout.block_bytes,
            "fused" if self.layout.fused else "per-layer",
            *shape,
        )

    def _session(self, plan: StepPlan) -> Session:
        assert self.layout is not None
        digest = plan.namespace.digest()
        if digest not in self._sessions:
            ns = plan.namespace
            if self.tp_rank:
                ns = replace(ns, tp_rank=self.tp_rank)
            label = f"worker{self.tp_rank}"
            self._sessions[digest] = self.client.session(ns, self.layout.block_bytes, label)
        return self._sessions[digest]

    # loads ---------------------------------------------------------------------------------

    def load(self, plan: StepPlan) -> None:
        """Fill every planned block, or report it in the load errors. Never raises."""
        t0 = time.perf_counter()
        loaded = failed = 0
        for request in plan.loads:
            done = self._load_request(plan, request)
            self._load_errors.update(b.block_id for b in request.blocks[done:])
            loaded, failed = loaded + done, failed + len(request.blocks) - done
        self._failed_this_step = self._failed_this_step or failed > 0
        elapsed = time.perf_counter() - t0
        self._count("loaded_tokens", loaded * plan.namespace.block_size)
        self._count("load_failed_tokens", failed * plan.namespace.block_size)
        self._count("load_s", elapsed)
        log.info("kvkeep: loaded %d blocks (%d failed) in %.1f ms", loaded, failed, 1e3 * elapsed)
        self._maybe_summarize()

    def _load_request(self, plan: StepPlan, request: RequestLoad) -> int:
        """How many leading blocks of ``request`` were verified and copied in (0 when the copy
        itself failed: a batched copy may have written any of them)."""
        if self.layout is None:
            return 0
        slots: list[SlotRef] = []
        corrupt: list[SlotRef] = []
        good = 0
        try:
            session = self._session(plan)
            with self._timed("acquire_rpc_s"):
                slots = self.client.acquire(session, [b.key for b in request.blocks])
            good = self._verified(request, slots)
            if good < len(slots):
                log.warning("kvkeep: block %s failed its checksum", slots[good].key.hex()[:12])
                # Report every bad one of the rest too (this path is rare): the server drops
                # them, so one pass is enough for loads or saves to replace them.
                corrupt = [s for s in slots[good:] if not self.client.verify(s)]
            self._copy_in(request, slots[:good])
        except Exception as exc:
            log.warning("kvkeep: load of %s failed (%d blocks verified): %s", request.req_id,
                        good, exc)  # fmt: skip
            good = 0
        finally:
            self._release(slots, corrupt)
        return good

    def _verified(self, request: RequestLoad, slots: Sequence[SlotRef]) -> int:
        """How many leading slots hold their block's key and pass their checksum."""
        for i, (block, slot) in enumerate(zip(request.blocks, slots, strict=False)):
            if slot.key != block.key or not self._verify(slot):
                return i
        return len(slots)

    def _copy_in(self, request: RequestLoad, slots: Sequence[SlotRef]) -> None:
        assert self.layout is not None
        mapping = self.client.arena_mapping()
        if mapping is not None:
            self.mover.pin_arena(region_of(*mapping))
        views = [self.client.slot_view(s) for s in slots]
        with self._timed("copy_in_s"):
            self.mover.scatter(
                self.layout, [b.block_id for b in request.blocks[: len(slots)]], views
            )

    def _release(self, slots: Sequence[SlotRef], corrupt: Sequence[SlotRef] = ()) -> None:
        if not slots:
            return
        # On failure the server drops a dead connection's pins itself.
        with contextlib.suppress(CacheUnavailable), self._timed("release_rpc_s"):
            self.client.release(slots, corrupt)

    def _verify(self, slot: SlotRef) -> bool:
        with self._timed("verify_s"):
            return self.client.verify(slot)

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
            return
        if failed:
            self._count("saves_dropped", len(plan.saves))
            log.info("kvkeep: a load failed in this step; not saving its %d new blocks",
                     len(plan.saves))  # fmt: skip
            return
        self.save(plan)

    def save(self, plan: StepPlan) -> None:
        """Copy newly full blocks out of the KV cache into staging memory; the saver stores
        them in the background. Never raises, never waits for the cache server."""
        if self.layout is None or self.saver is None:
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
                log.log(level, "kvkeep audit: block %s (engine block %d): stored copy differs "
                        "from vLLM's by at most %.4g", slot.key.hex()[:12],
                        computed_again[slot.key], worst)  # fmt: skip
        finally:
            self._release(slots)

    # bookkeeping ---------------------------------------------------------------------------

    def _count(self, name: str, amount: float) -> None:
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
        if self.saver is not None:
            self.saver.shutdown()
        self.client.close()
