"""``KVKeepConnector``: vLLM's KV connector that keeps KV blocks in the kvkeep cache server.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVKeepConnector",
        "kv_connector_module_path": "kvkeep.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/path/kvkeep.sock", "timeout_s": 1.0}}'

Scheduler side (EngineCore): for a waiting request it LOOKUPs kvkeep's keys for the prompt
blocks beyond vLLM's own hit and claims the leading present ones (always leaving one token to
compute); it tracks every running request's block table and emits, each step, the blocks to
load and the blocks that become full (to save) in a ``StepPlan``.

Worker side: loads are synchronous, before the forward: ACQUIRE (pins) → verify the CRC →
copy every layer into the allocated blocks → RELEASE. A block that is missing, corrupt or
fails to copy is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it
(policy "recompute"). Saves run in ``wait_for_save``, after the forward: RESERVE (the server
skips blocks it already has) → copy → a background thread checksums and COMMITs, so the step
waits only for the copy.

A step with a failed load saves nothing. vLLM runs that step's forward anyway, on top of the
blocks that did not load, so its new KV is wrong under correct keys; vLLM then recomputes.
The scheduler side learns of the failure from the step's connector output and moves the save
frontiers back (``RequestBook.on_load_errors`` and ``rewind``), so the recompute is saved.

When vLLM computes a block it already holds again (the last block of a block-aligned prompt,
or a partial block that decode completes), kvkeep keeps the first copy it was given: RESERVE
skips keys the server holds. Both copies are valid KV for the same tokens; they can differ by
the numeric drift of differently chunked attention. With ``"audit": true`` in the extra
config, the worker compares such a second copy with the stored one and logs the largest
difference (``audit_*`` counters): drift is small, a real fault is not.

Nothing raised by kvkeep escapes into vLLM: a down, slow or restarted cache server turns
into misses and recomputes. The client reconnects with backoff and bounds every RPC.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvkeep.keys import BlockKey
from kvkeep.server.client import CacheUnavailable, KVKeepClient, Session, SlotRef
from kvkeep.vllm import compat
from kvkeep.vllm.layout import KVLayout
from kvkeep.vllm.scheduling import (
    PROFILE_NAMES,
    BlockTransfer,
    ClaimRange,
    ConnectorConfig,
    Counters,
    Match,
    RequestBook,
    RequestLoad,
    StepPlan,
    claim_range,
    timed,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

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


class KVKeepMetadata(KVConnectorMetadata):
    """The scheduler's plan for this step, as the worker receives it (picklable)."""

    def __init__(self, plan: StepPlan | None) -> None:
        self.plan = plan


# --- stats --------------------------------------------------------------------------------


