"""The machine's pace, measured early in `bench all --quick`, and the baselines' time boxes.

`make demo`'s sizes were set on 2 cores with AMX, where it takes about 11 minutes. A CPU
without AMX or AVX-512 BF16 computes the same prefill 3-5x slower (docs/benchmarks.md: an
8k-token cold prefill 2.8 s on an AVX2-only EPYC against about 0.6 s with AMX), and the demo
took 32 minutes there, most of it in the baselines: S6's 15 tries of an 8k prefill in every
mode, S5's no-cache and device-cache agents, S4's three vLLM restarts per mode.

So the demo measures the machine first. S2 runs its cold 8k prompts in every mode; their
median, over the same figure where the sizes were set (``REFERENCE_S``), is the pace
``factor``: 1 on a machine as fast or faster, 4-5 on the AVX2 EPYC. A scenario's time-boxed
knob then shrinks (a count of tries or restarts: ``units``) or widens (a stride between the
turns a baseline runs: ``stride``) by that factor, never past a floor that keeps the figure
a median of several samples. The kvkeep mode's own work is never shrunk, and where a count
of units shrinks it shrinks in every mode alike, so no ratio compares unequal work; each
table says how many units its figures are over.

A scenario run outside `bench all` (no pace), or before S2 has measured, keeps its defaults.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

# The median cold TTFT of an 8,192-token prompt on the machine `make demo`'s sizes were set on
# (2 cores with AMX, the tiny model in bf16): S2's and S6's cold 8k prefills read 0.5-0.7 s.
REFERENCE_TOKENS = 8192
REFERENCE_S = 0.6


@dataclass
class Pace:
    """Cold prefill TTFTs of ``REFERENCE_TOKENS`` tokens as S2 measures them (any mode), and
    what they make of the time-boxed knobs. Thread-safe: the modes record at once."""

    samples_s: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, tokens: int, seconds: float) -> None:
        """A cold TTFT of ``tokens`` tokens, scaled to REFERENCE_TOKENS (a prefill's cost grows
        about linearly in its size here, its attention being the smaller part)."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.samples_s.append(seconds * REFERENCE_TOKENS / tokens)

    @property
    def measured_s(self) -> float | None:
        with self._lock:
            return statistics.median(self.samples_s) if self.samples_s else None

    @property
    def factor(self) -> float:
        """How many times slower than the reference machine this one prefills; 1 when it is
        as fast or faster, or not measured."""
        measured = self.measured_s
        return max(1.0, measured / REFERENCE_S) if measured is not None else 1.0

    def units(self, default: int, least: int) -> int:
        """A count of units (tries, restarts) boxed to the time ``default`` takes on the
        reference machine: ``default / factor``, at least ``least`` (and at most ``default``)."""
        return max(min(least, default), min(default, round(default / self.factor)))

    def stride(self, default: int, most: int) -> int:
        """A stride between the units a baseline runs, widened by the factor: ``default *
        factor``, at most ``most`` (and at least ``default``)."""
        return max(default, min(most, round(default * self.factor)))

    def summary(self) -> dict[str, float | None]:
        """What the results record: the measured TTFT (scaled to REFERENCE_TOKENS), the
        reference, and the factor."""
        return {
            "cold_ttft_s": self.measured_s,
            "reference_tokens": REFERENCE_TOKENS,
            "reference_s": REFERENCE_S,
            "factor": self.factor,
        }
