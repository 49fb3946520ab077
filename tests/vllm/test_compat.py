"""What kvkeep refuses: requests its keys cannot describe, and engines it would cache wrongly.

Built from vLLM's real request, LoRA, multimodal and KV cache spec classes; only VllmConfig is
a stand-in (a real one needs a model), holding vLLM's real ParallelConfig and KVTransferConfig.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig, ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request

from kvkeep.host.cpu_pool import GENERATED_WEIGHTS
from kvkeep.keys import Namespace
from kvkeep.server.client import CacheUnavailable, KVKeepClient, LookupResult
from kvkeep.vllm import compat
from kvkeep.vllm.book import RequestBook
from kvkeep.vllm.compat import UnsupportedConfig, check_supported, unkeyable_reason
from kvkeep.vllm.connector import (
    KVKeepConnector,
    KVKeepHandshake,
    KVKeepPromMetrics,
    SchedulerSide,
)
from kvkeep.vllm.counters import COUNTER_NAMES

BS = 16


def request(req_id: str = "r", n: int = 3 * BS + 1, **kw: Any) -> Request:
    tokens = None if "prompt_embeds" in kw else list(range(100, 100 + n))
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, **kw)


def lora() -> LoRARequest:
    return LoRARequest("adapter", 1, "/adapters/adapter")


def image(offset: int = 2, length: int = 20) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier="img-1",
        mm_position=PlaceholderRange(offset, length),
    )


# --- requests kvkeep cannot key ---------------------------------------------------------------


def test_a_plain_request_is_keyable() -> None:
    assert unkeyable_reason(request(cache_salt="s")) is None  # the salt is in kvkeep's keys


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"lora_request": lora()}, "lora"),
        ({"mm_features": [image()]}, "multimodal"),
        ({"prompt_embeds": torch.zeros(3 * BS + 1, 8)}, "prompt_embeds"),
    ],
    ids=["lora", "multimodal", "prompt_embeds"],
)
def test_requests_with_vllm_extra_keys_are_unkeyable(kw: dict[str, Any], reason: str) -> None:
    assert unkeyable_reason(request(**kw)) == reason
    assert f"unkeyable_{reason}" in COUNTER_NAMES
    assert KVKeepPromMetrics._EVENTS[f"unkeyable_{reason}"] == f"unkeyable_{reason}"


def test_prompt_embeds_would_collide_on_token_ids() -> None:
    """Why embeddings must not be keyed by token ids: vLLM gives them ids of all zeros."""
    a = request("a", prompt_embeds=torch.zeros(BS, 8))
    b = request("b", prompt_embeds=torch.ones(BS, 8))
    assert list(a.all_token_ids) == list(b.all_token_ids) == [0] * BS


# --- the scheduler side neither looks them up nor saves them ---------------------------------

NS = Namespace(model_digest="m", kv_dtype="bf16", layout="LBHNC", backend="cpu/vec", block_size=BS)


class FakeClient:
    """The cache server, down at HELLO and holding every block at LOOKUP; records lookups."""

    socket_path = "/nonexistent/kvkeep.sock"
    session = staticmethod(KVKeepClient.session)

    timeout_s = 1.0

    def __init__(self) -> None:
        self.lookups: list[int] = []
        self.touches: list[list[bytes]] = []

    def hello(self, *args: Any) -> None:
        raise CacheUnavailable("down")

    def sibling(self) -> FakeClient:
        return self

    def touch(self, session: Any, keys: list[bytes]) -> None:
        self.touches.append(list(keys))

    def lookup(self, session: Any, keys: list[bytes]) -> LookupResult:
        self.lookups.append(len(keys))
        return LookupResult(len(keys), ("ram",) * len(keys))


def kv_cache_manager(num_blocks: int = 64) -> KVCacheManager:
    """A real vLLM KV cache manager of one full-attention group of BS-token blocks."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer0"], spec)])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS)


def bound(client: Any, *args: Any, **kwargs: Any) -> SchedulerSide:
    """A scheduler side bound to a real KV cache manager, as vLLM's scheduler binds one at
    start-up (without one, no load is synchronous)."""
    side = SchedulerSide(None, None, client, *args, **kwargs)
    side.bind(kv_cache_manager())
    return side


