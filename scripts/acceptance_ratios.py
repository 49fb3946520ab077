"""Issue 13's acceptance ratios, as a Markdown table, from one `kvkeep bench all` results.json
and optionally a `kvkeep bench store --json` file:

    python3 scripts/acceptance_ratios.py kvkeep-report/results.json [store.json]

Each row is one target, with the two figures, their ratio (or difference) and whether it is
met. Exits 1 if a target is missed, 2 if a figure is missing from the files given."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = tuple[str, float, float, str, bool]


def _ratio(name: str, a: float, b: float, target: str, ok: Callable[[float], bool]) -> Row:
    return name, a, b, target, ok(a / b) if b else False


def rows(results: dict[str, Any], store: dict[str, Any] | None) -> list[Row]:
    """The targets of ``results`` (results.json's ``scenarios``) and ``store`` (bench store's
    ``results``). Raises KeyError naming a missing figure."""

    def mode(scenario: str, name: str) -> dict[str, Any]:
        found: dict[str, Any] = results[scenario]["modes"][name]
        return found

    session, hol, restart = (mode(s, "kvkeep") for s in ("session", "hol", "restart"))
    cold = {m: mode("ttft", m)["sizes"]["8192"]["cold_s"] for m in ("kvkeep", "vllm")}
    out = [
        _ratio(
            "S1 session_s kvkeep / vllm",
            session["session_s"],
            mode("session", "vllm")["session_s"],
            "<= 1.05",
            lambda r: r <= 1.05,
        ),
        _ratio(
            "S2 cold_s at 8192 kvkeep / vllm",
            cold["kvkeep"],
            cold["vllm"],
            "<= 1.05",
            lambda r: r <= 1.05,
        ),
        _ratio(
            "S6 ttft_beside_prefill_s kvkeep / vllm",
            hol["ttft_beside_prefill_s"],
            mode("hol", "vllm")["ttft_beside_prefill_s"],
            "<= 1.2",
            lambda r: r <= 1.2,
        ),
        _ratio(
            "S6 long_prefill_ttft_s kvkeep / vllm",
            hol["long_prefill_ttft_s"],
            mode("hol", "vllm")["long_prefill_ttft_s"],
            "<= 1.05",
            lambda r: r <= 1.05,
        ),
        _ratio(
            "S4 after_engine_restart_ttft_s / warm_ttft_s (kvkeep)",
            restart["after_engine_restart_ttft_s"],
            restart["warm_ttft_s"],
            "<= 1.2",
            lambda r: r <= 1.2,
        ),
    ]
    ready, vllm_ready = restart["restart_ready_s"], mode("restart", "vllm")["restart_ready_s"]
    out.append(
        (
            "S4 restart_ready_s kvkeep - vllm",
            ready,
            vllm_ready,
            "<= +1 s",
            ready <= vllm_ready + 1.0,
        )
    )
    out.append(
        _ratio(
            "S5 turns_per_min kvkeep / none",
            mode("agents", "kvkeep")["turns_per_min"],
            mode("agents", "none")["turns_per_min"],
            ">= 5",
            lambda r: r >= 5,
        )
    )
    if store is not None:
        out.append(
            _ratio(
                "store ram_get_verified_gbps / memcpy_gbps",
                store["ram_get_verified_gbps"],
                store["memcpy_gbps"],
                ">= 0.5",
                lambda r: r >= 0.5,
            )
        )
        out.append(
            _ratio(
                "store disk_get_gbps / disk_direct_read_gbps",
                store["disk_get_gbps"],
                store["disk_direct_read_gbps"],
                ">= 0.5",
                lambda r: r >= 0.5,
            )
        )
    return out


def table(out: list[Row]) -> str:
    lines = ["| target | kvkeep / reference | ratio | wanted | met |", "|---|---|---|---|---|"]
    for name, a, b, target, ok in out:
        shown = f"{a - b:+.2f} s" if name.endswith("- vllm") else f"{a / b:.3f}" if b else "-"
        lines.append(
            f"| {name} | {a:.4g} / {b:.4g} | {shown} | {target} | {'yes' if ok else '**no**'} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    doc = json.loads(Path(argv[0]).read_text())
    # bench all writes every scenario under "scenarios"; a single scenario's run writes one
    results = doc["scenarios"] if "scenarios" in doc else {doc.get("scenario"): doc}
    store = json.loads(Path(argv[1]).read_text())["results"] if len(argv) > 1 else None
    try:
        out = rows(results, store)
    except KeyError as exc:
        print(
            f"acceptance_ratios: {exc} is missing: give the results.json of `kvkeep bench all` "
            "with the modes none, vllm and kvkeep (and `kvkeep bench store --json`'s file for "
            "the store rows)",
            file=sys.stderr,
        )
        return 2
    print(table(out))
    return 0 if all(row[4] for row in out) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
