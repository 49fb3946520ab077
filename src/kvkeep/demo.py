"""`kvkeep demo` (what `make demo` runs): the whole study, small, on the tiny local model.

It generates the tiny model if it is missing, then runs `kvkeep bench all --quick`: the six
experiments of the study (session, TTFT, capacity, restarts, agents, head-of-line) with no
cache, vLLM's prefix cache and kvkeep, side by side. It prints the table of the study's claims
and says where the report and plots are, and how long the run took. Nothing is downloaded;
on a fresh clone on 2 cores with AMX `time make demo` took 11-14 min, set-up included (12 min
31 s on 2026-12-07), and on 2 cores of an AVX2-only AMD EPYC 14 min 22 s (the model in
float32, `kvkeep model tiny --dtype auto`; the baselines time-boxed to the machine's pace,
`kvkeep.bench.pace`; 32 min before); on 2 cores of an AMD EPYC with AVX-512 and no AMX 11 min
55 s (20 min before). The report's last table says where each scenario's time went.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvkeep.bench import cli as bench_cli
from kvkeep.tinymodel.generate import TinyModelSpec, auto_dtype, write_tiny_model


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvkeep demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path(".cache/tiny-model"))
    p.add_argument("--out", type=Path, default=Path("kvkeep-report"))
    p.add_argument("--modes", default="none,vllm,kvkeep")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"generating the tiny model in {args.model}", file=sys.stderr)
        write_tiny_model(args.model, TinyModelSpec(dtype=auto_dtype(TinyModelSpec.arch)))
    return bench_cli.main(
        [
            "all",
            "--quick",
            "--model",
            str(args.model),
            "--out",
            str(args.out),
            "--modes",
            args.modes,
        ]
    )
