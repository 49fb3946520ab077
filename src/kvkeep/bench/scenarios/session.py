"""`kvkeep bench session` (S1): one coding-agent session, turn by turn: per turn the prompt,
cached and computed tokens and TTFT, and the totals the study quotes (DESIGN.md, S1).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvkeep.bench.command import Claim, Command, Format, InSuite, Section, SuiteRun
from kvkeep.bench.context import RunContext
from kvkeep.bench.http import TurnResult, run_agents
from kvkeep.bench.metrics import metrics_delta, vllm_counters
from kvkeep.bench.pace import Pace
from kvkeep.bench.report.plots import figure
from kvkeep.bench.report.results import Run
from kvkeep.bench.report.tables import count, markdown_table, secs, times
from kvkeep.bench.sampling import balanced_turns, turn_work
from kvkeep.bench.scenario import Needs
from kvkeep.traffic.workload import (
    CharEstimate,
    HFTokenizer,
    SessionGenerator,
    SessionSpec,
    TokenCounter,
)


def session_tokens(spec: SessionSpec) -> int:
    """The longest prompt plus output of a session (with 10% for the token estimate)."""
    return int(spec.final_target * 1.1) + spec.max_output_tokens + 256


# The widest stride of mode none's time-boxed turns: 6 of 30, the last among them, whose
# prompt and new tokens average within 2.5% of the session's (`bench.sampling`).
STRIDE_MOST = 5


@dataclass
class SessionScenario:
    spec: SessionSpec
    counter: TokenCounter
    name: str = "session"
    # Given (`make demo`): on a machine slower than the reference, mode none runs a sample of
    # the turns (`kvkeep.bench.pace`). A turn without a cache computes its whole prompt
    # whatever ran before it, so none needs no earlier turn; vllm and kvkeep run every turn,
    # since each turn's hits come from the one before. On an AVX2-only EPYC none's 30 turns
    # took 82 s of S1's 132.
    pace: Pace | None = None

    def stride(self) -> int:
        """1, or with a pace one turn in ``pace.stride(1, STRIDE_MOST)`` for mode none. Read
        when the modes start, after S2 measured the pace, so every mode samples alike."""
        return self.pace.stride(1, STRIDE_MOST) if self.pace else 1

    def needs(self) -> Needs:
        return Needs(tokens=session_tokens(self.spec), turns=True)

    def run(self, ctx: RunContext) -> SessionResult:
        """The turns back to back; each turn is a unit where modes take turns."""
        turns = SessionGenerator(self.spec, self.counter).turns()
        stride = self.stride()
        sample = balanced_turns(turn_work([turns]), stride, keep_last=True) if stride > 1 else None
        if sample is not None and ctx.mode == "none":
            turns = [t for t in turns if t.index in sample]
        before = vllm_counters(ctx.url)
        with tqdm(
            total=len(turns), desc=f"  session turns ({ctx.mode})", unit="turn", leave=False
        ) as bar:
            results = asyncio.run(
                run_agents([ctx.url], [turns], progress=lambda _: bar.update(), unit=ctx.aturn)
            )
        metrics = metrics_delta(before, vllm_counters(ctx.url))
        return summarize_session(results, metrics, sample, stride)


@dataclass(frozen=True)
class SessionResult:
    """Per-turn rows (`TurnResult` less agent and start) plus the totals the study quotes."""

    turns: list[dict[str, Any]]
    total_prompt_tokens: int
    total_cached_tokens: int
    total_computed_tokens: int
    last_turn_prompt_tokens: int
    last_turn_computed_tokens: int
    max_turn_computed_tokens: int
    reread_ratio: float | None
    ttft_mean_s: float
    last_turn_ttft_s: float
    session_s: float  # its turns' latencies summed: the session with no time between turns
    vllm_metrics: dict[str, float]
    # Time-boxed (`SessionScenario.pace`): mode none ran the ``sample`` turns alone, one in
    # ``stride``, and every figure above is over those turns in every mode; ``turns`` holds
    # every turn the mode ran, and these two what it computed over all of them.
    stride: int = 1
    sample: list[int] | None = None
    all_prompt_tokens: int | None = None
    all_computed_tokens: int | None = None


def summarize_session(
    results: Sequence[TurnResult],
    metrics: dict[str, float],
    sample: Sequence[int] | None = None,
    stride: int = 1,
) -> SessionResult:
    """The totals the study quotes, over the ``sample`` turns where there is one (the same
    turns in every mode), else over every turn."""
    rows = sorted(results, key=lambda r: (r.agent, r.turn))
    over = [r for r in rows if r.turn in sample] if sample is not None else rows
    prompt = sum(r.prompt_tokens for r in over)
    computed = sum(r.computed_tokens for r in over)
    turns = [{k: v for k, v in asdict(r).items() if k not in ("agent", "start_s")} for r in rows]
    return SessionResult(
        turns,
        prompt,
        prompt - computed,
        computed,
        over[-1].prompt_tokens,
        over[-1].computed_tokens,
        max(r.computed_tokens for r in over),
        prompt / computed if computed else None,
        statistics.fmean(r.ttft_s for r in over),
        over[-1].ttft_s,
        sum(r.latency_s for r in over),
        metrics,
        stride,
        list(sample) if sample is not None else None,
        sum(r.prompt_tokens for r in rows),
        sum(r.computed_tokens for r in rows),
    )


def add_args(p: argparse.ArgumentParser) -> None:
    """The session's shape (also `bench agents`')."""
    d = SessionSpec()
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument(
        "--final-context",
        type=int,
        default=d.final_context_tokens,
        help="last turn's context in tokens at --scale 1 (the study's 115k)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=d.scale,
        help="multiply every size by this (default %(default)s)",
    )
    p.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--tokenizer", type=Path, help="tokenizer that sizes the turns (default: --model's)"
    )


def session_spec(args: argparse.Namespace) -> SessionSpec:
    spec = SessionSpec(
        turns=args.turns,
        final_context_tokens=args.final_context,
        scale=args.scale,
        max_output_tokens=args.max_output_tokens,
        seed=args.seed,
    )
    spec.validate()
    return spec


def token_counter(args: argparse.Namespace) -> TokenCounter:
    """The model's own tokenizer when one is at hand, else a character estimate."""
    for path in (args.tokenizer, args.model):
        if path is not None and (path / "tokenizer.json" if path.is_dir() else path).is_file():
            return HFTokenizer(path)
    return CharEstimate()


