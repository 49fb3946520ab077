"""`kvkeep bench capacity` (S3): more long documents than the device pool holds.

N documents whose KV totals `k` times the device pool are queried in tile order (1, 2, ...,
N, 1, 2, ...) for several rounds, each query being the document plus a short question. Under
LRU a cyclic scan larger than the cache never hits: the device tier's hit rate falls to 0,
which is what the study saw with 48 documents on one GPU. A larger tier below it (vLLM's CPU
offload there, kvkeep's RAM and disk here) brings the hits back.

The first round only fills the caches and is not measured. Documents are whole blocks long,
so a perfect cache serves every document token (`cacheable_tokens`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from kvkeep.bench.context import RunContext
from kvkeep.bench.metrics import HitRates, Probe, mean_rates
from kvkeep.bench.prompts import documents, query
from kvkeep.bench.result import FLAT
from kvkeep.bench.scenario import Needs
from kvkeep.workload import QUESTION_TOKENS


@dataclass(frozen=True)
class CapacitySpec:
    """`pool_blocks` is the device pool; documents total `k` times it."""

    pool_blocks: int = 256
    k: float = 4.0
    doc_tokens: int = 4096
    rounds: int = 3
    block_size: int = 128
    seed: int = 0

    def validate(self) -> None:
        if self.rounds < 2:
            raise ValueError("--rounds must be at least 2: the first round only warms up")
        if self.doc_tokens % self.block_size:
            raise ValueError(f"--doc-tokens must be a multiple of the block size {self.block_size}")
        if self.doc_tokens + QUESTION_TOKENS > self.pool_blocks * self.block_size:
            raise ValueError("--doc-tokens must fit in the device pool (--pool-blocks)")
        if self.k <= 0:
            raise ValueError("-k must be positive")

    @property
    def num_docs(self) -> int:
        return math.ceil(self.k * self.pool_blocks * self.block_size / self.doc_tokens)

    def documents(self) -> list[list[int]]:
        """`num_docs` distinct token-id documents, the same for the same seed."""
        return documents(self.num_docs, self.doc_tokens, f"capacity:{self.seed}")


@dataclass(frozen=True)
class CapacityRound:
    """Every document once; ``cacheable_tokens`` weighs the round's rates in the result's."""

    round: int
    rates: HitRates = field(metadata=FLAT)
    ttft_s: float
    ttft_p50_s: float
    cacheable_tokens: int
    wall_s: float


@dataclass(frozen=True)
class CapacityResult:
    """The measured rounds (all but the first) together, and every round in full."""

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


@dataclass
class CapacityScenario:
    spec: CapacitySpec
    name: str = "capacity"

    def needs(self) -> Needs:
        tokens = self.spec.doc_tokens + QUESTION_TOKENS + 64
        return Needs(tokens=tokens, num_blocks=self.spec.pool_blocks)

    def run(self, ctx: RunContext) -> CapacityResult:
        spec = self.spec
        spec.validate()
        docs = spec.documents()
        with tqdm(total=len(docs) * spec.rounds, desc="  capacity queries", leave=False) as bar:
            rounds = [self._round(ctx.probe(), docs, r, bar) for r in range(spec.rounds)]
        measured = rounds[1:]
        return CapacityResult(
            mean_rates([(r.rates, r.cacheable_tokens) for r in measured]),
            statistics.fmean(r.ttft_s for r in measured), rounds, len(docs), spec.doc_tokens,
            spec.pool_blocks, spec.k, len(measured), QUESTION_TOKENS, spec.block_size,
        )  # fmt: skip

    def _round(self, probe: Probe, docs: list[list[int]], r: int, bar: tqdm) -> CapacityRound:
        """Every document once, with round ``r``'s question."""
        t0 = time.perf_counter()
        q = query(probe, docs, self.spec.block_size, salt=r, progress=bar.update)
        return CapacityRound(r, q.rates, q.ttft_s, statistics.median(q.ttfts_s), q.cacheable,
                             time.perf_counter() - t0)  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    d = CapacitySpec()
    p.add_argument("--pool-blocks", type=int, default=d.pool_blocks,
                   help="device KV pool in blocks (--num-gpu-blocks-override)")  # fmt: skip
    p.add_argument("-k", type=float, default=d.k, help="documents total k times the pool")
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--block-size", type=int, default=d.block_size)  # fmt: skip


def build(args: argparse.Namespace) -> list[CapacityScenario]:
    spec = CapacitySpec(pool_blocks=args.pool_blocks, k=args.k, doc_tokens=args.doc_tokens,
                        rounds=args.rounds, block_size=args.block_size)  # fmt: skip
    spec.validate()
    return [CapacityScenario(spec)]
