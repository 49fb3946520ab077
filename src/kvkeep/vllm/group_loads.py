"""Asynchronous loads of a request that span several KV cache groups, counted to one answer.

Under vLLM's hybrid KV cache manager each group has its own block ids, and kvkeep loads each
group's blocks on its own worker-side loader. vLLM wants one answer per request: it is
finished (``finished_recving``) when every group's load of it has ended, and failed
(``failed_recving``, which makes vLLM recompute it from scratch) if any group's did. Free of
vllm; not thread-safe (the worker's step thread is its only caller).
"""

from __future__ import annotations

from typing import NamedTuple


class LoadsEnded(NamedTuple):
    """Requests whose loads ended in every group since the last ``take``; ``failed`` is the
    subset with a block that did not load in some group."""

    finished: set[str]
    failed: set[str]


class GroupLoads:
    """Per request, how many groups' loads are still out and whether one failed."""

    def __init__(self) -> None:
        self._out: dict[str, int] = {}
        self._failed: set[str] = set()
        self._ended = LoadsEnded(set(), set())

    def expect(self, req_id: str, groups: int) -> None:
        """A request's loads were started in ``groups`` more groups."""
        self._out[req_id] = self._out.get(req_id, 0) + groups

    def ended(self, req_id: str, failed: bool) -> None:
        """One group's load of ``req_id`` ended. A report for a request never expected
        (it cannot happen; the loaders report what was submitted) ends it at once."""
        if failed:
            self._failed.add(req_id)
        left = self._out.get(req_id, 1) - 1
        if left > 0:
            self._out[req_id] = left
            return
        self._out.pop(req_id, None)
        self._ended.finished.add(req_id)
        if req_id in self._failed:
            self._failed.discard(req_id)
            self._ended.failed.add(req_id)

    def take(self) -> LoadsEnded:
        """What ended since the last call, and reset."""
        ended, self._ended = self._ended, LoadsEnded(set(), set())
        return ended

    @property
    def pending(self) -> int:
        return len(self._out)