def fake_namespaces(
    monkeypatch: pytest.MonkeyPatch, spaces: list[Namespace], known: str | None = NS.backend
) -> None:
    """``compat.namespace`` answers ``spaces[group]`` (under the backend given, if any), and
    the engine core knows the backend itself unless ``known`` is None (as on CPU)."""

    def namespace(
        vllm_config: Any, kv_cache_config: Any, group: int = 0, backend: str | None = None
    ) -> Namespace:
        return replace(spaces[group], backend=backend or spaces[group].backend)

    monkeypatch.setattr(compat, "namespace", namespace)
    monkeypatch.setattr(compat, "known_backend", lambda vllm_config: known)


@pytest.fixture
def side(monkeypatch: pytest.MonkeyPatch) -> tuple[SchedulerSide, FakeClient]:
    fake_namespaces(monkeypatch, [NS])
    monkeypatch.setattr(compat, "expected_block_bytes", lambda kv_cache_config, group=0: 1024)
    monkeypatch.setattr(compat, "group_windows", lambda kv_cache_config: (None,))
    client = FakeClient()
    return bound(client), client


def blocks(n: int) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in range(n)],))


def first_step(req: Request) -> Any:
    """The fields of vLLM's SchedulerOutput that the plan reads: ``req``'s whole prompt
    scheduled in its first step, in engine blocks 0..3."""
    new = SimpleNamespace(req_id=req.request_id, block_ids=([0, 1, 2, 3],), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: req.num_tokens},
    )


def test_a_plain_request_is_looked_up_tracked_and_saved(
    side: tuple[SchedulerSide, FakeClient],
) -> None:
    scheduler, client = side
    req = request()
    assert scheduler.match(req, 0) == (3 * BS, False)  # no threshold: synchronous
    assert client.lookups == [3]
    scheduler.after_alloc(req, blocks(4), 0)  # say vLLM did not take the hit
    assert scheduler.book.tracking(req.request_id)
    plans = scheduler.plan(first_step(req))
    assert plans is not None and len(plans) == 1
    plan = plans[0]
    assert [s.block_id for s in plan.saves] == [0, 1, 2]


def test_the_prefix_vllm_serves_itself_is_touched_once_off_the_thread(
    side: tuple[SchedulerSide, FakeClient],
) -> None:
    scheduler, client = side
    req = request()
    assert scheduler.match(req, 2 * BS) == (BS, False)  # vLLM holds 2 blocks; kvkeep has the 3rd
    assert client.lookups == [1], "the LOOKUP still asks only beyond vLLM's hit"
    scheduler.after_alloc(req, blocks(4), BS)
    scheduler.touches.flush()
    keys = scheduler.book.leading_keys(req.request_id, 3)
    assert client.touches == [keys[:2]], "one TOUCH, of exactly the device-hit blocks"
    cold = request("cold")
    scheduler.match(cold, 0)
    scheduler.after_alloc(cold, blocks(4), 3 * BS)
    scheduler.touches.flush()
    assert len(client.touches) == 1, "no device hit, nothing to refresh"


class HelloClient(FakeClient):
    """Up at HELLO: records the namespaces announced."""

    def __init__(self) -> None:
        super().__init__()
        self.hellos: list[bytes] = []

    def hello(self, digest: bytes, *args: Any) -> None:
        self.hellos.append(digest)


def handshake_connector(scheduler: SchedulerSide) -> KVKeepConnector:
    """A scheduler-side connector around ``scheduler``, without vLLM's config."""
    connector = object.__new__(KVKeepConnector)
    connector._scheduler, connector._workers = scheduler, []
    return connector


