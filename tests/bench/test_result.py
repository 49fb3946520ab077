"""The one JSON form of scenario results: field names as keys, FLAT groups merged in."""

from __future__ import annotations

import dataclasses
import typing

from kvkeep.bench.http import AgentsSummary
from kvkeep.bench.metrics import HitRates
from kvkeep.bench.report import tables
from kvkeep.bench.result import to_json
from kvkeep.bench.scenarios import registry
from kvkeep.bench.scenarios.agents import AgentsResult, PoolFit
from kvkeep.bench.scenarios.session import SessionResult
from kvkeep.bench.scenarios.ttft import SizeTTFT, TTFTResult
from kvkeep.traffic.workload import SessionSpec


def _agents(fit: PoolFit | None) -> dict:
    summary = AgentsSummary(2, 4, 60.0, 4.0, {"0": 2.0}, {"0": [1.0]}, 1.0, 1.0, 0.1)
    rates = HitRates(0.5, 0.25, 0.25, {"ram_hit_rate": 0.25})
    return to_json(AgentsResult(summary, rates, 0.5, 1000, 0.2, SessionSpec(), 128, 800, fit))


def test_flat_groups_put_their_keys_beside_the_result_s_own() -> None:
    doc = _agents(PoolFit(2.5, 3))
    assert doc["turns_per_min"] == 4.0 and doc["ram_hit_rate"] == 0.25
    assert doc["working_set_over_pool"] == 2.5 and doc["pool_blocks"] == 3
    assert doc["spec"]["turns"] == SessionSpec().turns  # a nested dataclass stays nested
    assert not {"summary", "rates", "tiers", "fit"} & doc.keys()


def test_an_absent_flat_group_adds_no_keys() -> None:
    doc = _agents(None)
    assert "working_set_over_pool" not in doc and "pool_blocks" not in doc


def test_nested_results_in_a_dict_keep_their_keys() -> None:
    size = SizeTTFT(1.0, 0.1, [1.0], [0.1], 10.0, 0, 896, 1000)
    assert to_json(TTFTResult({"1000": size}))["sizes"]["1000"]["warm_cached_tokens"] == 896
    assert "after_restart_s" not in to_json(size)


def json_keys(cls: type) -> set[str]:
    """The keys a result class's JSON has for sure (FLAT groups merged; tiers' keys vary)."""
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        if not f.metadata.get("flat"):
            keys.add(f.name)
            continue
        group = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
        group_type = group[0] if group else hints[f.name]
        if dataclasses.is_dataclass(group_type):  # else a dict: keys known only at run time
            keys |= json_keys(group_type)
    return keys


TIER_KEYS = {"ram_hit_rate", "disk_hit_rate", "remote_hit_rate"}  # HitRates.tiers, per run


def test_every_column_of_every_table_is_a_field_of_its_result() -> None:
    sections = registry.sections()
    assert {"session", "ttft", "capacity", "agents", "agents_fit", "hol", "replay"} <= set(sections)
    for name, section in sections.items():
        if isinstance(section.table, tables.Table):
            missing = {c.key for c in section.table.columns} - json_keys(section.result)
            assert not missing - TIER_KEYS, (name, missing)
    assert {key for key, *_ in tables.SESSION_ROWS} <= json_keys(SessionResult)
    for claim in registry.claims():
        assert claim.path[0] in json_keys(sections[claim.scenario].result), claim
