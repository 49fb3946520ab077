"""The machine and versions recorded beside every bench result."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path

from kvkeep.bench import report
from kvkeep.bench.report.environment import environment


def test_environment_names_the_machine_the_versions_and_the_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 32})
    )
    env = environment(tmp_path)
    assert env["machine"]["logical_cpus"] == os.cpu_count()
    assert env["machine"]["memory_gib"] > 0
    assert env["versions"]["python"] == platform.python_version()
    assert env["versions"]["kvkeep"] == metadata.version("kvkeep")
    assert env["versions"]["torch"] == metadata.version("torch")
    assert env["model"] == {"path": str(tmp_path), "num_hidden_layers": 3,
                            "num_key_value_heads": 1, "head_dim": 32}  # fmt: skip
    doc = {"scenario": "ttft", "modes": {}, "environment": env}
    md = report.markdown(doc)
    assert "### Machine and versions" in md and f"torch {metadata.version('torch')}" in md
    page = report.html(md, [])
    assert "<h3>Machine and versions</h3><ul><li>machine: " in page


def test_the_report_says_how_long_the_run_took() -> None:
    """`make demo` promises a time: the report says what this run took, so the figure a
    newcomer is told can be checked against what they waited."""
    from kvkeep.bench import report

    doc = {"scenario": "ttft", "modes": {}, "wall_s": 1557.4}
    assert "This run took 25 min 57 s (set-up excluded)." in report.markdown(doc)
    assert "This run took 42 s" in report.markdown({**doc, "wall_s": 42.0})
    assert "This run took" not in report.markdown({"scenario": "ttft", "modes": {}})
