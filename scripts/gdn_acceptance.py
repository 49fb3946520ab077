"""Measure issue 37's restart acceptance on the tiny Qwen3-Next (gated DeltaNet) hybrid at any
prompt size: the test suite does it at 4k tokens (tests/e2e/test_gdn.py), this at 16k too.

Per prompt size: a salted reference (vLLM's cold reply and its own align-mode prefix-cache hit,
16 greedy tokens with logprobs), the prompt sent and stored, vLLM restarted, the prompt sent
again. Prints one JSON line per size: the claimable tokens loaded from kvkeep, the states
loaded, and whether the reply equals the cold one (``same_as_cold``) and vLLM's hit
(``same_as_hit``).

Run (it starts vLLM once per size plus once; take the vLLM lock on a shared machine)::

    python scripts/gdn_acceptance.py [.cache/tiny-qwen3-next] [4096 16384]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.conftest import kvkeep_deployment
from tests.e2e.engine import complete, reference
from tests.e2e.test_gdn import BLOCK, STATE_GROUPS, Rig, claimable

from kvkeep.bench.criterion import same_as_cold, same_as_hit


def main(argv: list[str]) -> int:
    model = Path(argv[0]) if argv and not argv[0].isdigit() else Path(".cache/tiny-qwen3-next")
    sizes = [int(a) for a in argv if a.isdigit()] or [4096, 16384]
    logs = Path(tempfile.mkdtemp(prefix="kvkeep-gdn-"))
    longest = max(sizes) + 64
    with kvkeep_deployment("kvkr", model, logs, ram="1GiB", max_model_len=longest) as (c, v):
        rig = Rig(c, v, random.Random(16))
        for size in sizes:
            ids = rig.prompt(size - 32)  # room for the reply
            ref = reference(v.url, ids, max_tokens=16, block=BLOCK)
            complete(v.url, ids)
            rig.wait_stored(ids)
            v.stop()
            v.start()
            before = rig.counters()
            reply = complete(v.url, ids, max_tokens=16)
            after = rig.counters()
            loaded = after["loaded"] - before["loaded"]
            row = {
                "prompt_tokens": len(ids),
                "claimable_tokens": claimable(ids) * BLOCK,
                "loaded_tokens": loaded,
                "loaded_fraction": loaded / (claimable(ids) * BLOCK),
                "states_loaded": after["state_loaded"] - before["state_loaded"],
                "state_groups": STATE_GROUPS,
                "same_as_cold": same_as_cold(reply.reply, ref.cold).why or True,
                "same_as_hit": same_as_hit(reply.reply, ref.hit).why or True,
            }
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
