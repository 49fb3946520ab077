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
