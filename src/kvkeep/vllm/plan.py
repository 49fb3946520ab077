"""What the scheduler side sends its workers each step: per KV cache group, a ``StepPlan`` of
the requests' loads and the blocks that became full (to save), as engine block ids paired
with kvkeep keys. Pickled into vLLM's connector metadata, so small and plain.

Free of vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvkeep.keys import BlockKey, Namespace


class BlockTransfer(NamedTuple):
    """Copy engine block ``block_id`` from/to the cached block ``key``."""

    block_id: int
    key: BlockKey


class RequestLoad(NamedTuple):
    """The blocks one request loads, in chain order (a miss ends the usable prefix).
    ``background``: vLLM's asynchronous load; the worker copies off the step and reports the
    request in ``get_finished`` (vLLM does not schedule it before)."""

    req_id: str
    blocks: tuple[BlockTransfer, ...]
    background: bool = False


@dataclass(frozen=True)
class StepPlan:
    """One step's work for every worker: pickled into the connector metadata, so small.

    ``namespace`` is the rank-0 namespace; a worker of TP rank r stores under the same
    namespace with ``tp_rank=r`` (the scheduler looks up rank 0's blocks only).
    """

    namespace: Namespace
    loads: tuple[RequestLoad, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()

    @property
    def num_load_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.loads)