def test_on_cpu_the_scheduler_keys_under_the_backend_the_workers_hand_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine core does not import vLLM's CPU attention module to learn the ISA (0.6 s
    of start-up): the workers' handshake brings it, before any request, and only then does
    the scheduler side announce its namespace and key requests under it."""
    fake_namespaces(monkeypatch, [NS], known=None)
    monkeypatch.setattr(compat, "expected_block_bytes", lambda kv_cache_config, group=0: 1024)
    monkeypatch.setattr(compat, "group_windows", lambda kv_cache_config: (None,))
    monkeypatch.setattr(compat, "attention_backend", lambda *a: pytest.fail("imported here"))
    client = HelloClient()
    scheduler = bound(client)
    assert client.hellos == [], "no namespace is announced before the backend is known"
    sent = pickle.loads(pickle.dumps(KVKeepHandshake("cpu_attn/amx")))  # as vLLM ships it
    handshake_connector(scheduler).set_xfer_handshake_metadata({0: sent})
    adopted = replace(NS, backend="cpu_attn/amx")
    assert scheduler.namespace == adopted
    assert client.hellos == [adopted.digest()]
    req = request()
    assert scheduler.match(req, 0) == (3 * BS, False)
    expected = RequestBook(adopted).keys_for("other", req.prompt_token_ids, None)
    assert scheduler.book.keys_for(req.request_id, req.prompt_token_ids, None) == expected
    assert expected != RequestBook(NS).keys_for("other", req.prompt_token_ids, None)


def test_without_a_handshake_the_first_request_finds_the_backend_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_namespaces(monkeypatch, [NS], known=None)
    monkeypatch.setattr(compat, "expected_block_bytes", lambda kv_cache_config, group=0: 1024)
    monkeypatch.setattr(compat, "group_windows", lambda kv_cache_config: (None,))
    monkeypatch.setattr(compat, "attention_backend", lambda *a: "cpu_attn/vec16")
    client = HelloClient()
    scheduler = bound(client)
    assert scheduler.match(request(), 0) == (3 * BS, False)
    assert scheduler.namespace.backend == "cpu_attn/vec16"
    assert client.hellos == [scheduler.namespace.digest()]
    handshake_connector(scheduler).set_xfer_handshake_metadata({0: KVKeepHandshake("late")})
    assert scheduler.namespace.backend == "cpu_attn/vec16", "keys never change under requests"


def test_a_worker_that_cannot_tell_its_backend_hands_over_nothing_and_start_up_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connector = object.__new__(KVKeepConnector)
    connector._workers = [SimpleNamespace(vllm_config=None, kv_cache_config=None)]  # type: ignore[list-item]
    monkeypatch.setattr(compat, "attention_backend", lambda *a: "cpu_attn/vec")
    found = connector.get_handshake_metadata()
    assert isinstance(found, KVKeepHandshake) and found.backend == "cpu_attn/vec"

    def broken(*a: Any) -> str:
        raise RuntimeError("no ISA")

    monkeypatch.setattr(compat, "attention_backend", broken)
    assert connector.get_handshake_metadata() is None


def test_a_big_hit_loads_asynchronously_and_saves_after_it_when_vllm_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the threshold the hit is asynchronous and its load says so; when vLLM admits the
    request again (external 0, ``num_computed_tokens`` set to what loaded, here truncated at
    a failed block 2), the plan saves from the failed block on, not the loaded ones."""
    fake_namespaces(monkeypatch, [NS])
    monkeypatch.setattr(compat, "expected_block_bytes", lambda kv_cache_config, group=0: 1024)
    monkeypatch.setattr(compat, "group_windows", lambda kv_cache_config: (None,))
    scheduler = bound(FakeClient(), load_async_min_blocks=3)
    small = bound(FakeClient(), load_async_min_blocks=4)
    req = request()
    assert small.match(req, 0) == (3 * BS, False)
    assert scheduler.match(req, 0) == (3 * BS, True)
    scheduler.after_alloc(req, blocks(3), 3 * BS)
    plan = scheduler.plan(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set())))[0]  # fmt: skip
    assert [r.background for r in plan.loads] == [True]
    req.num_computed_tokens = 2 * BS  # vLLM truncated the request at the failed block
    scheduler.after_alloc(req, blocks(4), 0)
    new = SimpleNamespace(req_id=req.request_id, block_ids=([0, 1, 2, 3],),
                          num_computed_tokens=2 * BS)  # fmt: skip
    step = first_step(req)
    step.scheduled_new_reqs = [new]
    step.num_scheduled_tokens = {req.request_id: BS + 1}
    plans = scheduler.plan(step)
    assert plans is not None
    plan = plans[0]
    assert plan.loads == ()
    assert [s.block_id for s in plan.saves] == [2]


