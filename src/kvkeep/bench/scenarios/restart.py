"""`kvkeep bench restart` (S4): what a cache is worth after a restart.

Warm up on a set of long documents, restart vLLM, and query them again. vLLM's own prefix
cache lives in the engine and starts cold again; kvkeep's cache server outlives the engine.
For kvkeep the cache server itself is then restarted, once with SIGTERM (it flushes) and once
with SIGKILL (it may lose writes in flight, never integrity), and the documents are queried
again with vLLM's device cache emptied first (`/reset_prefix_cache`), so the hits can only
come from kvkeep's disk tier. Mode `none` is not run: without a cache nothing survives, and
mode `vllm` gives the restart-to-ready baseline (the study saw LMCache add 20-30 s).

`--remote [URL]` (`RemoteRestartScenario`): host A, a vLLM with its own cache server on a
shared Valkey/Redis, serves the documents cold, then from its kvkeep RAM (device cache
emptied), and is lost: its state is deleted. Host B, an empty cache server on the same store
and a fresh vLLM, serves them again: every hit it gets comes from the remote tier.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from kvkeep.bench.context import RunContext
from kvkeep.bench.prompts import documents, query, reset_device_cache
from kvkeep.bench.scenario import Needs
from kvkeep.plan.footprint import footprint_from_file
from kvkeep.workload import QUESTION_TOKENS, random_ids


@dataclass(frozen=True)
class RestartSpec:
    docs: int = 4  # after a restart the first takes the one-time costs; the rest are timed
    doc_tokens: int = 8192
    block_size: int = 128
    seed: int = 0

    def validate(self) -> None:
        if self.docs < 2:
            raise ValueError("--docs must be at least 2: one takes a restart's first-request cost")
        if self.doc_tokens < 2 * self.block_size:
            raise ValueError(f"--doc-tokens must be at least {2 * self.block_size}")

    @property
    def tokens(self) -> int:
        return self.doc_tokens + QUESTION_TOKENS + 64


@dataclass
class RestartScenario:
    spec: RestartSpec = RestartSpec()
    name: str = "restart"

    def needs(self) -> Needs:
        return Needs(tokens=self.spec.tokens, modes=("vllm", "kvkeep"), own_engine=True)

    def run(self, ctx: RunContext) -> dict[str, Any]:
        """The whole sequence on the context's engine (and cache server), restarting both."""
        self.spec.validate()
        docs = documents(self.spec.docs, self.spec.doc_tokens, f"restart:{self.spec.seed}:"
                         f"{time.time_ns()}")  # fmt: skip
        out: dict[str, Any] = {"first_ready_s": ctx.engine.ready_s}
        out["warmup"] = query(ctx.probe(), docs, self.spec.block_size)
        out["warm"] = query(ctx.probe(), docs, self.spec.block_size)
        out["restart_ready_s"] = ctx.engine.restart()
        out["after_engine_restart"] = self._after_restart(ctx, docs)
        if ctx.cache is not None:
            for how in ("sigterm", "sigkill"):
                ctx.cache.restart(how)
                reset_device_cache(ctx.url)
                out[f"after_server_{how}"] = self._after_restart(ctx, docs)
        return flatten(out)

    def _after_restart(self, ctx: RunContext, docs: list[list[int]]) -> dict[str, Any]:
        """Query after a restart. The first request after any start is slow in every mode
        (and maps the new arena with kvkeep): the first document takes that cost, unmeasured;
        its hits still count, so a cache that lost it shows."""
        canary = query(ctx.probe(), docs[:1], self.spec.block_size)
        rest = query(ctx.probe(), docs[1:], self.spec.block_size)
        n = len(docs) - 1
        hit = (canary["hit_rate"] + n * rest["hit_rate"]) / (n + 1)
        return {**rest, "hit_rate": hit, "canary_ttft_s": canary["ttft_s"]}


def flatten(out: dict[str, Any]) -> dict[str, Any]:
    """Top-level figures the report and acceptance read, plus the phases in full."""
    flat: dict[str, Any] = {
        "cold_ttft_s": out["warmup"]["ttft_s"],
        "warm_ttft_s": out["warm"]["ttft_s"],
        "restart_ready_s": out["restart_ready_s"],
        "first_ready_s": out["first_ready_s"],
        "after_engine_restart_hit_rate": out["after_engine_restart"]["hit_rate"],
        "after_engine_restart_ttft_s": out["after_engine_restart"]["ttft_s"],
    }
    for how in ("sigterm", "sigkill"):
        phase = out.get(f"after_server_{how}")
        flat[f"after_server_{how}_hit_rate"] = phase["hit_rate"] if phase else None
        flat[f"after_server_{how}_ttft_s"] = phase["ttft_s"] if phase else None
    hits = [flat[f"after_server_{h}_hit_rate"] for h in ("sigterm", "sigkill")]
    flat["after_server_restart_hit_rate"] = None if None in hits else min(hits)
    flat["phases"] = {k: v for k, v in out.items() if isinstance(v, dict)}
    return flat