class KVKeepStats(KVConnectorStats):
    """kvkeep's counters in vLLM's stats pipeline: summed across workers and steps."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVKeepStats:
        merged = Counters(dict(self.data))
        merged.merge(other.data)
        return KVKeepStats(data={k: v for k, v in merged.values.items() if v})

    def reduce(self) -> dict[str, int | float]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVKeepPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvkeep_tokens_total{op=offered|loaded|load_failed|saved}``,
    ``vllm:kvkeep_seconds_total{op=load|save}`` and ``vllm:kvkeep_events_total{op=...}``."""

    _TOKENS: ClassVar[dict[str, str]] = {
        "offered_tokens": "offered",
        "loaded_tokens": "loaded",
        "load_failed_tokens": "load_failed",
        "saved_tokens": "saved",
    }
    _SECONDS: ClassVar[dict[str, str]] = {
        "load_s": "load",
        "save_s": "save",
        **{name: name.removesuffix("_s") for name in PROFILE_NAMES},
    }
    _EVENTS: ClassVar[dict[str, str]] = {
        "lookups": "lookup",
        "lookup_failures": "lookup_failed",
        "save_failures": "save_failed",
        "saves_dropped": "save_dropped_after_failed_load",  # blocks
        "audit_blocks": "audit_block",
        "audit_mismatches": "audit_mismatch",
        "unkeyable_lora": "unkeyable_lora",
        "unkeyable_multimodal": "unkeyable_multimodal",
        "unkeyable_prompt_embeds": "unkeyable_prompt_embeds",
    }

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        names = [*labelnames, "op"]
        self._families: dict[str, Any] = {
            "tokens": self._counter_cls(
                name="vllm:kvkeep_tokens", documentation="KV tokens by kvkeep op", labelnames=names
            ),
            "seconds": self._counter_cls(
                name="vllm:kvkeep_seconds", documentation="time in kvkeep copies", labelnames=names
            ),
            "events": self._counter_cls(
                name="vllm:kvkeep_events", documentation="kvkeep RPC outcomes", labelnames=names
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues[engine_idx])
        for table, family in ((self._TOKENS, "tokens"), (self._SECONDS, "seconds")):
            for key, op in table.items():
                if transfer_stats_data.get(key):
                    metric = self._families[family].labels(*labels, op)
                    metric.inc(transfer_stats_data[key])
        for key, op in self._EVENTS.items():
            if transfer_stats_data.get(key):
                self._families["events"].labels(*labels, op).inc(transfer_stats_data[key])


# --- the connector ------------------------------------------------------------------------


class KVKeepConnector(KVConnectorBase_V1):
    """vLLM's entry point; delegates to ``_SchedulerSide`` or ``_WorkerSide`` by role."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_supported(vllm_config, kv_cache_config)
        config = ConnectorConfig.from_extra(compat.extra_config(vllm_config))
        client = KVKeepClient(
            socket_path=config.socket,
            timeout_s=config.timeout_s,
            max_backoff_s=config.max_backoff_s,
        )
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(vllm_config, kv_cache_config, client)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, client, config.audit)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, nothing more

    # scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.match(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KVKeepMetadata(self._scheduler.plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None and connector_output.invalid_block_ids:
            self._scheduler.load_errors(connector_output.invalid_block_ids)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
        return False, None  # saves were copied synchronously: the blocks may be freed now

    # worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if self._worker is not None and plan is not None and plan.loads:
            self._worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish inside start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves copy whole blocks of every layer in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if self._worker is not None:
            self._worker.end_step(plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker or self._scheduler
        data = side.counters.take() if side is not None else None
        return KVKeepStats(data=data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVKeepMetadata) else None

    # stats classmethods ---------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVKeepStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVKeepPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# --- scheduler side -------------------------------------------------------------------------


class _SchedulerSide:
    """Claims, per-request tracking and the step plan. Every vLLM callback here is wrapped so
    that a kvkeep failure means "no hit" and never an exception in the scheduler."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, client: KVKeepClient) -> None:
        self.namespace = compat.namespace(vllm_config, kv_cache_config)
        self.book = RequestBook(self.namespace)
        self.client = client
        self.session = client.session(
            self.namespace, compat.expected_block_bytes(kv_cache_config), label="scheduler"
        )
        self.counters = Counters()
        self._requests: dict[str, Any] = {}  # req_id -> vLLM Request, while tracked
        self._unkeyable: set[str] = set()  # req_ids counted as unkeyable, until finished
        self._announce(client.socket_path)

    def _announce(self, socket_path: str | None) -> None:
        try:
            self.client.hello(self.namespace, self.session.block_bytes, "scheduler")
            log.info("kvkeep: cache server at %s, namespace %s", socket_path, self._ns_label())
        except CacheUnavailable as exc:
            log.warning(
                "kvkeep: cache server at %s is not reachable (%s); serving without it and "
                "reconnecting with backoff",
                socket_path,
                exc,
            )

    def _ns_label(self) -> str:
        ns = self.namespace
        return f"{ns.digest().hex()[:12]} ({ns.backend}, {ns.layout}, block {ns.block_size})"

    def match(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens kvkeep can supply beyond ``num_computed_tokens``; 0 on any failure.
        Idempotent for repeated calls with the same inputs (the answer is memoised)."""
        try:
            if compat.unkeyable_reason(request) is not None:
                return 0  # no LOOKUP; after_alloc counts the reason once
            with self.counters.timed("match_s"):
                return self._match(request, num_computed_tokens)
        except Exception:
            log.exception("kvkeep: lookup failed; treating it as a miss")
            self.counters.add("lookup_failures", 1)
            return 0

    def _match(self, request: Any, num_computed: int) -> int:
        req_id, num_tokens = request.request_id, request.num_tokens
        cached = self.book.cached_match(req_id, num_computed, num_tokens)
        if cached is not None:
            return cached.num_blocks * self.book.block_size
        claim = claim_range(num_tokens, num_computed, self.book.block_size)
        found = self._lookup(request, claim)
        self.book.remember_match(req_id, Match(num_computed, num_tokens, found))
        return found * self.book.block_size

    def _lookup(self, request: Any, claim: ClaimRange) -> int:
        if claim.empty:
            return 0
        tokens = compat.request_tokens(request)
        keys = self.book.keys_for(request.request_id, tokens, compat.request_salt(request))
        self.counters.add("lookups", 1)
        try:
            with self.counters.timed("lookup_rpc_s"):
                found = self.client.lookup(self.session, keys[claim.first : claim.limit])
            return found.num_present
        except CacheUnavailable as exc:
            self.counters.add("lookup_failures", 1)
            log.debug("kvkeep: lookup unavailable: %s", exc)
            return 0

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        try:
            reason = compat.unkeyable_reason(request)
            if reason is not None:
                self._skip_unkeyable(request.request_id, reason)
                return
            load = self.book.on_alloc(
                request.request_id,
                compat.request_tokens(request),
                compat.request_salt(request),
                compat.group0_block_ids(blocks),
                num_external_tokens,
            )
        except Exception:
            log.exception("kvkeep: could not track request %s", request.request_id)
            return
        self._requests[request.request_id] = request
        if load is not None:
            self.counters.add("offered_tokens", len(load.blocks) * self.book.block_size)

    def plan(self, out: Any) -> StepPlan | None:
        """This step's loads and saves; None (nothing to do) if planning itself failed."""
        try:
            with self.counters.timed("plan_s"):
                return self._plan(out)
        except Exception:
            log.exception("kvkeep: could not plan this step; skipping its loads and saves")
            return None

    def _plan(self, out: Any) -> StepPlan:
        saves: list[BlockTransfer] = []
        for new in out.scheduled_new_reqs:
            self.book.update_blocks(new.req_id, compat.new_block_ids_of(new.block_ids), True)
            after = new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0)
            saves += self._saves(new.req_id, after)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = compat.new_block_ids_of(cached.new_block_ids[i])
            self.book.update_blocks(req_id, ids, req_id in cached.resumed_req_ids)
            self.book.rewind(req_id, cached.num_computed_tokens[i])
            after = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
            saves += self._saves(req_id, after)
        return self.book.take_plan(saves)

    def _saves(self, req_id: str, num_computed_after: int) -> list[BlockTransfer]:
        request = self._requests.get(req_id)
        if request is None:
            return []
        return self.book.saves_after(
            req_id,
            num_computed_after,
            compat.request_tokens(request),
            compat.request_salt(request),
        )

    def _skip_unkeyable(self, req_id: str, reason: str) -> None:
        """Never track (so never save) a request kvkeep cannot key; count it once. A request
        tracked before (a streaming update added media) is dropped from here on."""
        if req_id in self._requests:
            self.finished(req_id)
        if req_id not in self._unkeyable:
            self._unkeyable.add(req_id)
            self.counters.add(f"unkeyable_{reason}", 1)

    def load_errors(self, block_ids: set[int]) -> None:
        """A step reported failed loads: its saves were dropped; plan them again."""
        try:
            rewound = self.book.on_load_errors()
        except Exception:
            log.exception("kvkeep: could not rewind the save frontiers")
            return
        log.info("kvkeep: %d blocks failed to load; %d requests will save again after "
                 "vLLM recomputes", len(block_ids), rewound)  # fmt: skip

    def finished(self, req_id: str) -> None:
        self.book.finish(req_id)
        self._requests.pop(req_id, None)
        self._unkeyable.discard(req_id)


# --- worker side --------------------------------------------------------------------------


class _WorkerSide:
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
                crcs = [zlib.crc32(self.client.slot_view(s).data) for s in slots]
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
