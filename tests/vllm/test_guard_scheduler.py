"""The guard of :mod:`kvkeep.vllm.guard` in the scheduler side, on real vLLM requests (their
own block hashes) and a real vLLM KV cache manager: every request vLLM could admit over a
synchronous load's unconfirmed blocks waits, keyable or not; without a way to evict a failed
load's blocks no load is synchronous; an eviction that raises holds the blocks instead."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from test_compat import BS, NS, FakeClient, blocks, bound, fake_namespaces, image, kv_cache_manager
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvkeep.vllm import compat
from kvkeep.vllm.connector import KVKeepConnector
from kvkeep.vllm.scheduler_side import SchedulerSide

PROMPT = list(range(100, 100 + 4 * BS + 1))  # 4 full blocks and one token


@pytest.fixture(autouse=True)
def one_group(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_namespaces(monkeypatch, [NS])
    monkeypatch.setattr(compat, "expected_block_bytes", lambda kv_cache_config, group=0: 1024)
    monkeypatch.setattr(compat, "group_windows", lambda kv_cache_config: (None,))


def hashed(req_id: str, tokens: list[int] = PROMPT, **kw: Any) -> Request:
    """A vLLM request whose block hashes vLLM's own hasher computes, as the engine does."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher, **kw)


def step(new: list[tuple[str, list[int], int]] = (), cached: list[tuple[str, int]] = ()) -> Any:  # type: ignore[assignment]
    """The fields of vLLM's SchedulerOutput the plan reads: new requests (id, blocks,
    computed tokens) and running ones (id, computed tokens), one token scheduled each."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=n) for r, ids, n in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[None for _ in cached],
            resumed_req_ids=set(),
            num_computed_tokens=[n for _, n in cached],
        ),
        num_scheduled_tokens={r: 1 for r, *_ in [*new, *cached]},
    )


def loading(scheduler: SchedulerSide) -> Request:
    """Request "a" admitted with a synchronous kvkeep load of its 4 blocks."""
    owner = hashed("a")
    assert scheduler.match(owner, 0) == (4 * BS, False)
    scheduler.after_alloc(owner, blocks(5), 4 * BS)
    return owner


def test_a_multimodal_request_waits_while_a_load_over_its_text_blocks_is_unconfirmed() -> None:
    """A multimodal request's leading text blocks hash like the plain request's (vLLM mixes
    the image in only from the block it starts in): vLLM would admit it on its hit over the
    blocks the load has not written yet. kvkeep cannot key it, but it waits all the same."""
    scheduler = bound(FakeClient())
    loading(scheduler)
    media = hashed("m", mm_features=[image(offset=3 * BS, length=BS)])
    assert media.block_hashes[:3] == hashed("x").block_hashes[:3] != media.block_hashes[:4]
    assert compat.unkeyable_reason(media) == "multimodal"
    assert scheduler.match(media, 3 * BS) == (None, False), "admitted over unconfirmed blocks"
    assert scheduler.counters.values["admissions_deferred"] == 1
    assert scheduler.match(hashed("p"), 4 * BS) == (None, False), "a plain one waits too"
    other = hashed("o", [t + 1 for t in PROMPT])
    assert scheduler.match(other, 2 * BS)[0] is not None, "a hit on other blocks goes on"
    while scheduler.guard.active:  # the plans whose outcome may be unknown are handed over
        scheduler.plan(step())
    assert scheduler.match(media, 3 * BS) == (0, False), "then it is admitted (and not keyed)"


def test_without_a_kv_cache_manager_every_load_is_asynchronous(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM bound nothing that can evict a failed load's blocks: loads go in the background
    (their blocks enter vLLM's prefix cache only once in), counted, and said once."""
    caplog.set_level(logging.WARNING, logger="vllm.kvkeep")
    unbound = SchedulerSide(None, None, FakeClient())  # type: ignore[arg-type]
    assert unbound.match(hashed("a"), 0) == (4 * BS, True)
    assert unbound.match(hashed("b"), 0) == (4 * BS, True)
    assert unbound.counters.values["sync_loads_refused"] == 2
    said = [r for r in caplog.records if "every load is asynchronous" in r.getMessage()]
    assert len(said) == 1 and "bound no KV cache manager" in said[0].getMessage()

    caplog.clear()
    cannot = SchedulerSide(None, None, FakeClient())  # type: ignore[arg-type]
    cannot.bind(SimpleNamespace(block_pool=None))  # a manager without evict_blocks
    assert "cannot evict blocks" in caplog.text
    assert cannot.match(hashed("a"), 0) == (4 * BS, True)


def test_the_connector_hands_vllms_manager_to_the_scheduler_side() -> None:
    scheduler = SchedulerSide(None, None, FakeClient())  # type: ignore[arg-type]
    connector = object.__new__(KVKeepConnector)
    connector._scheduler, connector._workers = scheduler, []
    connector.bind_kv_cache_manager(kv_cache_manager())  # what vLLM's Scheduler calls
    assert scheduler.match(hashed("a"), 0) == (4 * BS, False)
    assert scheduler.counters.values["sync_loads_refused"] == 0


class EvictRaises(KVCacheManager):
    """vLLM's manager whose ``evict_blocks`` raises: a fault no real engine here makes."""

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise RuntimeError("evict_blocks is broken")


def broken_evict_side() -> tuple[SchedulerSide, Request]:
    scheduler = SchedulerSide(None, None, FakeClient())  # type: ignore[arg-type]
    manager = kv_cache_manager()
    manager.__class__ = EvictRaises
    scheduler.bind(manager)
    owner = loading(scheduler)
    scheduler.plan(step(new=[("a", [0, 1, 2, 3, 4], 0)]))
    scheduler.load_errors({1})  # blocks 1.. of "a" stay in vLLM's prefix cache, not evicted
    assert scheduler.counters.values["evict_failures"] == 1
    return scheduler, owner


def test_blocks_that_could_not_be_evicted_are_held_until_their_owner_computed_them() -> None:
    scheduler, _ = broken_evict_side()
    for _ in range(3):
        scheduler.plan(step(cached=[("a", BS)]))  # vLLM truncated "a" at its failed block
    assert scheduler.match(hashed("b"), 1 * BS)[0] is not None, "block 0 loaded fine"
    assert scheduler.match(hashed("c"), 3 * BS) == (None, False), "blocks 1-2 are not computed"
    scheduler.plan(step(cached=[("a", 3 * BS)]))
    assert scheduler.match(hashed("d"), 3 * BS)[0] is not None, "computed again by now"
    assert scheduler.match(hashed("e"), 4 * BS) == (None, False), "block 3 still is not"
    scheduler.plan(step(cached=[("a", 4 * BS)]))
    assert not scheduler.guard.active
    fresh = hashed("f", [t + 7 for t in PROMPT])
    assert scheduler.match(fresh, 0) == (4 * BS, True), "no synchronous load after that"


def test_an_owner_that_finishes_first_leaves_its_blocks_held_until_a_prefix_cache_reset() -> None:
    scheduler, _ = broken_evict_side()
    scheduler.finished("a")  # aborted before it computed blocks 1-3 again
    scheduler.plan(step())  # the load's own hold (rule 1) has expired
    assert scheduler.guard.orphaned
    # nothing runs in the manager, so vLLM's prefix cache resets, and nothing stale is left
    assert scheduler.match(hashed("b"), 4 * BS)[0] is not None
    assert not scheduler.guard.active