def build(args: argparse.Namespace) -> list[SessionScenario]:
    return [SessionScenario(session_spec(args), token_counter(args))]


def document(args: argparse.Namespace) -> dict[str, Any]:
    return {"spec": asdict(session_spec(args))}


@dataclass(frozen=True)
class InSuiteSession:
    """S1 in `bench all`: the session's scale and each reply's tokens. The demo's replies are
    4 tokens, as S5's: a reply joins the next turn's prompt either way, and 32 tokens decoded
    in each of 30 turns cost ~15 s of a 15-minute demo on an AVX2-only CPU."""

    scale: float
    max_output_tokens: int = SessionSpec.max_output_tokens

    def spec(self) -> SessionSpec:
        return SessionSpec(scale=self.scale, max_output_tokens=self.max_output_tokens)


def _in_suite(size: InSuiteSession, run: SuiteRun) -> list[SessionScenario]:
    return [SessionScenario(size.spec(), run.counter, pace=run.pace)]


# The report. The study's figures: a 30-turn coding-agent session on a GPU (DESIGN.md, S1).
SESSION_ROWS: tuple[tuple[str, Callable[[SessionResult], Any], Format, str], ...] = (
    ("last turn: prompt tokens", lambda r: r.last_turn_prompt_tokens, count, "~115k"),
    ("total prompt tokens ({turns} turns)", lambda r: r.total_prompt_tokens, count, ">2M"),
    ("total tokens computed (re-read)", lambda r: r.total_computed_tokens, count, ""),
    (
        "most tokens computed in one turn",
        lambda r: r.max_turn_computed_tokens,
        count,
        "<=~10k (cached)",
    ),
    ("prompt / computed", lambda r: r.reread_ratio, times, "14x"),
    ("mean TTFT", lambda r: r.ttft_mean_s, secs, ""),
    ("last turn TTFT", lambda r: r.last_turn_ttft_s, secs, ""),
    ("session wall time", lambda r: r.session_s, secs, ""),
)


