"""`kvkeep bench capacity` (S3): more long documents than the device pool holds.

N documents whose KV totals `k` times the device pool are queried in tile order (1, 2, ...,
N, 1, 2, ...) for several rounds, each query the document plus a short question. Under LRU a
cyclic scan larger than the cache never hits, so the device hit rate falls to 0 and the hits
must come from a larger tier below it. The first round only fills the caches: not measured.

"k times the pool" counts pool blocks as vLLM holds them for the model, one set per KV cache
group (`kvkeep.plan.pool`), so the number of documents comes from the model's config.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from kvkeep.bench.command import Claim, Command, InSuite, Section, SuiteRun
from kvkeep.bench.context import RunContext
from kvkeep.bench.metrics import HitRates, Probe, mean_rates
from kvkeep.bench.prompts import documents, query
from kvkeep.bench.report.plots import bar_plot
from kvkeep.bench.report.results import Run
from kvkeep.bench.report.tables import Column, Table, pct, secs
from kvkeep.bench.result import FLAT
from kvkeep.bench.scenario import Needs
from kvkeep.plan.footprint import footprint_from_file
from kvkeep.plan.pool import request_blocks
from kvkeep.traffic.workload import QUESTION_TOKENS


@dataclass(frozen=True)
class CapacitySpec:
    """`pool_blocks` is the device pool; documents total `k` times it. ``doc_blocks`` and
    ``query_blocks``: pool blocks a document and a query (document and question) hold, from
    the model (`for_model`); None counts one block per ``block_size`` tokens."""

    pool_blocks: int = 256
    k: float = 4.0
    doc_tokens: int = 4096
    rounds: int = 3
    block_size: int = 128
    seed: int = 0
    doc_blocks: int | None = None
    query_blocks: int | None = None

    def validate(self) -> None:
        if self.rounds < 2:
            raise ValueError("--rounds must be at least 2: the first round only warms up")
        if self.doc_tokens % self.block_size:
            raise ValueError(f"--doc-tokens must be a multiple of the block size {self.block_size}")
        query = self.query_blocks or math.ceil(
            (self.doc_tokens + QUESTION_TOKENS) / self.block_size
        )
        if query > self.pool_blocks:
            raise ValueError(
                f"--doc-tokens must fit in the device pool: a query holds {query} blocks of "
                f"the {self.pool_blocks} in --pool-blocks"
            )
        if self.k <= 0:
            raise ValueError("-k must be positive")

    def for_model(self, model: Path) -> CapacitySpec:
        """This spec with the blocks vLLM holds per document and per query for the model in
        directory ``model`` (its hybrid KV cache groups counted); unchanged when ``model``
        has no config.json (an ``--endpoint`` run may name none). Raises ValueError naming
        the config when its shape cannot be read."""
        if not (model / "config.json").is_file():
            return self
        fp = footprint_from_file(model / "config.json")
        doc = request_blocks(fp, self.doc_tokens, self.block_size)
        query = request_blocks(fp, self.doc_tokens + QUESTION_TOKENS, self.block_size)
        return replace(self, doc_blocks=doc, query_blocks=query)

    @property
    def num_docs(self) -> int:
        doc_blocks = self.doc_blocks or self.doc_tokens // self.block_size
        return math.ceil(self.k * self.pool_blocks / doc_blocks)

    def documents(self) -> list[list[int]]:
        """`num_docs` distinct token-id documents, the same for the same seed."""
        return documents(self.num_docs, self.doc_tokens, f"capacity:{self.seed}")


@dataclass(frozen=True)
class CapacityRound:
    """Every document once; ``cacheable_tokens`` weighs the round's rates in the result's.
    ``ttft_s`` is the round's mean, ``ttfts_s`` each request's."""

    round: int
    rates: HitRates = field(metadata=FLAT)
    ttft_s: float
    ttft_p50_s: float
    cacheable_tokens: int
    wall_s: float
    ttfts_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class CapacityResult:
    """The measured rounds (all but the first) together, and every round in full. ``ttft_s``
    is the median of the measured requests': a hit served from kvkeep's RAM takes 15-25 ms
    on 2 cores, where one request held up by the machine moves a mean of 32 by a tenth."""

    rates: HitRates = field(metadata=FLAT)
    ttft_s: float
    rounds: list[CapacityRound]
    num_docs: int
    doc_tokens: int
    pool_blocks: int
    k: float
    rounds_measured: int
    question_tokens: int
    block_size: int
    doc_blocks: int | None  # pool blocks one document holds (vLLM's KV cache groups counted)


@dataclass
class CapacityScenario:
    spec: CapacitySpec
    name: str = "capacity"

    def needs(self) -> Needs:
        tokens = self.spec.doc_tokens + QUESTION_TOKENS + 64
        return Needs(tokens=tokens, num_blocks=self.spec.pool_blocks)

    def run(self, ctx: RunContext) -> CapacityResult:
        spec = self.spec.for_model(ctx.model)
        spec.validate()
        docs = spec.documents()
        with tqdm(total=len(docs) * spec.rounds, desc="  capacity queries", leave=False) as bar:
            rounds = [self._round(ctx.probe(), docs, r, bar) for r in range(spec.rounds)]
        measured = rounds[1:]
        return CapacityResult(
            mean_rates([(r.rates, r.cacheable_tokens) for r in measured]),
            statistics.median(t for r in measured for t in r.ttfts_s),
            rounds,
            len(docs),
            spec.doc_tokens,
            spec.pool_blocks,
            spec.k,
            len(measured),
            QUESTION_TOKENS,
            spec.block_size,
            spec.doc_blocks,
        )

    def _round(self, probe: Probe, docs: list[list[int]], r: int, bar: tqdm) -> CapacityRound:
        t0 = time.perf_counter()
        q = query(probe, docs, self.spec.block_size, salt=r, progress=bar.update)
        return CapacityRound(
            r,
            q.rates,
            q.ttft_s,
            statistics.median(q.ttfts_s),
            q.cacheable,
            time.perf_counter() - t0,
            q.ttfts_s,
        )


def add_args(p: argparse.ArgumentParser) -> None:
    d = CapacitySpec()
    p.add_argument(
        "--pool-blocks",
        type=int,
        default=d.pool_blocks,
        help="device KV pool in blocks (--num-gpu-blocks-override)",
    )
    p.add_argument("-k", type=float, default=d.k, help="documents total k times the pool")
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--block-size", type=int, default=d.block_size)


def build(args: argparse.Namespace) -> list[CapacityScenario]:
    spec = CapacitySpec(
        pool_blocks=args.pool_blocks,
        k=args.k,
        doc_tokens=args.doc_tokens,
        rounds=args.rounds,
        block_size=args.block_size,
    )
    spec.validate()
    return [CapacityScenario(spec)]


@dataclass(frozen=True)
class InSuiteCapacity:
    """S3's knobs in `bench all`, on the suite's pool."""

    doc_tokens: int
    rounds: int


def _in_suite(size: InSuiteCapacity, run: SuiteRun) -> list[CapacityScenario]:
    spec = CapacitySpec(pool_blocks=run.pool_blocks, doc_tokens=size.doc_tokens, rounds=size.rounds)
    return [CapacityScenario(spec)]


def _tiers(run: Run[CapacityResult]) -> list[str]:
    """kvkeep's tiers that served hits in some mode: "disk", "ram"."""
    keys = {k for r in run.modes.values() for k in r.rates.tiers}
    return sorted(k.removesuffix("_hit_rate") for k in keys)


