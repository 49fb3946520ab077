"""The layout adapter: whole-block copies through the logical views, for every layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvkeep.vllm.layout import KVLayout, LayoutDescription, UnsupportedLayout

B, H, N, D = 6, 2, 8, 4
C = 2 * D
PAGE = H * N * C * 2  # bf16

# physical axis order of the logical per-layer [B, H, N, C] view, per KVCacheLayout
PHYSICAL = {"LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3), "LHBNC": (1, 0, 2, 3)}


def views(layout: str, layers: int = 3) -> dict[str, torch.Tensor]:
    order = PHYSICAL[layout]
    logical = (B, H, N, C)
    out = {}
    for i in range(layers):
        phys = torch.randn([logical[a] for a in order]).to(torch.bfloat16)
        inverse = [order.index(a) for a in range(4)]
        out[f"layer{i}"] = phys.permute(*inverse)  # a strided logical view, like vLLM's
    return out


def describe(layout: str, layers: int = 3, **kw: object) -> LayoutDescription:
    names = tuple(f"layer{i}" for i in range(layers))
    base = dict(layout=layout, num_blocks=B, block_size=N, num_groups=1,
                layer_names=names, page_size_bytes=PAGE)  # fmt: skip
    base.update(kw)
    return LayoutDescription(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", sorted(PHYSICAL))
def test_gather_then_scatter_round_trips_whole_blocks(layout: str) -> None:
    kv = views(layout)
    adapter = KVLayout.build(describe(layout), kv)
    assert adapter.block_bytes == 3 * PAGE
    buf = np.zeros(adapter.block_bytes, dtype=np.uint8)
    adapter.gather(2, buf)
    before = {name: t.clone() for name, t in kv.items()}
    adapter.scatter(5, buf)
    for name, t in kv.items():
        assert torch.equal(t[5], before[name][2])
        assert torch.equal(t[:5], before[name][:5])  # nothing else touched


def test_pages_are_in_logical_order_whatever_the_layout() -> None:
    a, b = views("LBHNC"), views("LBNHC")
    for name in a:
        b[name].copy_(a[name])
    bufs = []
    for layout, kv in (("LBHNC", a), ("LBNHC", b)):
        buf = np.zeros(3 * PAGE, dtype=np.uint8)
        KVLayout.build(describe(layout), kv).gather(1, buf)
        bufs.append(buf)
    assert np.array_equal(bufs[0], bufs[1])


def test_shared_layers_are_copied_once() -> None:
    kv = views("LBHNC", layers=2)
    kv["layer2"] = kv["layer0"]
    assert KVLayout.build(describe("LBHNC"), kv).num_layers == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_groups": 2}, "KV cache groups"),
        ({"layout": "XYZ"}, "not one kvkeep knows"),
        ({"page_size_bytes": PAGE + 64}, "padded or packed"),
        ({"num_blocks": B + 1}, "disagrees with the cache config"),
        ({"block_size": N // 2}, "disagrees with the cache config"),
        ({"layer_names": ("layer0", "missing")}, "was not registered"),
    ],
)
def test_unsupported_layouts_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(UnsupportedLayout, match=message):
        KVLayout.build(describe("LBHNC")._replace(**change), views("LBHNC"))


def test_non_uniform_layers_and_non_4d_views_are_refused() -> None:
    kv = views("LBHNC")
    kv["layer1"] = kv["layer1"].float()
    with pytest.raises(UnsupportedLayout):
        KVLayout.build(describe("LBHNC", page_size_bytes=PAGE), kv)
    flat = {f"layer{i}": torch.zeros(B, H * N * C, dtype=torch.bfloat16) for i in range(3)}
    with pytest.raises(UnsupportedLayout, match="logical"):
        KVLayout.build(describe("LBHNC"), flat)


def test_a_wrong_buffer_size_is_an_error() -> None:
    adapter = KVLayout.build(describe("LBHNC"), views("LBHNC"))
    with pytest.raises(ValueError, match="uint8"):
        adapter.scatter(0, np.zeros(10, dtype=np.uint8))


# vLLM 0.32 carves every layer out of one backing allocation, in the physical axis order of
# logical [L, B, H, N, C] that KVCacheLayout names (v1/kv_cache_layout.py). CUDA uses LBNHC
# (FlashAttention's default), LBHNC and BLHNC (FlashInfer on Blackwell, trtllm-gen kernels:
# head-major block interiors); the CPU backend uses LBHNC.
STRIDE_ORDER = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}  # fmt: skip


def shared_views(layout: str, layers: int = 3) -> dict[str, torch.Tensor]:
    """Per-layer logical [B, H, N, C] views of one allocation, as vLLM registers them."""
    order = STRIDE_ORDER[layout]
    logical = (layers, B, H, N, C)
    phys = torch.randn([logical[a] for a in order]).to(torch.bfloat16)
    five = phys.permute(*[order.index(a) for a in range(5)])  # logical [L, B, H, N, C]
    return {f"layer{i}": five[i] for i in range(layers)}


@pytest.mark.parametrize("layout", sorted(STRIDE_ORDER))
def test_batched_copies_match_block_by_block_copies_in_every_layout(layout: str) -> None:
    kv = shared_views(layout)
    adapter = KVLayout.build(describe(layout), kv)
    assert adapter.fused  # one allocation, evenly spaced layers: one op per batch
    ids = torch.tensor([4, 1, 3])
    rows = torch.zeros(3, adapter.block_bytes, dtype=torch.uint8)
    adapter.gather_blocks(ids, rows)
    for j, b in enumerate(ids.tolist()):
        one = np.zeros(adapter.block_bytes, dtype=np.uint8)
        adapter.gather(b, one)
        assert np.array_equal(rows[j].numpy(), one), (layout, b)
        for i in range(3):  # the kvkeep block is layer after layer of logical pages
            page = rows[j, i * PAGE : (i + 1) * PAGE].view(torch.bfloat16).view(H, N, C)
            assert torch.equal(page, kv[f"layer{i}"][b])


@pytest.mark.parametrize("layout", sorted(STRIDE_ORDER))
@pytest.mark.parametrize("shared", [True, False])
def test_scatter_blocks_writes_exactly_the_named_blocks(layout: str, shared: bool) -> None:
    kv = shared_views(layout) if shared else views(layout) if layout in PHYSICAL else None
    if kv is None:
        pytest.skip("separate-tensor views are built for the per-layer layouts only")
    adapter = KVLayout.build(describe(layout), kv)
    assert adapter.fused == shared
    before = {name: t.clone() for name, t in kv.items()}
    rows = torch.zeros(2, adapter.block_bytes, dtype=torch.uint8)
    adapter.gather_blocks(torch.tensor([0, 2]), rows)
    adapter.scatter_blocks(torch.tensor([5, 3]), rows)
    for name, t in kv.items():
        assert torch.equal(t[5], before[name][0]) and torch.equal(t[3], before[name][2])
        for b in (0, 1, 2, 4):
            assert torch.equal(t[b], before[name][b]), (name, b)


def test_a_batch_of_the_wrong_shape_is_an_error() -> None:
    adapter = KVLayout.build(describe("LBHNC"), shared_views("LBHNC"))
    with pytest.raises(ValueError, match=r"uint8 \[2, "):
        adapter.gather_blocks(torch.tensor([0, 1]), torch.zeros(2, 10, dtype=torch.uint8))