def test_auto_loads_a_big_hit_synchronously_when_no_other_request_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With "auto" (``sync_when_alone``) and alone, a hit over the threshold loads on the
    step; with another request tracked beside it, in the background. The answer is decided once per
    admission attempt: asked again with the same inputs, vLLM hears the same, and the plan
    loads the way vLLM was told even after the other request finished."""
    fake_namespaces(monkeypatch, [NS])
    monkeypatch.setattr(compat, "expected_block_bytes", lambda kv_cache_config, group=0: 1024)
    monkeypatch.setattr(compat, "group_windows", lambda kv_cache_config: (None,))
    scheduler = bound(FakeClient(), 3, sync_when_alone=True)
    alone = request("alone")
    assert scheduler.match(alone, 0) == (3 * BS, False)
    scheduler.after_alloc(alone, blocks(3), 3 * BS)
    beside = request("beside")
    assert scheduler.match(beside, 0) == (3 * BS, True)
    scheduler.finished("alone")
    assert scheduler.match(beside, 0) == (3 * BS, True)  # memoised: what vLLM was told
    scheduler.after_alloc(beside, blocks(3), 3 * BS)
    step = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set()))  # fmt: skip
    plans = scheduler.plan(step)
    assert plans is not None
    assert [(r.req_id, r.background) for r in plans[0].loads] == [
        ("alone", False),
        ("beside", True),
    ]


def test_a_lora_request_is_not_looked_up_nor_saved(
    side: tuple[SchedulerSide, FakeClient],
) -> None:
    scheduler, client = side
    req = request(lora_request=lora())
    for _ in range(2):  # vLLM asks again on each admission attempt, and after a preemption
        assert scheduler.match(req, 0) == (0, False)
        scheduler.after_alloc(req, blocks(4), 0)
    assert client.lookups == []
    assert not scheduler.book.tracking(req.request_id)
    plans = scheduler.plan(first_step(req))
    assert plans is not None
    assert plans[0].saves == ()
    assert _events(scheduler.counters.take()) == {"unkeyable_lora": 1}  # once per request
    scheduler.finished(req.request_id)
    scheduler.after_alloc(request(req.request_id, mm_features=[image()]), blocks(4), 0)
    assert _events(scheduler.counters.take()) == {"unkeyable_multimodal": 1}  # a new one


# --- engines kvkeep refuses at start-up --------------------------------------------------------


def full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=kw.pop("head_size", 64), dtype=torch.bfloat16, **kw
    )


def sliding(**kw: Any) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=kw.pop("block_size", BS), num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
        sliding_window=kw.pop("window", 128), **kw,
    )  # fmt: skip


def test_a_hybrid_of_sliding_window_and_full_groups_is_accepted() -> None:
    """vLLM's hybrid KV cache manager on (Gemma 3): each group is kept on its own, and the
    namespaces of two groups differ, so their blocks never mix."""
    config = cache_config(sliding(), sliding(), full())
    check_supported(engine(), config)
    assert compat.group_windows(config) == (128, 128, None)
    labels = {compat._group_label(config, g) for g in range(3)}
    assert len(labels) == 3 and all(label.startswith("g") for label in labels)


def cache_config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"g{g}.l{i}" for i in range(2)], s) for g, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def engine(**parallel: int) -> Any:
    return SimpleNamespace(
        parallel_config=ParallelConfig(**parallel),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVKeepConnector",
            kv_connector_module_path="kvkeep.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"socket": "/nonexistent/kvkeep.sock"},
        ),
    )


def mla(**kw: Any) -> MLAAttentionSpec:
    """A DeepSeek-V2/V3 latent page: one 512 + 64 latent per token, shared by every head."""
    return MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, **kw
    )


@pytest.mark.parametrize(
    "spec",
    [full(), full(sliding_window=4096), mla()],  # a sliding window with vLLM's HMA off
    ids=["full", "full-with-window", "mla"],
)
def test_plain_full_attention_is_accepted(spec: FullAttentionSpec) -> None:
    check_supported(engine(), cache_config(spec))
    check_supported(engine(tensor_parallel_size=2), cache_config(spec))


def test_pipeline_parallelism_is_refused() -> None:
    with pytest.raises(UnsupportedConfig) as err:
        check_supported(engine(pipeline_parallel_size=2), cache_config(full()))
    message = str(err.value)
    assert "pipeline_parallel_size=2" in message
    assert "pipeline stage" in message
    assert "--pipeline-parallel-size 1" in message


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("decode_context_parallel_size", "--decode-context-parallel-size 1"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size 1"),
    ],
)
def test_context_parallelism_is_refused(field: str, flag: str) -> None:
    parallel = ParallelConfig(tensor_parallel_size=2)
    object.__setattr__(parallel, field, 2)  # validation wants real ranks; the value is enough
    with pytest.raises(UnsupportedConfig, match=f"{field}=2.*{flag}"):
        check_supported(SimpleNamespace(parallel_config=parallel), cache_config(full()))


def mixed_head_sizes() -> UniformTypeKVCacheSpecs:
    spec = UniformTypeKVCacheSpecs.from_specs({"l0": full(), "l1": full(head_size=128)})
    assert spec is not None
    return spec


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (None, "given none"),
        (cache_config(), "no KV cache"),
        (cache_config(mixed_head_sizes()), "different KV specs"),
        (cache_config(mla(cache_role=SparseCacheRole.INDEXER)), "sparse or compressed MLA"),
        (cache_config(mla(cache_dtype_str="fp8_ds_mla")), "sparse or compressed MLA"),
        (cache_config(mla(model_version="deepseek_v4")), "sparse or compressed MLA"),
        (
            cache_config(MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))),
            "Mamba",
        ),
        (
            cache_config(full(), sliding(window=256, extra_retained_tokens=1)),
            "below its window",
        ),
        (cache_config(full(), sliding(block_size=2 * BS)), "different block sizes"),
        (cache_config(sliding()), "not plain full attention"),
        (
            cache_config(
                SinkFullAttentionSpec(
                    block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sink_len=4
                )
            ),
            "not plain full attention",
        ),
        (cache_config(full(non_causal=True)), "non-causal"),
        (cache_config(full(tokens_per_state=4)), "covers 4 tokens"),
    ],
    ids=[
        "none",
        "no-groups",
        "mixed-heads",
        "mla-indexer",
        "mla-fp8-ds",
        "mla-v4",
        "mamba",
        "sliding-extra-retained",
        "groups-of-two-block-sizes",
        "sliding-window-alone",
        "sink",
        "non-causal",
        "compressed",
    ],
)
def test_kv_specs_kvkeep_cannot_describe_are_refused(config: Any, words: str) -> None:
    with pytest.raises(UnsupportedConfig) as err:
        check_supported(engine(), config)
    assert words in str(err.value)
    assert "run without the kvkeep connector" in str(err.value)


def test_the_connector_refuses_before_it_connects() -> None:
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedConfig, match="pipeline_parallel_size=2"):
            KVKeepConnector(engine(pipeline_parallel_size=2), role, cache_config(full()))
        with pytest.raises(UnsupportedConfig, match="different KV specs"):
            KVKeepConnector(engine(), role, cache_config(mixed_head_sizes()))


def test_weights_fingerprint_tells_checkpoints_apart(tmp_path: Path) -> None:
    """Same directory, same config, other weights: another namespace. Hub ids have none."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a" * 3_000_000)
    first = compat.weights_fingerprint(str(tmp_path))
    assert first is not None and first == compat.weights_fingerprint(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"a" * 2_999_999 + b"b")
    assert compat.weights_fingerprint(str(tmp_path)) != first
    assert compat.weights_fingerprint("Qwen/Qwen2.5-Coder-7B-Instruct") is None


