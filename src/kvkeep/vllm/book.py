"""The scheduler side's book of requests, free of vllm: what to claim, load and save.

The scheduler side feeds it plain values (token ids, block ids, token counts) and ships the
``StepPlan`` it returns to the workers; everything here is deterministic and testable without
an engine. kvkeep may supply blocks ``[local_blocks, limit)``, with ``local`` vLLM's own
(block-aligned) prefix-cache hit and ``limit = (num_tokens - 1) // bs``: at least one token is
always left to compute (a synchronous load of the whole prompt trips vLLM's
``num_new_tokens > 0`` assert).

No wrong KV is ever saved. A step with a failed synchronous load saves nothing, and save
frontiers move back: to the first block planned in that step (``on_load_errors``) and to what
vLLM still counts as computed (``rewind``, every step). A failed asynchronous load costs no
saves: ``on_alloc`` starts the returning request's frontier at what vLLM counts as computed,
and it gets no further claims (``on_loads_finished``). Why: docs/notes/request-book.md.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvkeep.keys import BlockKey, Namespace
from kvkeep.vllm.chains import RequestKeys
from kvkeep.vllm.plan import BlockTransfer, RequestLoad, StepPlan

# --- claims -------------------------------------------------------------------------------


class ClaimRange(NamedTuple):
    """Blocks ``[first, limit)`` kvkeep may supply; empty when ``first >= limit``."""

    first: int
    limit: int

    @property
    def empty(self) -> bool:
        return self.first >= self.limit


def claim_range(num_tokens: int, num_computed_tokens: int, block_size: int) -> ClaimRange:
    """The blocks beyond vLLM's local hit that kvkeep may claim. Pure.

    A local hit that ends mid-block gets no claim (vLLM passes aligned values; anything else
    is a case we do not reason about). ``limit`` leaves at least one token to compute.
    """
    if num_computed_tokens % block_size:
        return ClaimRange(0, 0)
    first = num_computed_tokens // block_size
    limit = max(num_tokens - 1, 0) // block_size
    return ClaimRange(first, max(first, limit))


class Match(NamedTuple):
    """A cached answer to "how many tokens can kvkeep supply" for one admission attempt."""

    num_computed_tokens: int
    num_tokens: int
    num_blocks: int  # blocks kvkeep has from ``num_computed_tokens // block_size`` on
    background: bool | None = None  # what vLLM was told (None: ``in_background`` decides)


# --- per-request bookkeeping ----------------------------------------------------------------


@dataclass
class _Tracked:
    """A running request: its keys so far, engine block table, and the save frontier.

    Invariant: blocks ``[0, saved)`` need no save (vLLM had them, kvkeep loaded them, or
    they were planned for saving already). ``saved`` only moves back when a load failed
    (see the module docstring).
    """

    keys: list[BlockKey]
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    save_from: int = 0  # a sliding-window group saves no block before this one
    prompt_blocks: int = 0  # the claimable blocks of its prompt (a state group's last boundary)
    branch: int = 0  # where, in blocks, kvkeep's prefix ended and this prompt went on


class RequestBook:
    """The scheduler side's memory of requests, between vLLM's callbacks, for one KV cache
    group. Not thread-safe (vLLM's scheduler is single-threaded).

    A sliding-window group (``window`` tokens) keeps, like vLLM's hybrid KV cache manager,
    only the blocks a hit needs: for a hit of N tokens the blocks from
    ``window_start(N)`` to N. Its block table holds ``null_block`` elsewhere. It loads only
    those blocks and saves, of each request, the blocks from the window before its prompt's
    claimable end on (``save_from``): enough for the same prompt, or one that extends it, to
    hit after a restart, and about one window per request stored::

        prompt blocks  [0 ........... save_from ......... limit | last)
        saved          [  never        | window_blocks blocks   | and later ones, when full)
    """

    def __init__(
        self,
        namespace: Namespace,
        load_async_min_blocks: int | None = None,
        window: int | None = None,
        null_block: int = 0,
        sync_when_alone: bool = False,
        state: bool = False,
        state_boundaries: str = "reused",
    ) -> None:
        self.namespace = namespace
        # A recurrent-state group: a hit needs only the state at its last boundary (a window
        # of one block), and its saves are the snapshots vLLM hands over (``state_saves``).
        self.state = state
        self.state_boundaries = state_boundaries
        if state and window != namespace.block_size:
            raise ValueError("a state group's window is one block")
        self.block_size = namespace.block_size
        self.load_async_min_blocks = load_async_min_blocks
        self.sync_when_alone = sync_when_alone
        self.window = window
        self.null_block = null_block
        self._roots: dict[str | None, BlockKey] = {}
        self._keys = RequestKeys(self.block_size)
        self.chains = self._keys.recent  # finished requests' keys, that new ones extend
        self._matches: dict[str, Match] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[RequestLoad] = []
        # For each of the last two plans (the failed step's, and under async scheduling the
        # one built before its outcome was known): req_id -> the first block it planned to
        # save. vLLM reports outputs only when they hold something, so plans are not paired
        # with outcomes; rewinding one plan too many only re-plans blocks the server skips.
        self._recent: deque[dict[str, int]] = deque(maxlen=2)
        self._planning: dict[str, int] = {}  # the same, for the plan being built
        self._in_flight: dict[str, frozenset[int]] = {}  # asynchronous loads: their blocks
        self._no_claims: set[str] = set()  # requests whose asynchronous load failed
        self._branches: dict[str, int] = {}  # req_id -> kvkeep's prefix at admission, blocks

    # keys ---------------------------------------------------------------------------------

    def root_for(self, cache_salt: str | None) -> BlockKey:
        """The chain root of requests with this salt (memoised; pure function of inputs)."""
        if cache_salt not in self._roots:
            ns = dataclasses.replace(self.namespace, cache_salt=cache_salt)
            self._roots[cache_salt] = ns.root_key()
        return self._roots[cache_salt]

    def keys_for(self, req_id: str, tokens: Sequence[int], salt: str | None) -> list[BlockKey]:
        """Keys of every full block of ``tokens``, extending the request's memoised chain
        (``RequestKeys``: a new request starts from a recent one it extends)."""
        return self._keys.keys_for(req_id, self.root_for(salt), tokens)

    # windows ------------------------------------------------------------------------------

    def window_start(self, num_tokens: int) -> int:
        """The first block a hit of ``num_tokens`` tokens needs in this group (0 for full
        attention). vLLM's rule (``SlidingWindowManager.get_num_skipped_tokens``): the next
        token attends to the last ``window - 1`` tokens, the ones before are skipped."""
        if self.window is None:
            return 0
        return max(0, num_tokens - self.window + 1) // self.block_size

    def _holds_kv(self, block_id: int) -> bool:
        return self.window is None or block_id != self.null_block

    # admission ----------------------------------------------------------------------------

    def cached_match(self, req_id: str, num_computed: int, num_tokens: int) -> Match | None:
        """The answer given before for exactly these inputs, if any. No side effects."""
        match = self._matches.get(req_id)
        if match is None or match[:2] != (num_computed, num_tokens):
            return None
        return match

    def remember_match(self, req_id: str, match: Match) -> None:
        self._matches[req_id] = match

    def local_blocks(self, req_id: str) -> int:
        """Blocks of vLLM's own cache hit in the admission ``remember_match`` last saw (0 if
        none). Call it before ``on_alloc``, which consumes that memory. No side effects."""
        match = self._matches.get(req_id)
        return match.num_computed_tokens // self.block_size if match else 0

    def leading_keys(self, req_id: str, count: int) -> list[BlockKey]:
        """The first ``count`` block keys of a tracked request ([] if untracked). Pure."""
        tracked = self._tracked.get(req_id)
        return tracked.keys[:count] if tracked is not None else []

    def block_tables(self) -> dict[str, list[int]]:
        """Every tracked request's block table, by request id. No side effects."""
        return {req_id: tracked.block_ids for req_id, tracked in self._tracked.items()}

    def claims_for(self, req_id: str) -> bool:
        """Whether kvkeep may claim blocks for this request. Not after its asynchronous load
        failed: vLLM then admits it again from its valid prefix (from scratch when that is
        empty, asking for a claim again), and a fault that fails every load at once (a cache
        server that is down for the workers only) would cycle it through loads for nothing."""
        return req_id not in self._no_claims

    def on_loads_finished(
        self,
        finished: set[str],
        invalid_block_ids: set[int],
        failed_requests: frozenset[str] | set[str] = frozenset(),
    ) -> set[str]:
        """Asynchronous loads vLLM reports ended (``finished_recving``), with the step's failed
        blocks and the requests reported failed as a whole (``failed_recving``, the only way
        with several KV cache groups); the requests among them that failed, which get no
        further claims."""
        failed = finished & failed_requests
        for req_id in finished:
            blocks = self._in_flight.pop(req_id, frozenset())
            if blocks & invalid_block_ids:
                failed.add(req_id)
        self._no_claims |= failed & set(self._tracked)
        return failed

    def in_background(self, num_blocks: int, others: int = 1) -> bool:
        """Whether a load of ``num_blocks`` blocks, ``others`` requests running beside it, is
        asynchronous. Pure. Small hits stay synchronous (an asynchronous load costs its request
        a step or more); with ``sync_when_alone`` so do all that no other request runs beside."""
        threshold = self.load_async_min_blocks
        if self.sync_when_alone and others <= 0:
            return False
        return num_blocks > 0 and threshold is not None and num_blocks >= threshold

    def on_alloc(
        self,
        req_id: str,
        tokens: Sequence[int],
        salt: str | None,
        block_ids: Sequence[int],
        num_external_tokens: int,
        num_computed_tokens: int = 0,
    ) -> RequestLoad | None:
        """Start (or restart, after preemption) tracking a request whose slots vLLM just
        allocated; queue its load for the next plan. Returns the load, if any.

        ``block_ids`` is the request's whole block table. The external blocks sit right after
        the local hit remembered by the last ``remember_match`` (0 if none).
        ``num_computed_tokens`` is what vLLM counts as computed already: non-zero when a
        request comes back after its asynchronous load (vLLM then passes no external tokens,
        and the loaded blocks, truncated at the first failed one, need no save).
        """
        match = self._matches.pop(req_id, None)
        local = match.num_computed_tokens // self.block_size if match else 0
        external = num_external_tokens // self.block_size
        keys = self.keys_for(req_id, tokens, salt)
        saved = max(local + external, num_computed_tokens // self.block_size)
        limit = claim_range(len(tokens), 0, self.block_size).limit
        save_from = self.window_start(limit * self.block_size)
        tracked = _Tracked(keys, list(block_ids), saved, save_from, limit)
        tracked.branch = self._branches.pop(req_id, 0)
        self._tracked[req_id] = tracked
        if external == 0:
            return None
        span = range(
            max(local, self.window_start((local + external) * self.block_size)), local + external
        )
        blocks = tuple(
            BlockTransfer(block_ids[i], keys[i]) for i in span if self._holds_kv(block_ids[i])
        )
        if not blocks:
            return None
        told = match.background if match is not None else None
        load = RequestLoad(req_id, blocks, self.in_background(external) if told is None else told)
        if load.background:
            self._in_flight[req_id] = frozenset(b.block_id for b in blocks)
        self._loads.append(load)
        return load

    # every step ----------------------------------------------------------------------------

    def update_blocks(self, req_id: str, block_ids: Sequence[int], replace: bool) -> None:
        """Record blocks vLLM allocated for a later chunk or decode (``replace`` for a
        resumed request, whose list is the whole table). Unknown requests are ignored."""
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return
        if replace:
            tracked.block_ids = list(block_ids)
        else:
            tracked.block_ids.extend(block_ids)

    def rewind(self, req_id: str, num_computed: int) -> None:
        """vLLM counts ``num_computed`` tokens as computed before this step: blocks beyond
        them were not (or no longer) computed, whatever was planned. After a failed load vLLM
        truncates a request at its first failed block; this moves the frontier back with it,
        so the recompute is saved."""
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            tracked.saved = min(tracked.saved, num_computed // self.block_size)

    def on_load_errors(self) -> int:
        """A step whose connector output reported failed loads saved nothing (the worker drops
        such a step's saves): move each request's frontier back to the first block it planned
        in the last two plans. Returns how many requests were rewound."""
        rewound = 0
        for plan in self._recent:
            for req_id, first in plan.items():
                tracked = self._tracked.get(req_id)
                if tracked is not None and first < tracked.saved:
                    tracked.saved = first
                    rewound += 1
        self._recent.clear()
        return rewound

    def saves_after(
        self, req_id: str, num_computed_after: int, tokens: Sequence[int], salt: str | None
    ) -> list[BlockTransfer]:
        """Blocks that will be full once this step's forward has run, and are not yet saved;
        advances the save frontier past them. Works the same for every prefill chunk and for
        decode: a block is saved in the step that completes it, exactly once."""
        tracked = self._tracked.get(req_id)
        if tracked is None or self.state:  # a state group saves what vLLM offers
            return []
        full = min(num_computed_after, len(tokens)) // self.block_size
        full = min(full, len(tracked.block_ids))
        if full <= tracked.saved:
            return []
        keys = self.keys_for(req_id, tokens[: full * self.block_size], salt)
        span = range(max(tracked.saved, tracked.save_from), full)
        self._planning.setdefault(req_id, tracked.saved)
        tracked.saved = full
        ids = tracked.block_ids
        return [BlockTransfer(ids[i], keys[i]) for i in span if self._holds_kv(ids[i])]

    # recurrent state ------------------------------------------------------------------------

    def remember_branch(self, req_id: str, num_blocks: int) -> None:
        """How many leading blocks of a request's prompt kvkeep held at admission (its
        attention KV): where the prompt leaves what other prompts had. A state group keeps
        the snapshot there (the next prompt to share that prefix hits it)."""
        self._branches[req_id] = num_blocks

    def state_saves(
        self,
        req_id: str,
        offers: Sequence[tuple[int, int]],
        tokens: Sequence[int],
        salt: str | None,
    ) -> list[BlockTransfer]:
        """Of the states vLLM writes this step at block boundaries (``offers``: engine block,
        tokens summed up), those to keep, each under the chain key of the prefix it sums up.

        vLLM hands a boundary's state over in the scheduler output of the step whose forward
        writes it, and keeps its bytes only until that step ends (a finished request's blocks
        are free for the next one): the worker copies them out in the same step's
        ``wait_for_save``, after the forward. "reused" keeps what later prompts hit: the
        prompt's last claimable boundary (an agent's next turn extends the prompt), its
        reply's boundaries (the next turn holds the reply), and its branch point (a sibling
        sharing the prefix, e.g. a sub-agent's system prompt). A null block or a boundary
        inside a block (vLLM's partial tail) is never a state kvkeep keys."""
        tracked = self._tracked.get(req_id)
        if tracked is None or not self.state:
            return []
        prompt = tracked.prompt_blocks
        wanted = []
        for block_id, boundary in offers:
            blocks, partial = divmod(boundary, self.block_size)
            if partial or blocks < 1 or boundary > len(tokens) or block_id == self.null_block:
                continue
            if (
                self.state_boundaries == "every"
                or blocks in (prompt, tracked.branch)
                or (blocks > prompt)
            ):
                wanted.append((block_id, blocks))
        if not wanted:
            return []
        last = max(blocks for _, blocks in wanted)
        keys = self.keys_for(req_id, tokens[: last * self.block_size], salt)
        return [BlockTransfer(block_id, keys[blocks - 1]) for block_id, blocks in wanted]

    def take_plan(self, saves: Sequence[BlockTransfer]) -> StepPlan:
        """This step's plan; drains the queued loads (each load is shipped exactly once).
        Remembers which requests planned saves, for ``on_load_errors``."""
        loads, self._loads = tuple(self._loads), []
        self._recent.append(self._planning)
        self._planning = {}
        return StepPlan(self.namespace, loads, tuple(saves))

    def finish(self, req_id: str) -> None:
        """Forget a finished or aborted request. Idempotent."""
        self._tracked.pop(req_id, None)
        self._keys.finish(req_id)
        self._matches.pop(req_id, None)
        self._in_flight.pop(req_id, None)
        self._no_claims.discard(req_id)
        self._branches.pop(req_id, None)

    def tracking(self, req_id: str) -> bool:
        return req_id in self._tracked

    def __len__(self) -> int:
        return len(self._tracked)
