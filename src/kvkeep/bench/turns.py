"""Modes that take turns: one scenario run in several modes at once, unit by unit.

With the modes' engines up together (`suite.run_modes`, ``Setup.together``), each mode runs
the scenario on a thread of its own, and a `Turnstile` lets one of them through at a time,
in a fixed rotation, after a quiet machine (`kvkeep.bench.quiet`). A scenario marks its
units (a session's turn, one timed request, one trial) with ``ctx.turn()`` or
``ctx.aturn()`` and says so in its needs (``Needs.turns``); one that does not is a single
unit. Modes then measure their first units, then their second ones, and so on, seconds
apart, so a machine whose speed drifts over tens of seconds drifts for every mode alike.

A turn lasts at least ``QUANTUM_S``: a member whose units are shorter keeps the turn for its
next ones. Each change of turn waits for a quiet machine, 1.3 s or more after a request
(vLLM polls for 1 s after its last step), which per request tripled S1's time in `bench all
--quick` with three modes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from kvkeep.bench.quiet import wait_for_quiet

# 6 s, not 2: on an AVX2-only CPU a request of S1 or S2 takes 1-3 s, so with 2 s nearly every
# request changed turns and waited for a quiet machine (1.3 s or more each); the waits came to
# 215 s of a 32-minute demo there, and still 73 s of a 14-minute one at 4 s. Modes still
# alternate seconds apart, well within the drift of the machine's speed.
QUANTUM_S = 6.0


def settle() -> None:
    """Wait for a quiet machine; say so where it did not get quiet."""
    waited, quiet = wait_for_quiet()
    if not quiet:
        print(
            f"kvkeep bench: the machine was still busy after {waited:.0f} s; going on",
            file=sys.stderr,
        )


class Turnstile:
    """One member at a time, in the rotation given; a member that leaves drops out of it.

    ``acquire`` waits for the member's turn, then for ``settle``; it is re-entrant for the
    member that holds the turn. ``release`` passes the turn to the next member once the
    member has held it for ``quantum_s`` (None: QUANTUM_S); until then its next ``acquire``
    goes straight on. A member that has left (it finished, or failed) is let through at once,
    alone: it is not in the rotation any more. A member that takes the turn back from itself
    (the only one left, or alone from the start) skips ``settle``: no other member's work ran
    in between to settle. The first turn of all settles (deployments just started).

    ``held[member]``: the seconds it has held the turn, settling not counted; what each mode
    cost the run (`make demo` reports them per scenario)."""

    def __init__(
        self,
        members: Sequence[str],
        settle: Callable[[], None] = settle,
        quantum_s: float | None = None,
    ) -> None:
        self._order = list(members)
        self._next = 0
        self._holder: str | None = None
        self._last: str | None = None  # the member whose turn ended last
        self._depth = 0
        self._since = 0.0  # when the holder's turn began
        self._quantum = QUANTUM_S if quantum_s is None else quantum_s
        self._settle = settle
        self._cond = threading.Condition()
        self.held: dict[str, float] = dict.fromkeys(self._order, 0.0)

    @property
    def members(self) -> list[str]:
        with self._cond:
            return list(self._order)

    def acquire(self, member: str) -> None:
        with self._cond:
            if self._holder == member:
                self._depth += 1
                return
            while member in self._order and (
                self._holder is not None or self._order[self._next] != member
            ):
                self._cond.wait()
            if member not in self._order:
                return
            self._holder, self._depth = member, 1
            after_another = self._last != member  # None: the first turn of all
        if after_another:
            self._settle()
        with self._cond:
            self._since = time.monotonic()

    def release(self, member: str) -> None:
        with self._cond:
            if self._holder != member:
                return
            self._depth -= 1
            if self._depth or time.monotonic() - self._since < self._quantum:
                return  # a unit within the turn, or the turn is not over: the holder keeps it
            self._count(member)
            self._holder, self._last = None, member
            self._next = (self._order.index(member) + 1) % len(self._order)
            self._cond.notify_all()

    def leave(self, member: str) -> None:
        with self._cond:
            if member not in self._order:
                return
            i = self._order.index(member)
            self._order.remove(member)
            if self._holder == member:
                self._count(member)
                self._holder, self._depth, self._last = None, 0, member
            if self._order:
                if self._next > i:
                    self._next -= 1
                self._next %= len(self._order)
            self._cond.notify_all()

    def _count(self, member: str) -> None:
        """Add the turn ending now to ``held`` (with the lock held)."""
        self.held[member] = self.held.get(member, 0.0) + time.monotonic() - self._since

    @contextlib.contextmanager
    def turn(self, member: str) -> Iterator[None]:
        self.acquire(member)
        try:
            yield
        finally:
            self.release(member)