def _tier_rate(tier: str) -> Callable[[CapacityResult], float | None]:
    """A kvkeep tier's hit rate; None ("-") in a mode without that tier."""
    return lambda r: r.rates.tiers.get(f"{tier}_hit_rate")


def capacity_table(run: Run[CapacityResult]) -> str:
    """Hit rates by tier: whichever tiers the results have."""
    d = run.first
    head = (
        f"### S3: {d and d.num_docs} documents of {d and d.doc_tokens} tokens, "
        f"{d and d.k}x the device pool, in tile order\n\n"
        "Study: device hit rate 0%; CPU offload >99% at 164 ms.\n\n"
    )
    columns: tuple[Column[CapacityResult], ...] = (
        Column("hit rate (all tiers)", lambda r: r.rates.hit_rate, pct),
        Column("device", lambda r: r.rates.device_hit_rate, pct),
        *(Column(t, _tier_rate(t), pct) for t in _tiers(run)),
        Column("TTFT (median)", lambda r: r.ttft_s),
    )
    return Table(head, columns)(run)


def plot_capacity(run: Run[CapacityResult], out: Path) -> list[Path]:
    """Hit rate by tier, stacked, per mode."""
    series = {
        tier: [100 * r.rates.get(f"{tier}_hit_rate") for r in run.modes.values()]
        for tier in sorted(["device", *_tiers(run)])
    }
    return bar_plot(
        out / "hit_rate_by_tier.png",
        list(run.modes),
        series,
        "hit rate (%)",
        "S3: hit rate by tier, by mode",
        stacked=True,
    )


CLAIMS: tuple[Claim[CapacityResult], ...] = (
    Claim(
        "S3 device hit rate, docs 4x pool", "0%", "capacity", lambda r: r.rates.device_hit_rate, pct
    ),
    Claim("S3 hit rate, all tiers", ">99% (offload)", "capacity", lambda r: r.rates.hit_rate, pct),
    Claim("S3 TTFT", "164 ms", "capacity", lambda r: r.ttft_s, secs),
)


COMMAND = Command(
    name="capacity",
    help="more documents than the device pool (S3)",
    add_args=add_args,
    build=build,
    sections={"capacity": Section(CapacityResult, capacity_table, plot_capacity)},
    claims=CLAIMS,
    in_suite=InSuite(
        quick=InSuiteCapacity(doc_tokens=2048, rounds=2),
        full=InSuiteCapacity(doc_tokens=4096, rounds=3),
        runs={40: _in_suite},
        # seconds in all three modes, engine starts included (`make demo`, 2 cores with AMX)
        quick_s={"capacity": 20},
    ),
)