@dataclass
class RemoteRestartScenario:
    """A host lost and replaced; see the module doc."""

    spec: RestartSpec = RestartSpec(docs=2, doc_tokens=16384)
    name: str = "restart_remote"

    def needs(self) -> Needs:
        return Needs(tokens=self.spec.tokens, modes=("kvkeep",), own_engine=True,
                     shared_store=True)  # fmt: skip

    def run(self, ctx: RunContext) -> dict[str, Any]:
        self.spec.validate()
        docs = documents(self.spec.docs, self.spec.doc_tokens, f"remote:{self.spec.seed}:"
                         f"{time.time_ns()}")  # fmt: skip
        bytes_per_token = footprint_from_file(ctx.model / "config.json").bytes_per_token()
        out: dict[str, Any] = {"kv_bytes_per_token": int(bytes_per_token)}
        cold, ram, a_remote = self._host(ctx, docs, wait_sent=True)
        out.update(cold=cold, ram=ram, a_remote=a_remote)
        assert ctx.cache is not None
        ctx.cache.replace_host()
        ctx.engine.restart()
        remote, ram_b, b_remote = self._host(ctx, docs, wait_sent=False)
        out.update(remote=remote, ram_after_remote=ram_b, b_remote=b_remote)
        return summarize_remote(out, self.spec.doc_tokens)

    def _host(
        self, ctx: RunContext, docs: list[list[int]], wait_sent: bool
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The documents once, then again with vLLM's device cache emptied; then the remote
        tier's counters. A fresh vLLM's first request pays one-off start-up costs (measured:
        8.2 s for a 16k remote hit that took 0.2-0.5 s once warm): a short one takes them."""
        assert ctx.cache is not None
        query(ctx.probe(), [random_ids(300, f"warm-up:{ctx.url}")], self.spec.block_size)
        first = query(ctx.probe(), docs, self.spec.block_size)
        reset_device_cache(ctx.url)
        second = query(ctx.probe(), docs, self.spec.block_size)
        sent = {"all_sent": ctx.cache.wait_sent()} if wait_sent else {}
        stats = {**(ctx.cache.stats() or {})["tiers"]["remote"], **sent}
        return first, second, stats


def summarize_remote(out: dict[str, Any], doc_tokens: int) -> dict[str, Any]:
    """The figures the report needs on top, the phases in full below."""
    phases = ("cold", "ram", "remote", "ram_after_remote")
    flat: dict[str, Any] = {f"{p}_ttft_s": out[p]["ttft_s"] for p in phases}
    flat.update(
        doc_tokens=doc_tokens,
        kv_bytes_per_token=out["kv_bytes_per_token"],
        remote_hit_rate=out["remote"].get("remote_hit_rate", 0.0),
        ram_hit_rate=out["ram"].get("ram_hit_rate", 0.0),
        remote_errors=out["b_remote"]["errors"],
        remote_checksum_failures=out["b_remote"]["checksum_failures"],
        remote_bytes_sent=out["a_remote"]["bytes_in"],
        remote_dropped_puts=out["a_remote"]["dropped_puts"],
    )
    flat["phases"] = {p: out[p] for p in phases}
    return flat


def add_args(p: argparse.ArgumentParser) -> None:
    d = RestartSpec()
    p.add_argument("--docs", type=int, default=d.docs)
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    p.add_argument("--remote", nargs="?", const="", metavar="URL",
                   help="S4 through a shared Valkey/Redis: host A is lost, host B takes over "
                        "(no URL: a private redis-server)")  # fmt: skip
    p.set_defaults(modes=["none", "vllm", "kvkeep"])


def build(args: argparse.Namespace) -> list[RestartScenario | RemoteRestartScenario]:
    spec = RestartSpec(docs=args.docs, doc_tokens=args.doc_tokens)
    spec.validate()
    if args.remote is not None:
        return [RemoteRestartScenario(spec)]
    return [RestartScenario(spec)]