def session_table(run: Run[SessionResult]) -> str:
    """A row per figure, a column per mode (the study's figure beside them)."""
    spec = run.record.get("spec") or {}
    sampled = _sampled(run)
    n = len(sampled.sample) if sampled and sampled.sample else spec.get("turns", 30)
    rows = [
        [label.format(turns=n), study, *(fmt(get(r)) for r in run.modes.values())]
        for label, get, fmt, study in SESSION_ROWS
    ]
    scale = f" at scale {spec['scale']}" if "scale" in spec else ""
    head = f"### S1: a {spec.get('turns', '?')}-turn coding-agent session{scale}\n\n"
    if sampled and sampled.sample:
        head += (
            f"To bound its time on this machine, mode none ran one turn in {sampled.stride} "
            f"({n} of {spec.get('turns', '?')}: turns {', '.join(map(str, sampled.sample))}; "
            f"one from each {sampled.stride} in a row, the last turn among them, those whose "
            "prompt and new tokens average closest to the whole session's): a turn without a "
            "cache computes its whole prompt whatever ran before it. The other modes ran every "
            "turn, each turn's hits coming from the one before, and every figure below is "
            "over the sampled turns in every mode. Over all their turns: "
            + "; ".join(
                f"{m} computed {r.all_computed_tokens:,} of {r.all_prompt_tokens:,} prompt "
                f"tokens ({r.all_prompt_tokens / r.all_computed_tokens:.1f}x)"
                for m, r in run.modes.items()
                if m != "none" and r.all_computed_tokens and r.all_prompt_tokens
            )
            + ".\n\n"
        )
    return head + markdown_table(["", "study (scale 1)", *run.modes], rows)


def _sampled(run: Run[SessionResult]) -> SessionResult | None:
    """A mode's result where mode none ran a sample of the turns; None where all ran all."""
    return next((r for r in run.modes.values() if r.sample), None)


def _over(run: Run[SessionResult]) -> dict[str, str]:
    """The claims' note of the turns their totals are over, where none ran a sample."""
    r, turns = _sampled(run), (run.record.get("spec") or {}).get("turns", 30)
    return {"over": f" ({len(r.sample)} of {turns} turns)" if r and r.sample else ""}


def plot_session(run: Run[SessionResult], out: Path) -> list[Path]:
    """Computed tokens per turn and TTFT per turn, one line per mode."""
    paths = []
    for key, ylabel, name in (
        ("computed_tokens", "tokens computed (prompt - cached)", "computed_tokens_per_turn.png"),
        ("ttft_s", "time to first token (s)", "ttft_per_turn.png"),
    ):
        with figure(out / name, f"{ylabel} per turn, by cache mode", "turn", ylabel) as ax:
            for mode, result in run.modes.items():
                x = [t["turn"] for t in result.turns]  # a time-boxed none ran a sample
                ax.plot(x, [t[key] for t in result.turns], marker="o", markersize=3, label=mode)
            ax.legend()
        paths.append(out / name)
    return paths


COMMAND = Command(
    name="session",
    help="the study's 30-turn coding-agent session (S1)",
    add_args=add_args,
    build=build,
    document=document,
    sections={"session": Section(SessionResult, session_table, plot_session)},
    claims=(
        Claim[SessionResult](
            "S1 last turn: tokens computed",
            "115k -> <=10k",
            "session",
            lambda r: r.last_turn_computed_tokens,
            count,
        ),
        Claim[SessionResult](
            "S1 session: tokens computed in total{over}",
            ">2M -> ~145k",
            "session",
            lambda r: r.total_computed_tokens,
            count,
            fill=_over,
        ),
        Claim[SessionResult](
            "S1 prompt / computed{over}",
            "14x",
            "session",
            lambda r: r.reread_ratio,
            times,
            fill=_over,
        ),
    ),
    # knobs: the session's scale and reply tokens
    in_suite=InSuite(
        quick=InSuiteSession(scale=0.1, max_output_tokens=4),
        full=InSuiteSession(scale=0.25),
        runs={10: _in_suite},
        record=lambda size: {
            "spec": {
                "turns": SessionSpec().turns,
                "scale": size.scale,
                "max_output_tokens": size.max_output_tokens,
            }
        },
        # seconds in all three modes, engine starts included (`make demo`, 2 cores with AMX)
        quick_s={"session": 106},
    ),
)