def _events(counts: dict[str, float] | None) -> dict[str, float]:
    """Counters without the profile's seconds."""
    return {k: v for k, v in (counts or {}).items() if not k.endswith("_s")}


def test_generated_weights_are_refused_at_start_up() -> None:
    """vLLM's generated weights make every reply independent of its context: no KV check could
    fail, so the connector refuses them and names the fix."""
    made_up = engine()
    made_up.load_config = SimpleNamespace(load_format=GENERATED_WEIGHTS)
    with pytest.raises(UnsupportedConfig, match="own weights"):
        check_supported(made_up, cache_config(full()))
    made_up.load_config = SimpleNamespace(load_format="safetensors")
    check_supported(made_up, cache_config(full()))


# --- a hybrid's hit rule ----------------------------------------------------------------------


class GroupClient(FakeClient):
    """Holds, per namespace, the keys ``present`` says; LOOKUP answers the leading run."""

    def __init__(self) -> None:
        super().__init__()
        self.present: dict[bytes, set[bytes]] = {}

    def lookup(self, session: Any, keys: list[bytes]) -> LookupResult:
        held = self.present.get(session.digest, set())
        n = next((i for i, k in enumerate(keys) if k not in held), len(keys))
        return LookupResult(n, ("ram",) * n)


def hybrid_side(monkeypatch: pytest.MonkeyPatch) -> tuple[SchedulerSide, GroupClient]:
    """Group 0 slides over 2 blocks (window 2 * BS + 1), group 1 is full attention."""
    spaces = [replace(NS, layout=f"LBHNC/g{g}") for g in range(2)]
    fake_namespaces(monkeypatch, spaces)
    monkeypatch.setattr(compat, "expected_block_bytes", lambda kv_cache_config, group=0: 1024)
    monkeypatch.setattr(compat, "group_windows", lambda kv_cache_config: (2 * BS + 1, None))
    client = GroupClient()
    return SchedulerSide(None, None, client), client  # type: ignore[arg-type]


