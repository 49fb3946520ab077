"""The one cache-server handle, on real `kvkeep server` processes (no vLLM)."""

from __future__ import annotations

from kvkeep.bench.deploy.cache import CacheServer, CacheSpec


def test_cache_server_restarts_dies_and_is_replaced() -> None:
    with CacheServer(CacheSpec(ram="64MiB", disk="64MiB"), name="test") as cache:
        assert cache.stats() is not None
        first = cache.pid
        (cache.directory / "marker").write_text("state")
        cache.kill()
        assert cache.stats() is None, "a killed server answers nothing"
        cache.restart("sigkill")
        assert cache.pid not in (None, first) and cache.stats() is not None
        assert (cache.directory / "marker").exists(), "a restart keeps the state directory"
        cache.replace_host()
        assert not (cache.directory / "marker").exists(), "a new host starts empty"
        assert cache.stats() is not None
        directory = cache.directory
    assert not directory.exists(), "close() deletes the state"


def test_remote_arguments_only_with_a_store() -> None:
    spec = CacheSpec(extra_args=("--queue-depth", "8"))
    assert spec.args(None) == ("--queue-depth", "8")
    assert spec.args("valkey://h:1")[:2] == ("--remote", "valkey://h:1")
    assert spec.args("valkey://h:1")[-2:] == ("--queue-depth", "8")
