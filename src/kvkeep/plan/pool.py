"""How many blocks of vLLM's KV pool one request holds, for plain and sliding-window models.

Without sliding windows a request of ``n`` tokens holds ``ceil(n / block)`` blocks, each with
one page of every layer. vLLM's hybrid KV cache manager instead splits the layers into KV
cache groups of ``group_size`` layers of one kind, and every group takes its own blocks from
the one pool (``pool_groups``): a full-attention group holds every block of the request; a
sliding-window group, once the prefill is done, only the blocks that cover the last
``window - 1`` tokens, at most ``ceil((window - 1) / block) + 1``. So the pool's ``N`` blocks
hold fewer tokens of a hybrid model than of a plain one: a bench that sizes its documents
against the pool must count blocks with `request_blocks`, never ``n / block``. Pure
arithmetic; nothing here imports vllm. How vLLM picks ``group_size``: docs/notes/kv-footprint.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kvkeep.plan.footprint import KVFootprint


class PoolGroups(NamedTuple):
    """vLLM's KV cache groups for a model: how many of each kind, each of ``group_size``
    layers (the last of a kind padded)."""

    full: int
    sliding: int
    group_size: int


def pool_groups(fp: KVFootprint) -> PoolGroups:
    """The groups vLLM's hybrid KV cache manager makes for ``fp``'s layers. One kind only
    (every layer full, or every layer sliding) is one group of all layers."""
    full, sliding = fp.full_layers, fp.window_layers
    if not sliding or not full:
        return PoolGroups(int(full > 0), int(sliding > 0), fp.layers)
    # vLLM 0.32's _get_kv_cache_groups_uniform_page_size: the smaller count, or the larger
    # when it is under 1.5 times the smaller (fewer padding layers)
    size = min(full, sliding)
    if max(full, sliding) < 1.5 * size:
        size = max(full, sliding)
    return PoolGroups(math.ceil(full / size), math.ceil(sliding / size), size)


def request_blocks(fp: KVFootprint, tokens: int, block_tokens: int, step_tokens: int = 0) -> int:
    """Pool blocks a request of ``tokens`` tokens holds after its prefill under vLLM's hybrid
    KV cache manager (for a model without sliding layers: ``ceil(tokens / block_tokens)``).
    ``step_tokens``: a step's token budget, which a sliding group also holds while it runs
    (vLLM's start-up check that one request of the maximum length fits counts it)."""
    if tokens <= 0 or block_tokens <= 0:
        raise ValueError("tokens and block_tokens must be positive")
    groups = pool_groups(fp)
    every = math.ceil(tokens / block_tokens)
    span = fp.window_tokens - 1 + step_tokens
    window = math.ceil(span / block_tokens) + 1 if fp.window_layers else every
    return groups.full * every + groups.sliding * min(every, window)
