"""The connector's scheduler side (EngineCore): claims, per-request tracking, the step plan.

It LOOKUPs kvkeep's keys for a waiting request's prompt blocks beyond vLLM's own hit and
claims the leading present ones, tracks every running request's block table, and emits each
step's ``StepPlan`` (loads, and blocks that become full, to save). The arithmetic lives in
:mod:`kvkeep.vllm.book`; this module feeds it vLLM's values and never raises into vLLM.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kvkeep.server.client import CacheUnavailable, KVKeepClient
from kvkeep.vllm import compat
from kvkeep.vllm.book import ClaimRange, Match, RequestBook, claim_range
from kvkeep.vllm.counters import Counters
from kvkeep.vllm.guard import SyncLoadGuard, first_failed, tails_from
from kvkeep.vllm.plan import BlockTransfer, StepPlan
from kvkeep.vllm.touch import TouchQueue

if TYPE_CHECKING:
    pass

log = logging.getLogger("vllm.kvkeep")

PENDING_BACKEND = "pending"  # no key is made under it (``SchedulerSide._backend_known``)
# How far a hybrid's claim steps back, in boundaries, looking for one with a state in every
# state group: one LOOKUP of one key per group and step (about 0.1 ms on a local socket).
# States sit at each prompt's last boundary and reply, so a new turn finds one within its
# new tokens (Claude Code turns add 1-5k tokens: a few 256-token blocks).
STATE_STEPS_BACK = 64


class SchedulerSide:
    """Claims, per-request tracking and the step plan. Every vLLM callback here is wrapped so
    that a kvkeep failure means "no hit" and never an exception in the scheduler."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        client: KVKeepClient,
        load_async_min_blocks: int | None = None,
        sync_when_alone: bool = False,
        state_boundaries: str = "reused",
    ) -> None:
        self.vllm_config = vllm_config
        self._state_boundaries = state_boundaries
        windows = compat.group_windows(kv_cache_config)
        self._states = compat.group_states(kv_cache_config, len(windows))
        # With several KV cache groups vLLM takes load failures only as whole requests of
        # asynchronous loads (``failed_recving``), so every load is asynchronous there.
        self.hybrid = len(windows) > 1
        threshold = 1 if self.hybrid else load_async_min_blocks
        if self.hybrid and load_async_min_blocks != 1:
            log.info(
                "kvkeep: %d KV cache groups: every load is asynchronous (vLLM fails a "
                "hybrid's loads only as whole requests of asynchronous loads); "
                "load_async_min_blocks=%s does not apply",
                len(windows),
                load_async_min_blocks,
            )
        self.client = client
        self._configs = (vllm_config, kv_cache_config)
        self._threshold, self._windows = threshold, windows
        self._windowed = [g for g, w in enumerate(windows) if w is not None]
        self._sync_when_alone = sync_when_alone and not self.hybrid
        # On CPU, and for MLA (whose backend only a worker's layers name), the workers'
        # connector handshake brings the backend, before any request.
        latent = compat.latent(kv_cache_config)
        backend = None if latent else compat.known_backend(vllm_config)
        self.backend_pending = backend is None
        self._open(backend or PENDING_BACKEND)
        self.counters = Counters()
        self._requests: dict[str, Any] = {}  # req_id -> vLLM Request, while tracked
        self._unkeyable: set[str] = set()  # req_ids counted as unkeyable, until finished
        self.touches = TouchQueue(client.sibling())  # keeps vLLM's device hits warm
        self.guard = SyncLoadGuard(compat.plans_in_flight(vllm_config))  # see kvkeep.vllm.guard
        # vLLM's KV cache manager, bound at start-up (``bind``): rule 2 of the guard evicts
        # through it, and without it no load may be synchronous.
        self._kv_cache_manager: Any = None
        self._can_evict = False  # False also once an eviction raised
        self._said_async_only = False
        if not self.backend_pending:
            self._announce(client.socket_path)

    def _open(self, backend: str) -> None:
        """The books and sessions of every KV cache group, keyed under ``backend``."""
        vllm_config, kv_cache_config = self._configs
        self.books = [
            RequestBook(
                compat.namespace(vllm_config, kv_cache_config, g, backend),
                self._threshold,
                window,
                compat.NULL_BLOCK_ID,
                self._sync_when_alone,
                self._states[g],
                self._state_boundaries,
            )
            for g, window in enumerate(self._windows)
        ]
        self.sessions = [
            self.client.session(
                book.namespace,
                compat.expected_block_bytes(kv_cache_config, g),
                label=compat.group_label("scheduler", g, self._windows, self._states),
            )
            for g, book in enumerate(self.books)
        ]
        self.book, self.session = self.books[0], self.sessions[0]
        # the group whose whole prefix a hit needs: the one refreshed for vLLM's device hits
        self._hot_group = next((g for g, b in enumerate(self.books) if b.window is None), 0)
        self.namespace = self.book.namespace

    def adopt_backend(self, backend: str) -> None:
        """The workers' attention backend, from vLLM's connector handshake at start-up (before
        any request), where the engine core does not know it (``compat.known_backend``)."""
        if not self.backend_pending:
            return
        self._open(backend)
        self.backend_pending = False
        self._announce(self.client.socket_path)

    def _backend_known(self) -> None:
        """Before the first key: a vLLM that made no handshake leaves it to be found here."""
        if self.backend_pending:
            log.info("kvkeep: no attention backend from the workers; finding it here")
            self.adopt_backend(compat.attention_backend(*self._configs))

    def _announce(self, socket_path: str | None) -> None:
        try:
            for session in self.sessions:
                self.client.hello(session.digest, session.block_bytes, session.label)
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
        more = f", {len(self.books)} KV cache groups" if self.hybrid else ""
        return f"{ns.digest().hex()[:12]} ({ns.backend}, {ns.layout}, block {ns.block_size}{more})"

    def bind(self, kv_cache_manager: Any) -> None:
        """vLLM's KV cache manager, bound once at start-up before any request. Rule 2 of
        :mod:`kvkeep.vllm.guard` needs its ``evict_blocks``; without it every load is
        asynchronous (said here, once)."""
        self._kv_cache_manager = kv_cache_manager
        self._can_evict = callable(getattr(kv_cache_manager, "evict_blocks", None))
        if not self._can_evict:
            self._async_only(
                f"vLLM's KV cache manager ({type(kv_cache_manager).__name__}) cannot evict blocks"
            )

    def _sync_loads_safe(self) -> bool:
        """Whether a synchronous load may be planned: a failed one's blocks can be evicted."""
        if self._kv_cache_manager is None:
            self._async_only("vLLM bound no KV cache manager to the connector")
        return self._can_evict

    def _async_only(self, why: str) -> None:
        if not self._said_async_only and not self.hybrid:
            self._said_async_only = True
            log.warning(
                "kvkeep: %s, so a failed synchronous load's blocks could not leave "
                "vLLM's prefix cache; every load is asynchronous (counted as "
                "sync_loads_refused)",
                why,
            )

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvkeep can supply beyond ``num_computed_tokens``, and whether they load in
        the background (vLLM's ``load_async``); (0, False) on any failure. Idempotent for
        repeated calls with the same inputs (the answer is memoised). None ("ask again next
        step") while vLLM's own hit covers blocks of a synchronous load whose outcome is not
        known yet (:mod:`kvkeep.vllm.guard`)."""
        try:
            self._backend_known()
            # Before anything else: vLLM admits any request over its hit, keyable or not.
            if self._on_unconfirmed_blocks(request, num_computed_tokens):
                self.counters.add("admissions_deferred", 1)
                return None, False
            if compat.unkeyable_reason(request) is not None:
                return 0, False  # no LOOKUP; after_alloc counts the reason once
            with self.counters.timed("match_s"):
                match = self._match(request, num_computed_tokens)
        except Exception:
            log.exception("kvkeep: lookup failed; treating it as a miss")
            self.counters.add("lookup_failures", 1)
            return 0, False
        background = match.background
        if background is None:
            background = self.book.in_background(match.num_blocks)
        return match.num_blocks * self.book.block_size, background

    def _on_unconfirmed_blocks(self, request: Any, num_computed: int) -> bool:
        """Whether vLLM's hit (its first ``num_computed`` tokens, by vLLM's block hashes)
        covers a block the guard holds. Orphaned blocks go once vLLM's prefix cache can be
        reset (nothing runs)."""
        if not self.guard.active or num_computed < self.book.block_size:
            return False
        hashes = compat.vllm_block_hashes(request)[: num_computed // self.book.block_size]
        if not self.guard.covers(hashes):
            return False
        reset = getattr(self._kv_cache_manager, "reset_prefix_cache", None)
        if self.guard.orphaned and reset is not None:
            with contextlib.suppress(Exception):
                if reset():
                    self.guard.clear_orphaned()
                    log.info(
                        "kvkeep: vLLM's prefix cache was reset: no block a failed load "
                        "left in it can be hit any more"
                    )
                    return self.guard.covers(hashes)
        return True

    def _match(self, request: Any, num_computed: int) -> Match:
        """The memoised answer, or a new one: blocks found and whether they load in the
        background, decided once per admission attempt (vLLM asks again with the same inputs,
        and ``after_alloc`` must plan the load the way vLLM was told)."""
        req_id, num_tokens = request.request_id, request.num_tokens
        cached = self.book.cached_match(req_id, num_computed, num_tokens)
        if cached is not None:
            return cached
        if not self.book.claims_for(req_id):
            return Match(num_computed, num_tokens, 0)
        claim = claim_range(num_tokens, num_computed, self.book.block_size)
        found = self._lookup_groups(request, claim) if self.hybrid else self._lookup(request, claim)
        others = len(self._requests) - (req_id in self._requests)  # running, or loading
        background = self.book.in_background(found, others)
        if found and not background and not self.hybrid and not self._sync_loads_safe():
            background = True
            self.counters.add("sync_loads_refused", 1)
        match = Match(num_computed, num_tokens, found, background)
        for book in self.books:
            book.remember_match(req_id, match)
        return match

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

    def _lookup_groups(self, request: Any, claim: ClaimRange) -> int:
        """vLLM's hybrid hit rule over kvkeep's groups. The full-attention groups' common
        leading run from ``claim.first`` bounds the hit N; a sliding-window group needs its
        blocks ``[max(first, window_start(N)), N)`` and a state group the state at N's last
        boundary (a window of one block). Without state groups N stands or there is no hit (a
        shorter N would need more LOOKUPs, and saves keep the sliding blocks of the claimable
        ends that later prompts hit). With them, states exist at a few boundaries only
        (``RequestBook.state_saves``), so the claim steps back to the last boundary where
        every group has what it needs, at most ``STATE_STEPS_BACK`` boundaries."""
        if claim.empty:
            return 0
        self.counters.add("lookups", 1)
        hit = claim.limit
        for g, book in enumerate(self.books):
            if book.window is None:
                hit = claim.first + self._present(request, g, claim.first, hit)
        if any(self._states):
            for book in self.books:  # the attention prefix kvkeep holds: a state kept there
                book.remember_branch(request.request_id, hit)  # serves the next sibling
        steps = STATE_STEPS_BACK if any(self._states) else 1
        for n in range(hit, max(claim.first, hit - steps), -1):
            if all(self._window_present(request, g, claim.first, n) for g in self._windowed):
                return n - claim.first
        return 0

    def _window_present(self, request: Any, group: int, first: int, hit: int) -> bool:
        """Whether windowed (or state) group ``group`` holds what a hit of ``hit`` blocks
        needs from it."""
        book = self.books[group]
        start = max(first, book.window_start(hit * book.block_size))
        return self._present(request, group, start, hit) == hit - start

    def _present(self, request: Any, group: int, first: int, limit: int) -> int:
        """How many of group ``group``'s keys ``[first, limit)`` lead present (0 if down)."""
        if first >= limit:
            return 0
        book = self.books[group]
        keys = book.keys_for(
            request.request_id, compat.request_tokens(request), compat.request_salt(request)
        )
        try:
            with self.counters.timed("lookup_rpc_s"):
                return self.client.lookup(self.sessions[group], keys[first:limit]).num_present
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
            local = self.book.local_blocks(request.request_id)
            loads = [
                book.on_alloc(
                    request.request_id,
                    compat.request_tokens(request),
                    compat.request_salt(request),
                    compat.group_block_ids(blocks, g),
                    num_external_tokens,
                    request.num_computed_tokens,
                )
                for g, book in enumerate(self.books)
            ]
        except Exception:
            log.exception("kvkeep: could not track request %s", request.request_id)
            return
        self._requests[request.request_id] = request
        started = [load for load in loads if load is not None]
        if started:
            self.counters.add("offered_tokens", num_external_tokens)
            if started[0].background:
                self.counters.add("async_loads", 1)
            else:  # the loaded blocks and those this step computes on top of them
                self.guard.hold(compat.vllm_block_hashes(request)[local:])
        # The prefix vLLM serves from its own pool is in use: refresh it in kvkeep's RAM so
        # it outlives colder blocks there and is the first back after a vLLM restart.
        hot = self._hot_group
        keys = self.books[hot].leading_keys(request.request_id, local)
        self.touches.submit(self.sessions[hot], keys)

    def plan(self, out: Any) -> tuple[StepPlan, ...] | None:
        """This step's loads and saves, one plan per KV cache group; None (nothing to do) if
        planning itself failed."""
        try:
            with self.counters.timed("plan_s"):
                return self._plan(out)
        except Exception:
            log.exception("kvkeep: could not plan this step; skipping its loads and saves")
            return None
        finally:
            self.guard.planned()

    def _plan(self, out: Any) -> tuple[StepPlan, ...]:
        self._backend_known()
        return tuple(self._group_plan(out, g) for g in range(len(self.books)))

    def _group_plan(self, out: Any, group: int) -> StepPlan:
        book = self.books[group]
        saves: list[BlockTransfer] = []
        if book.state:
            saves = self._state_saves(book, group, compat.boundary_states(out))
        for new in out.scheduled_new_reqs:
            book.update_blocks(new.req_id, compat.new_block_ids_of(new.block_ids, group), True)
            self.guard.progress(new.req_id, new.num_computed_tokens, book.block_size)
            after = new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0)
            saves += self._saves(book, new.req_id, after)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = compat.new_block_ids_of(cached.new_block_ids[i], group)
            book.update_blocks(req_id, ids, req_id in cached.resumed_req_ids)
            book.rewind(req_id, cached.num_computed_tokens[i])
            self.guard.progress(req_id, cached.num_computed_tokens[i], book.block_size)
            after = cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(req_id, 0)
            saves += self._saves(book, req_id, after)
        return book.take_plan(saves)

    def _state_saves(
        self, book: RequestBook, group: int, offers: dict[str, list[tuple[int, int, int]]]
    ) -> list[BlockTransfer]:
        """The boundary states of ``group`` that vLLM offers this step and the book keeps."""
        saves: list[BlockTransfer] = []
        for req_id, entries in offers.items():
            request = self._requests.get(req_id)
            mine = [(block, tokens) for g, block, tokens in entries if g == group]
            if request is None or not mine:
                continue
            tokens = compat.request_tokens(request)
            saves += book.state_saves(req_id, mine, tokens, compat.request_salt(request))
        return saves

    def _saves(
        self, book: RequestBook, req_id: str, num_computed_after: int
    ) -> list[BlockTransfer]:
        request = self._requests.get(req_id)
        if request is None:
            return []
        return book.saves_after(
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

    def loads_finished(
        self, req_ids: set[str], invalid_block_ids: set[int], failed_requests: set[str]
    ) -> None:
        """vLLM reports asynchronous loads ended; those with a failed block, or reported
        failed as a whole, claim no more."""
        try:
            failed: set[str] = set()
            for book in self.books:
                failed |= book.on_loads_finished(req_ids, invalid_block_ids, failed_requests)
        except Exception:
            log.exception("kvkeep: could not record finished loads")
            return
        if failed:
            log.info(
                "kvkeep: asynchronous loads of %d requests failed; vLLM recomputes them",
                len(failed),
            )

    def load_errors(self, block_ids: set[int]) -> None:
        """A step reported failed loads: its saves were dropped; plan them again. The failed
        blocks, and what their requests hold after them, leave vLLM's prefix cache (rule 2
        of :mod:`kvkeep.vllm.guard`)."""
        try:
            rewound = sum(book.on_load_errors() for book in self.books)
        except Exception:
            log.exception("kvkeep: could not rewind the save frontiers")
            return
        evicted = self._evict(block_ids)
        log.info(
            "kvkeep: %d blocks failed to load (%d blocks out of vLLM's prefix cache); "
            "%d requests will save again after vLLM recomputes",
            len(block_ids),
            evicted,
            rewound,
        )

    def _evict(self, block_ids: set[int]) -> int:
        """Rule 2; where the eviction fails, the blocks are held from admissions until their
        owners computed them again, and no later load is synchronous."""
        if self.hybrid:  # hybrids fail whole asynchronous loads only
            return 0
        tables = self.book.block_tables()
        try:
            if not self._can_evict:
                raise RuntimeError("no KV cache manager that can evict was bound")
            tails = tails_from(tables.values(), block_ids)
            self._kv_cache_manager.evict_blocks(tails)
        except Exception:
            log.exception(
                "kvkeep: could not evict failed blocks from vLLM's prefix cache; "
                "holding admissions over them until they are computed again"
            )
            self.counters.add("evict_failures", 1)
            self._can_evict = False  # every load from here on is asynchronous
            for req_id, first in first_failed(tables, block_ids).items():
                request = self._requests.get(req_id)
                if request is not None:
                    hashes = compat.vllm_block_hashes(request)[first:]
                    self.guard.hold_until_recomputed(req_id, first, hashes)
            return 0
        self.counters.add("blocks_evicted", len(tails))
        return len(tails)

    def finished(self, req_id: str) -> None:
        for book in self.books:
            book.finish(req_id)
        self._requests.pop(req_id, None)
        self._unkeyable.discard(req_id)
        self.guard.release(req_id)
