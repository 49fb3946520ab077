"""The connector's worker side: copies between the engine's KV blocks and arena slots.

Loads run before the forward (ACQUIRE, verify, copy in, RELEASE); saves copy out after it and
commit on a background thread; a step with a failed load saves nothing. See
:mod:`kvkeep.vllm.connector` for the whole flow.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvkeep.keys import BlockKey
from kvkeep.server.client import CacheUnavailable, KVKeepClient, Session, SlotRef
from kvkeep.store.base import checksum
from kvkeep.vllm import compat
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.scheduling import (
    BlockTransfer,
    Counters,
    RequestLoad,
    StepPlan,
    timed,
)

if TYPE_CHECKING:
    pass

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
    before the forward; saves copy synchronously and commit in the background."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, client: KVKeepClient, audit: bool = False
    ) -> None:
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.client = client
        self.audit = audit
        self.tp_rank, _ = compat.tp_rank_size(vllm_config)
        self.layout: KVLayout | None = None
        self.counters = Counters()
        self.totals = Counters()
        self._load_errors: set[int] = set()
        self._failed_this_step = False
        self._sessions: dict[bytes, Session] = {}
        self._commits: queue.Queue[tuple[Session, list[SlotRef]] | None] = queue.Queue(64)
        self._committer = threading.Thread(target=self._commit_loop, name="kvkeep-commit")
        self._committer.daemon = True
        self._committer.start()
        self._last_summary = time.monotonic()

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Build the layout adapter; an unsupported layout raises here and stops start-up."""
        description = compat.layout_description(self.vllm_config, self.kv_cache_config)
        self.layout = KVLayout.build(description, kv_caches)
        log.info(
            "kvkeep: %d layers, %s pages of %d bytes (%s), %d-byte blocks",
            self.layout.num_layers,
            description.layout,
            self.layout.page_bytes,
            self.layout.dtype,
            self.layout.block_bytes,
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
        """How many leading blocks of ``request`` were copied in and verified."""
        if self.layout is None:
            return 0
        slots: list[SlotRef] = []
        corrupt: list[SlotRef] = []
        done = 0
        try:
            session = self._session(plan)
            with self._timed("acquire_rpc_s"):
                slots = self.client.acquire(session, [b.key for b in request.blocks])
            for block, slot in zip(request.blocks, slots, strict=False):
                if slot.key != block.key or not self._verify(slot):
                    log.warning("kvkeep: block %s failed its checksum", block.key.hex()[:12])
                    # Report every bad one of the rest too (this path is rare): the server
                    # drops them, so one pass is enough for loads or saves to replace them.
                    corrupt = [s for s in slots[done:] if not self.client.verify(s)]
                    break
                with self._timed("copy_in_s"):
                    self.layout.scatter(block.block_id, self.client.slot_view(slot))
                done += 1
        except Exception as exc:
            log.warning("kvkeep: load of %s stopped after %d blocks: %s", request.req_id, done, exc)
        finally:
            self._release(slots, corrupt)
        return done

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
        """Copy newly full blocks into reserved slots; commits happen in the background.
        Blocks the server already holds are not written. Never raises."""
        if self.layout is None:
            return
        t0 = time.perf_counter()
        try:
            session = self._session(plan)
            self._save(session, plan.saves, plan.namespace.block_size)
        except Exception as exc:
            self._count("save_failures", 1)
            log.debug("kvkeep: save skipped: %s", exc)
        self._count("save_s", time.perf_counter() - t0)
        self._maybe_summarize()

    def _save(self, session: Session, saves: Sequence[BlockTransfer], block_size: int) -> None:
        assert self.layout is not None
        by_key: dict[BlockKey, int] = {}
        for block in saves:
            by_key.setdefault(block.key, block.block_id)
        keys = list(by_key)
        with self._timed("reserve_rpc_s"):
            slots = self.client.reserve(session, keys)
        try:
            with self._timed("copy_out_s"):
                for slot in slots:
                    self.layout.gather(by_key[slot.key], self.client.slot_view(slot))
        except Exception:
            self._release(slots)
            raise
        self._count("saved_tokens", len(slots) * block_size)
        if slots:
            self._enqueue_commit(session, slots)
        if self.audit:
            reserved = {slot.key for slot in slots}
            self._audit(session, {k: b for k, b in by_key.items() if k not in reserved})

    # debugging -----------------------------------------------------------------------------

    def _audit(self, session: Session, computed_again: dict[BlockKey, int]) -> None:
        """Compare blocks vLLM computed although kvkeep holds them with the stored copy.

        A difference of numeric drift (chunked attention adds in another order) is the
        expected case and logged at INFO; anything else is a fault and logged as a warning.
        The stored copy is what later hits get: kvkeep keeps the first copy it was given.
        """
        assert self.layout is not None
        keys = list(computed_again)
        slots = self.client.acquire(session, keys) if keys else []
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

    def _enqueue_commit(self, session: Session, slots: list[SlotRef]) -> None:
        try:
            self._commits.put_nowait((session, slots))
        except queue.Full:
            self._commit(session, slots)  # back-pressure: commit on this thread

    def _commit_loop(self) -> None:
        while True:
            item = self._commits.get()
            if item is None:
                return
            self._commit(*item)

    def _commit(self, session: Session, slots: list[SlotRef]) -> None:
        try:
            with self._timed("checksum_s"):
                crcs = [checksum(self.client.slot_view(s).data) for s in slots]
            with self._timed("commit_rpc_s"):
                self.client.commit(session, slots, crcs)
        except Exception as exc:
            self._count("save_failures", 1)
            log.debug("kvkeep: commit failed: %s", exc)
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
        with contextlib.suppress(queue.Full):
            self._commits.put(None, timeout=1.0)
        self._committer.join(timeout=5.0)
        self.client.close()