def test_a_hybrid_hit_needs_the_full_prefix_and_only_the_sliding_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 6-block prompt (claimable 5 blocks): the full group holds all 5, the sliding group
    only blocks 3 and 4 (the window before the hit) -> a hit of 5 blocks, loaded in the
    background. Without the sliding block 3 there is no hit."""
    scheduler, client = hybrid_side(monkeypatch)
    req = request(n=6 * BS)
    swa, full = (b.keys_for(req.request_id, req.all_token_ids, None) for b in scheduler.books)
    client.present[scheduler.sessions[1].digest] = set(full[:5])
    client.present[scheduler.sessions[0].digest] = set(swa[3:5])
    assert scheduler.match(req, 0) == (5 * BS, True)
    other = request("other", n=6 * BS)
    client.present[scheduler.sessions[0].digest] = {swa[4]}
    assert scheduler.match(other, 0) == (0, False)
    assert swa[0] != full[0], "the groups' keys differ"


def test_a_state_hybrids_claim_steps_back_to_the_last_boundary_with_a_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Group 0 holds recurrent state (a window of one block), group 1 is full attention. A
    9-block prompt (claimable 8) whose attention KV kvkeep holds for 8 blocks, with a state
    after 5 blocks only: the claim is 5 blocks (every group has what that needs), and the
    branch at 8 is remembered so a state is kept there. No state at all: no hit."""
    spaces = [replace(NS, layout=f"state/g{g}") for g in range(2)]
    fake_namespaces(monkeypatch, spaces)
    monkeypatch.setattr(compat, "expected_block_bytes", lambda kv_cache_config, group=0: 1024)
    monkeypatch.setattr(compat, "group_windows", lambda kv_cache_config: (BS, None))
    monkeypatch.setattr(compat, "group_states", lambda kv_cache_config, n: (True, False))
    client = GroupClient()
    scheduler = SchedulerSide(None, None, client)  # type: ignore[arg-type]
    req = request(n=9 * BS)
    state, full = (b.keys_for(req.request_id, req.all_token_ids, None) for b in scheduler.books)
    client.present[scheduler.sessions[1].digest] = set(full[:8])
    client.present[scheduler.sessions[0].digest] = {state[4]}
    assert scheduler.match(req, 0) == (5 * BS, True)
    assert scheduler.books[0]._branches[req.request_id] == 8
    client.present[scheduler.sessions[0].digest] = set()
    assert scheduler.match(request("other", n=9 * BS), 0) == (0, False)


# --- MLA: one copy of the latent for every tensor-parallel rank -----------------------------------


def test_an_mla_latent_is_keyed_once_for_every_tp_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every TP rank holds the same latent: an MLA group's workers all key under rank 0, and
    only rank 0 saves; a full-attention group's rank 1 keys and saves its own shard. The
    namespace says the pages are MLA latents, so no other KV ever shares their keys."""
    from kvkeep.vllm.worker_side import WorkerSide

    client = KVKeepClient(socket_path="/nonexistent/kvkeep.sock", timeout_s=0.1)
    monkeypatch.setattr(compat, "tp_rank_size", lambda vllm_config: (1, 2))
    latent = WorkerSide(engine(tensor_parallel_size=2), cache_config(mla()), client)
    shard = WorkerSide(engine(tensor_parallel_size=2), cache_config(full()), client)
    assert (latent.key_rank, latent.saves) == (0, False)
    assert (shard.key_rank, shard.saves) == (1, True)
    monkeypatch.setattr(compat, "tp_rank_size", lambda vllm_config: (0, 2))
    assert WorkerSide(engine(tensor_parallel_size=2), cache_config(mla()), client).saves
    assert compat.latent(cache_config(mla())) and not compat.latent(cache_config(full()))
    assert compat.latent(cache_config(full(), mla()), 1)
