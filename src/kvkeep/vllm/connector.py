"""``KVKeepConnector``: vLLM's KV connector that keeps KV blocks in the kvkeep cache server.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVKeepConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvkeep.vllm.connector", "kv_load_failure_policy":
        "recompute", "kv_connector_extra_config": {"socket": "/path/kvkeep.sock"}}'

vLLM's entry point, delegating by role: ``scheduler_side`` (EngineCore: claims, and each
step's ``StepPlan`` of blocks to load and save), ``worker_side`` (each worker: loads, saves),
``stats``; the decisions, free of vllm, are in ``book``, ``plan`` and ``config``. Contract:
nothing kvkeep raises escapes into vLLM (a down, slow or restarted cache server is misses and
recomputes; every RPC is bounded); a block that fails to load is reported and vLLM recomputes
it; no wrong KV is saved or read (:mod:`kvkeep.vllm.guard`); each KV cache group has a
namespace of its own. Loads, saves, failures and hybrid models: docs/notes/connector.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvkeep.server.client import KVKeepClient
from kvkeep.vllm import compat
from kvkeep.vllm.config import ConnectorConfig
from kvkeep.vllm.group_loads import GroupLoads
from kvkeep.vllm.plan import StepPlan
from kvkeep.vllm.scheduler_side import SchedulerSide
from kvkeep.vllm.stats import KVKeepPromMetrics, KVKeepStats
from kvkeep.vllm.worker_side import WorkerSide

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

STATS_HOLD_S = 1.0  # timings alone go to vLLM at most this often (Counters.take)


class KVKeepMetadata(KVConnectorMetadata):
    """The scheduler's plans for this step, one per KV cache group, as the workers receive
    them (picklable)."""

    def __init__(self, plans: tuple[StepPlan, ...] | None) -> None:
        self.plans = plans


# On CPU, finding the backend in the engine core would import vLLM's CPU attention module
# there: 0.6 s of start-up on 2 cores.
class KVKeepHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side at start-up (vLLM's connector handshake): the
    attention backend it keys under, which on CPU the engine core does not know cheaply
    (``compat.known_backend``)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend


# --- the connector ------------------------------------------------------------------------


class KVKeepConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's entry point; delegates to ``SchedulerSide`` or one ``WorkerSide`` per KV cache
    group, by role."""

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
            map_arena=role != KVConnectorRole.SCHEDULER,  # it only looks keys up
        )
        self._scheduler: SchedulerSide | None = None
        self._workers: list[WorkerSide] = []
        self._hybrid = compat.num_groups(kv_cache_config) > 1
        self._group_loads = GroupLoads()
        if role == KVConnectorRole.SCHEDULER:
            block_bytes = compat.expected_block_bytes(kv_cache_config)
            self._scheduler = SchedulerSide(
                vllm_config,
                kv_cache_config,
                client,
                config.async_min_blocks(block_bytes),
                config.sync_when_alone,
                config.state_boundaries,
            )
        else:
            staging = None if config.staging_mib is None else int(config.staging_mib * (1 << 20))
            self._workers = [
                self._worker_side(vllm_config, kv_cache_config, client, config, staging, g)
                for g in range(compat.num_groups(kv_cache_config))
            ]
        self._worker = self._workers[0] if self._workers else None

    @staticmethod
    def _worker_side(
        vllm_config: Any,
        kv_cache_config: Any,
        client: KVKeepClient,
        config: ConnectorConfig,
        staging: int | None,
        group: int,
    ) -> WorkerSide:
        """Group 0's worker uses ``client`` for its synchronous loads; others a sibling."""
        own = client if group == 0 else client.sibling()
        return WorkerSide(vllm_config, kv_cache_config, own, config.audit, staging, group)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, nothing more

    # scheduler side -------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM's scheduler binds its KV cache manager at start-up: the guard's rule 2 evicts
        a failed synchronous load's blocks through it (``SchedulerSide.bind``)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.match(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KVKeepMetadata(self._scheduler.plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is None:
            return
        invalid = connector_output.invalid_block_ids or set()
        if connector_output.finished_recving:
            failed = set(connector_output.failed_recving or ())
            self._scheduler.loads_finished(set(connector_output.finished_recving), invalid, failed)
        if invalid:
            self._scheduler.load_errors(invalid)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Never delays the free. Saves were copied out on their step. A request aborted
        while its asynchronous load writes its blocks is in ``WAITING_FOR_REMOTE_KVS``, and
        for those vLLM itself keeps the blocks until ``get_finished`` reports the load
        (``Scheduler.finish_requests``); a True here would make it wait for a
        ``finished_sending`` that never comes."""
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call for a connector that supports HMA, once per request, with every
        group's blocks: the same as ``request_finished`` (saves never hold blocks)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._workers
        for worker in self._workers:
            worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This worker's attention backend, which vLLM hands to the scheduler side after the
        KV caches are registered. None on failure: the scheduler side then finds it itself."""
        if not self._workers:
            return None
        worker = self._workers[0]
        try:
            return KVKeepHandshake(
                compat.attention_backend(worker.vllm_config, worker.kv_cache_config)
            )
        except Exception:
            log.exception("kvkeep: no attention backend for the handshake")
            return None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Rank 0's backend keys every rank's blocks (each rank adds its ``tp_rank``)."""
        first = metadata.get(0, next(iter(metadata.values()), None))
        if self._scheduler is not None and isinstance(first, KVKeepHandshake):
            self._scheduler.adopt_backend(first.backend)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plans = self._plans()
        if self._hybrid:
            self._expect_loads(plans)
        for worker, plan in zip(self._workers, plans, strict=False):
            if plan.loads:
                worker.load(plan)

    def _expect_loads(self, plans: tuple[StepPlan, ...]) -> None:
        """Count, per request, the groups whose loads start now (``kvkeep.vllm.group_loads``)."""
        groups: dict[str, int] = {}
        for plan in plans:
            for load in plan.loads:
                groups[load.req_id] = groups.get(load.req_id, 0) + 1
        for req_id, n in groups.items():
            self._group_loads.expect(req_id, n)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads finish in start_load_kv; asynchronous ones feed no forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves copy whole blocks of every layer in wait_for_save

    def wait_for_save(self) -> None:
        plans = self._plans()
        for g, worker in enumerate(self._workers):
            worker.end_step(plans[g] if g < len(plans) else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(nothing sent: saves never hold vLLM's blocks, requests whose asynchronous load
        ended). An aborted request is reported too: vLLM keeps its blocks until then."""
        if self._worker is None:
            return None, None
        if self._hybrid:
            return None, self._group_loads_ended().finished or None
        return None, self._worker.finished_loads()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s answer; with several groups also the requests whose load failed
        in some group (``failed_recving``: vLLM recomputes them from scratch)."""
        if not self._hybrid or self._worker is None:
            _, recving = self.get_finished(finished_req_ids)
            return KVConnectorTransferResults(finished_recving=set(recving or ()))
        ended = self._group_loads_ended()
        return KVConnectorTransferResults(
            finished_recving=ended.finished, failed_recving=ended.failed
        )

    def _group_loads_ended(self) -> Any:
        for worker in self._workers:
            for result in worker.finished_results():
                self._group_loads.ended(result.req_id, bool(result.failed))
        return self._group_loads.take()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The failed blocks of this step's loads. With several KV cache groups block ids
        are not unique and vLLM refuses them (it raises): failures go as whole requests
        through ``get_transfer_results`` instead, and the block ids are dropped here."""
        errors = set()
        for worker in self._workers:
            errors |= worker.take_load_errors()
        return set() if self._hybrid else errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What the connector counted since the last call (timings alone at most once per
        STATS_HOLD_S, see ``Counters.take``)."""
        sides: list[Any] = [*self._workers, self._scheduler]
        data: dict[str, float] = {}
        for side in sides:
            taken = side.counters.take(STATS_HOLD_S) if side is not None else None
            for name, value in (taken or {}).items():
                data[name] = data.get(name, 0) + value
        return KVKeepStats(data=data) if data else None

    def shutdown(self) -> None:
        for worker in self._workers:
            worker.shutdown()
        if self._scheduler is not None:  # its TOUCH thread, after what is queued
            self._scheduler.touches.close()

    def _plans(self) -> tuple[StepPlan, ...]:
        if not self.has_connector_metadata():
            return ()
        meta = self._get_connector_metadata()
        plans = meta.plans if isinstance(meta, KVKeepMetadata) else None
        return plans or ()

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
