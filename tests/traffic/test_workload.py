import itertools
import json
from pathlib import Path

import pytest

from kvkeep.traffic.workload import (
    CharEstimate,
    HFTokenizer,
    SessionGenerator,
    SessionSpec,
    generate_sessions,
)


def _turns(spec: SessionSpec, model: Path, agent: int = 0):
    return SessionGenerator(spec, HFTokenizer(model), agent=agent).turns()


def test_same_spec_gives_identical_sessions(tiny_model: Path) -> None:
    spec = SessionSpec(turns=6, scale=0.05, seed=3)
    a = [json.dumps(t.messages) for t in _turns(spec, tiny_model)]
    b = [json.dumps(t.messages) for t in _turns(spec, tiny_model)]
    assert a == b
    other = [
        json.dumps(t.messages) for t in _turns(SessionSpec(turns=6, scale=0.05, seed=4), tiny_model)
    ]
    assert other != a


def test_each_turn_extends_the_previous_conversation(tiny_model: Path) -> None:
    turns = _turns(SessionSpec(turns=8, scale=0.05), tiny_model)
    assert turns[0].messages[0]["role"] == "system"
    assert turns[0].tools and all(t["type"] == "function" for t in turns[0].tools)
    for prev, cur in itertools.pairwise(turns):
        assert cur.messages[: len(prev.messages)] == prev.messages
        added = cur.messages[len(prev.messages) :]
        assert [m["role"] for m in added] == ["assistant", "tool", "user"]
        call = added[0]["tool_calls"][0]
        assert added[1]["tool_call_id"] == call["id"]
        assert call["function"]["name"] in {"read_file", "grep", "run_tests"}
        assert json.loads(call["function"]["arguments"])


def test_context_grows_to_the_scaled_study_size(tiny_model: Path) -> None:
    spec = SessionSpec(scale=0.2)
    turns = _turns(spec, tiny_model)
    assert len(turns) == 30
    sizes = [t.target_tokens for t in turns]
    assert sizes == sorted(sizes)
    assert abs(sizes[-1] - 0.2 * 115_000) / (0.2 * 115_000) < 0.05
    # Growth is front-loaded like an agent reading files early, and the total matches the
    # study's "more than 2M tokens at scale 1" once scaled.
    assert sizes[1] - sizes[0] > sizes[-1] - sizes[-2]
    assert sum(sizes) > 0.2 * 2_000_000


def test_agents_get_different_sessions_of_the_same_shape() -> None:
    spec = SessionSpec(turns=4, scale=0.05)
    a, b = generate_sessions(spec, CharEstimate(), agents=2)
    assert a[0].messages[0] == b[0].messages[0]  # one system prompt, shared by all agents
    assert json.dumps(a[-1].messages) != json.dumps(b[-1].messages)
    assert len(a) == len(b) == 4


@pytest.mark.parametrize(
    "kwargs, word",
    [({"turns": 0}, "--turns"), ({"scale": 0}, "--scale"), ({"scale": 9}, "--scale")],
)
def test_bad_parameters_name_the_flag(kwargs, word) -> None:
    with pytest.raises(ValueError, match=word):
        SessionSpec(**kwargs).validate()
