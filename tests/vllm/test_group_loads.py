"""One answer per request for loads that span several KV cache groups."""

from __future__ import annotations

from kvkeep.vllm.group_loads import GroupLoads


def test_a_request_ends_when_its_last_group_does_and_fails_if_any_group_did() -> None:
    loads = GroupLoads()
    loads.expect("a", 3)
    loads.expect("b", 2)
    loads.ended("a", failed=False)
    loads.ended("b", failed=True)
    assert loads.take().finished == set()
    loads.ended("a", failed=True)
    loads.ended("b", failed=False)
    ended = loads.take()
    assert ended.finished == {"b"} and ended.failed == {"b"}
    loads.ended("a", failed=False)
    ended = loads.take()
    assert ended.finished == {"a"} and ended.failed == {"a"}
    assert loads.pending == 0
    assert loads.take().finished == set(), "each request is reported once"


def test_a_clean_load_is_not_failed() -> None:
    loads = GroupLoads()
    loads.expect("a", 2)
    loads.ended("a", failed=False)
    loads.ended("a", failed=False)
    assert loads.take() == ({"a"}, set())
