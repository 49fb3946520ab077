"""Issue 13's acceptance ratios, as a Markdown table, from one `kvkeep bench all` results.json
and optionally a `kvkeep bench store --json` file:

    python3 scripts/acceptance_ratios.py kvkeep-report/results.json [store.json]

Each row is one target, with the two figures, their ratio (or difference) and whether it is
met. Exits 1 if a target is missed, 2 if a figure is missing from the files given."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

Row = tuple[str, float, float, str, bool]


def _ratio(name: str, a: float, b: float, bound: float, at_most: bool = True) -> Row:
    """``a / b`` against ``bound``: at most it (``at_most``) or at least it."""
    ok = b != 0 and (a / b <= bound if at_most else a / b >= bound)
    return name, a, b, f"{'<=' if at_most else '>='} {bound:g}", ok


def rows(results: dict[str, Any], store: dict[str, Any] | None) -> list[Row]:
    """The targets of ``results`` (results.json's ``scenarios``) and ``store`` (bench store's
    ``results``). Raises KeyError naming a missing figure."""

    def fig(scenario: str, mode: str, key: str) -> float:
        return float(results[scenario]["modes"][mode][key])

    def vs_vllm(scenario: str, key: str, bound: float) -> Row:
        a, b = fig(scenario, "kvkeep", key), fig(scenario, "vllm", key)
        return _ratio(f"{scenario} {key} kvkeep / vllm", a, b, bound)

    cold = [results["ttft"]["modes"][m]["sizes"]["8192"]["cold_s"] for m in ("kvkeep", "vllm")]
    ready, vllm_ready = (
        fig("restart", "kvkeep", "restart_ready_s"),
        fig("restart", "vllm", "restart_ready_s"),
    )
    out = [
        vs_vllm("session", "session_s", 1.05),
        _ratio("ttft cold_s at 8192 kvkeep / vllm", cold[0], cold[1], 1.05),
        vs_vllm("hol", "ttft_beside_prefill_s", 1.2),
        vs_vllm("hol", "long_prefill_ttft_s", 1.05),
        _ratio(
            "restart after_engine_restart_ttft_s / warm_ttft_s (kvkeep)",
            fig("restart", "kvkeep", "after_engine_restart_ttft_s"),
            fig("restart", "kvkeep", "warm_ttft_s"),
            1.2,
        ),
        ("restart restart_ready_s kvkeep - vllm", ready, vllm_ready, "<= +1 s",
         ready <= vllm_ready + 1.0),
        _ratio(
            "agents turns_per_min kvkeep / none",
            fig("agents", "kvkeep", "turns_per_min"),
            fig("agents", "none", "turns_per_min"),
            5,
            at_most=False,
        ),
    ]  # fmt: skip
    if store is not None:
        for key, reference in (("ram_get_verified_gbps", "memcpy_gbps"),
                               ("disk_get_gbps", "disk_direct_read_gbps")):  # fmt: skip
            out.append(
                _ratio(f"store {key} / {reference}", store[key], store[reference], 0.5, False)
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
