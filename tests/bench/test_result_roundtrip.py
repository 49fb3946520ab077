"""Every scenario's result survives its JSON: ``to_json(from_json(cls, to_json(r))) ==
to_json(r)``, on the example results of `bench_examples`."""

from __future__ import annotations

import json

import pytest
from bench_examples import EXAMPLES

from kvkeep.bench.prompts import Queried
from kvkeep.bench.result import from_json, to_json
from kvkeep.bench.scenarios import registry
from kvkeep.bench.scenarios.agents import AgentsResult
from kvkeep.bench.scenarios.hol import HOLResult
from kvkeep.bench.scenarios.restart import Requeried


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_result_survives_its_json(name: str) -> None:
    result = EXAMPLES[name]
    doc = json.loads(json.dumps(to_json(result)))  # as results.json holds it
    back = from_json(type(result), doc)
    assert back == result
    assert to_json(back) == doc


def test_every_result_the_report_reads_has_an_example() -> None:
    types = {name: s.result for name, s in registry.sections().items()}
    assert {name: type(EXAMPLES[name]) for name in types} == types


def test_a_subclass_in_a_dict_comes_back_as_itself() -> None:
    phases = from_json(type(EXAMPLES["restart"]), to_json(EXAMPLES["restart"])).phases
    assert type(phases["warm"]) is Queried and type(phases["after_engine_restart"]) is Requeried


def test_extra_keys_the_mode_loop_adds_are_ignored() -> None:
    doc = {**to_json(EXAMPLES["agents"]), "server": {"ready_s": 1.0}, "profile": {"load": 0.1}}
    assert from_json(AgentsResult, doc) == EXAMPLES["agents"]


def test_a_missing_field_is_an_error_that_names_it() -> None:
    doc = to_json(EXAMPLES["hol"])
    del doc["ratio"]
    with pytest.raises(ValueError, match="ratio"):
        from_json(HOLResult, doc)
