import json
from dataclasses import replace
from pathlib import Path

from bench_examples import EXAMPLES

from kvkeep.bench import metrics, report
from kvkeep.bench.http import TurnResult
from kvkeep.bench.metrics import HitRates, metrics_delta
from kvkeep.bench.result import to_json
from kvkeep.bench.scenarios.agents import PoolFit
from kvkeep.bench.scenarios.session import summarize_session
from kvkeep.bench.scenarios.ttft import SizeTTFT, TTFTResult

PROM = """# HELP vllm:prefix_cache_hits_total hits
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1664.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 100.0
vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 28.0
"""


def serve_metrics(monkeypatch, page: str) -> None:  # type: ignore[no-untyped-def]
    class Page:
        text = page

        def raise_for_status(self) -> None:
            pass

    monkeypatch.setattr(metrics.httpx, "get", lambda *a, **k: Page())


def test_prometheus_samples_are_summed_over_labels(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    serve_metrics(monkeypatch, PROM + 'vllm:prefix_cache_hits_total{engine="1"} 6.0\n')
    m = metrics.vllm_counters("http://x")
    assert m["vllm:prefix_cache_hits_total"] == 1670.0  # not its _created sample
    assert m["vllm:prompt_tokens_total"] == 0.0 and set(m) == set(metrics.VLLM_COUNTERS)
    assert metrics_delta({"a": 1.0}, {"a": 5.0, "b": 2.0}) == {"a": 4.0, "b": 2.0}


def test_kvkeep_tokens_are_summed_per_op(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    page = PROM + "\n".join([
        'vllm:kvkeep_tokens_total{engine="0",op="loaded"} 256.0',
        'vllm:kvkeep_tokens_total{op="loaded",engine="1"} 128.0',
        'vllm:kvkeep_tokens_total{engine="0",op="load_failed"} 128.0',
        'vllm:kvkeep_events_total{engine="0",op="loaded"} 9.0',
    ])  # fmt: skip
    serve_metrics(monkeypatch, page)
    tokens = metrics.kvkeep_tokens("http://x")
    assert tokens == {"offered": 0.0, "loaded": 384.0, "load_failed": 128.0, "saved": 0.0}


TTFT_4096 = to_json(TTFTResult({"4096": SizeTTFT(0.5, 0.05, [0.5], [0.05], 10.0, 0, 3968, 4096)}))


def _session(
    prompts: list[int], cached: list[int], sample: list[int] | None = None, stride: int = 1
) -> dict:
    rows = [
        TurnResult(0, i, p, c, p - c, 8, 0.1 * (i + 1), 0.2 * (i + 1), float(i))
        for i, (p, c) in enumerate(zip(prompts, cached, strict=True))
    ]
    return to_json(summarize_session(rows, {}, sample, stride))


def test_session_summary_totals_and_ratio() -> None:
    s = _session([1000, 2000, 3000], [0, 896, 1920])
    assert s["total_prompt_tokens"] == 6000
    assert s["total_computed_tokens"] == 1000 + 1104 + 1080
    assert s["last_turn_prompt_tokens"] == 3000
    assert s["max_turn_computed_tokens"] == 1104
    assert abs(s["reread_ratio"] - 6000 / 3184) < 1e-9
    assert [t["computed_tokens"] for t in s["turns"]] == [1000, 1104, 1080]
    assert abs(s["session_s"] - (0.2 + 0.4 + 0.6)) < 1e-9  # the latencies, not any wall time


def test_a_time_boxed_session_is_summed_over_the_sampled_turns_in_every_mode(
    tmp_path: Path,
) -> None:
    """Mode none ran turns 0 and 2 of 3 (`SessionScenario.pace`); vllm ran all three. Every
    figure is over turns 0 and 2, and the report says so; vllm's all-turn totals are kept."""
    none = to_json(summarize_session(
        [TurnResult(0, t, p, 0, p, 8, 0.1, 0.2, 0.0) for t, p in ((0, 1000), (2, 3000))],
        {}, [0, 2], 2,
    ))  # fmt: skip
    vllm = _session([1000, 2000, 3000], [0, 896, 1920], sample=[0, 2], stride=2)
    assert none["total_prompt_tokens"] == vllm["total_prompt_tokens"] == 4000
    assert vllm["total_computed_tokens"] == 1000 + 1080  # turn 1's 1,104 is not in the sample
    assert vllm["all_computed_tokens"] == 1000 + 1104 + 1080
    assert vllm["last_turn_computed_tokens"] == 1080
    assert abs(vllm["reread_ratio"] - 4000 / 2080) < 1e-9
    doc = {
        "scenarios": {
            "session": {"scenario": "session", "spec": {"turns": 3, "scale": 0.1},
                        "modes": {"none": none, "vllm": vllm}},
            "ttft": {"scenario": "ttft", "modes": {"vllm": TTFT_4096}},
            "capacity": {"scenario": "capacity", "modes": {}},
        }
    }  # fmt: skip
    report.write_report(doc, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "mode none ran one turn in 2 (2 of 3: turns 0, 2;" in md
    assert "vllm computed 3,184 of 6,000 prompt tokens (1.9x)" in md
    assert "| total prompt tokens (2 turns) | >2M | 4,000 | 4,000 |" in md
    assert "| S1 session: tokens computed in total (2 of 3 turns) | >2M -> ~145k | 4,000 |" in md


def test_report_writes_tables_json_and_plots(tmp_path: Path) -> None:
    doc = {
        "scenarios": {
            "session": {
                "scenario": "session",
                "spec": {"turns": 3, "scale": 0.1},
                "modes": {"none": _session([1000, 2000, 3000], [0, 0, 0]),
                          "vllm": _session([1000, 2000, 3000], [0, 896, 1920])},
            },
            "ttft": {"scenario": "ttft", "modes": {"vllm": TTFT_4096}},
        }
    }  # fmt: skip
    paths = report.write_report(doc, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| total prompt tokens (3 turns) | >2M | 6,000 | 6,000 |" in md
    assert "| prompt / computed | 14x | 1.0x | 1.9x |" in md
    assert "| 4,096 | vllm | 0.500 s | 0.050 s | 10.0x |" in md
    pngs = [p for p in paths if p.suffix == ".png"]
    assert {p.name for p in pngs} == {
        "computed_tokens_per_turn.png", "ttft_per_turn.png", "ttft_by_size.png"
    }  # fmt: skip
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_root_cause_skips_warnings_and_wrapper_errors(tmp_path: Path) -> None:
    from kvkeep.bench.deploy.vllm import root_cause

    log = tmp_path / "vllm.log"
    log.write_text(
        "(APIServer) WARNING x.py:1] like `OSError: [Errno 24] Too many open files`.\n"
        "(EngineCore) ERROR core.py:1] ValueError: To serve at least one request ... 16256.\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert root_cause(log) == "ValueError: To serve at least one request ... 16256."
    log.write_text("usage: api_server.py [-h]\napi_server.py: error: argument --x: invalid int\n")
    assert root_cause(log) == "api_server.py: error: argument --x: invalid int"
    assert root_cause(tmp_path / "missing.log") is None


def test_remote_scenarios_have_tables() -> None:
    example = EXAMPLES["agents_replicas"]
    summary = replace(example.summary, turns_per_min=79.9, mean_ttft_s=1.1)
    rates = HitRates(0.72, 0.5, 0.22, {"remote_hit_rate": 0.22})
    shared = to_json(replace(example, summary=summary, rates=rates))
    replicas = {"scenario": "agents_replicas", "modes": {"shared store": shared}}
    assert "| shared store | 79.9 | 72.0% | 50.0% | 22.0% | 1.100 s |" in report.markdown(replicas)
    remote = {
        "scenario": "restart_remote",
        "modes": {"kvkeep": to_json(EXAMPLES["restart_remote"])},
    }
    assert "| kvkeep | 4.000 s | 0.100 s | 0.200 s | 100.0% | 2048 |" in report.markdown(remote)


def _agents(ratio: float, tpm: dict[str, float]) -> dict:
    example = EXAMPLES["agents"]
    modes = {
        m: to_json(replace(example, summary=replace(example.summary, agents=8, turns_per_min=t),
                           fit=PoolFit(ratio, 128)))
        for m, t in tpm.items()
    }  # fmt: skip
    return {"scenario": "agents", "modes": modes}


def test_agents_runs_that_exceed_and_fit_the_pool_are_told_apart(tmp_path: Path) -> None:
    doc = {
        "scenarios": {
            "agents": _agents(2.81, {"none": 60.0, "kvkeep": 350.0}),
            "agents_fit": _agents(0.56, {"none": 500.0, "kvkeep": 1100.0}),
            "restart": {"scenario": "restart", "modes": {
                "none": {}, "kvkeep": to_json(EXAMPLES["restart"])}},
        }
    }  # fmt: skip
    paths = report.write_report(doc, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "### S5: 8 closed-loop agents, working set 2.81x the device pool (exceeds it)" in md
    assert "### S5: 8 closed-loop agents, working set 0.56x the device pool (fits in it)" in md
    assert "Not run for none" in md and "| none | - |" not in md
    assert [p.name for p in paths if p.suffix == ".png"].count("turns_per_min.png") == 1


def test_agents_whose_baselines_sampled_turns_are_compared_on_those_turns() -> None:
    example = EXAMPLES["agents"]

    def mode(every: float, sampled: float) -> dict:
        summary = replace(example.summary, turns_per_min=every)
        units = replace(example.summary, turns_per_min=sampled, late_turn_wait_s=0.5)
        sample = [0, 3, 6, 10, 13, 16, 20, 22, 24, 29]
        return to_json(replace(example, summary=summary, stride=3, sampled=units, sample=sample))

    doc = {"scenario": "agents", "modes": {"none": mode(30.0, 30.0), "kvkeep": mode(90.0, 80.0)}}
    md = report.markdown(doc)
    assert "ran one turn in 3 of each session (10 of 30: turns 0, 3, 6, 10, 13, 16, 20, 22" in md
    # a results.json from before the balanced sample (no "sample") ran the grid
    for m in doc["modes"].values():
        del m["sample"]
    assert "(10 of 30: turns 1, 4, 7, 10, 13, 16, 19, 22, 25, 28;" in report.markdown(doc)
    assert "kvkeep over all its turns: 90.0 turns/min" in md
    assert "| none | 30.0 | 1.000 s | 0.500 s |" in md and "| kvkeep | 80.0 |" in md


def test_the_report_says_where_the_time_went_per_scenario_and_mode() -> None:
    example = EXAMPLES["agents"]
    doc = {
        "scenarios": {"agents": {"scenario": "agents", "modes": {"kvkeep": to_json(example)}}},
        "wall_s": 200.0,
        "timings": {
            "session": {"starts_s": 31.4, "wall_s": 60.2, "modes": {"none": 21.0, "kvkeep": 8.2}},
            "agents": {"starts_s": 0.0, "wall_s": 80.6, "modes": {"none": 44.4, "kvkeep": 21.9}},
            "hol@vllm-defaults": {"starts_s": 20.0, "wall_s": 9.0, "modes": {"vllm": 8.5}},
        },
    }
    md = report.markdown(doc)
    assert "This run took 3 min 20 s (set-up excluded)." in md
    assert "| scenario | engine starts | none | kvkeep | vllm | scenario wall |" in md
    assert "| agents | 0 | 44 | 22 | - | 81 |" in md
    assert "| hol@vllm-defaults | 20 | - | - | 8 | 9 |" in md
    assert "| all | 51 | 65 | 30 | 8 | 150 |" in md


def test_sse_lines_split_only_at_line_ends() -> None:
    """U+2028, U+2029 and U+0085 are legal unescaped in JSON strings: a line reader that
    splits like str.splitlines cut such a chunk in two (seen on a full `bench all`)."""
    import asyncio
    import json

    from kvkeep.traffic.endpoint import sse_lines

    events = [{"choices": [{"text": f"a\u2028b\u2029c\x85d{i}"}]} for i in range(3)]
    wire = (
        "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events).encode()
        + b"data: [DONE]\r\n\r\n"
    )

    async def chunked(size: int):  # type: ignore[no-untyped-def]
        for i in range(0, len(wire), size):
            yield wire[i : i + size]

    async def collect(size: int) -> list[str]:
        return [line async for line in sse_lines(chunked(size))]

    for size in (1, 3, 7, len(wire)):
        lines = [x for x in asyncio.run(collect(size)) if x]
        assert [json.loads(x[6:]) for x in lines[:-1]] == events, size
        assert lines[-1] == "data: [DONE]"


def test_a_failed_scenario_is_reported_and_the_rest_kept(tmp_path: Path) -> None:
    ok = _agents(2.0, {"none": 60.0, "vllm": 70.0, "kvkeep": 350.0})
    doc = {
        "scenarios": {
            "session": {"scenario": "session", "modes": {
                "none": _session([1000, 2000], [0, 0]),
                "vllm": {"error": "JSONDecodeError: Unterminated string"},
                "kvkeep": _session([1000, 2000], [0, 896])}},
            "agents": ok,
            "ttft": {"scenario": "ttft", "modes": {"vllm": TTFT_4096}},
            "hol": {"scenario": "hol", "modes": {m: {"error": "EndpointError: HTTP 500"}
                                                 for m in ("none", "vllm", "kvkeep")}},
        }
    }  # fmt: skip
    report.write_report(doc, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "- session, mode vllm: JSONDecodeError: Unterminated string" in md
    assert md.count("EndpointError: HTTP 500") == 3 and "### S6" not in md
    assert "| claim | study | none | vllm | kvkeep |" in md, "every mode keeps its column"
    assert "| S5 turns/min, agents > pool | ~8 -> ~60 | 60.0 | 70.0 | 350.0 |" in md
    assert report.errors(doc)[0] == ("session", "vllm", "JSONDecodeError: Unterminated string")


def test_the_model_summary_shows_a_sliding_window_models_pattern(tmp_path: Path) -> None:
    from kvkeep.bench.report.environment import model_summary

    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "num_hidden_layers": 6, "sliding_window": 512, "layer_types": layer_types,
              "dtype": "bfloat16", "rope_theta": 10000.0}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    summary = model_summary(tmp_path)
    assert summary["sliding_window"] == 512 and summary["layer_types"] == layer_types
    assert summary["dtype"] == "bfloat16" and "rope_theta" not in summary
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "text_config": config})
    )
    assert model_summary(tmp_path)["sliding_window"] == 512  # multimodal: the text model's


def test_a_kvkeep_tier_a_mode_does_not_have_reads_as_not_measured() -> None:
    example = EXAMPLES["capacity"]
    modes = {"vllm": to_json(replace(example, rates=HitRates(0.0, 0.0, 0.0))),
             "kvkeep": to_json(example)}  # fmt: skip
    md = report.markdown({"scenario": "capacity", "modes": modes})
    assert "| vllm | 0.0% | 0.0% | - | - | 0.300 s |" in md
    assert "| kvkeep | 75.0% | 25.0% | 12.5% | 37.5% | 0.300 s |" in md
