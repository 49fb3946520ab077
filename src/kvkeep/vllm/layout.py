"""How a kvkeep block maps onto the engine's paged KV tensors, and the copies between them.

A kvkeep block holds one engine block of every layer, layer after layer::

    block bytes = [ layer 0 page | layer 1 page | ... | layer L-1 page ]
    page        = the layer's logical [H, N, C] view of that block, C-order

Copies go through the logical ``[B, H, N, C]`` view vLLM hands ``register_kv_caches`` per
layer, so one code path serves every physical layout. A page's bytes stay opaque: whole
blocks are copied, never token slices. ``gather_blocks``/``scatter_blocks`` move a step's
blocks with one op per layer, or one in all when the layers are evenly spaced views of one
allocation. Anything the adapter cannot account for exactly (several KV cache groups, a padded
page, a view whose shape disagrees with the cache config, an unknown layout name) stops
start-up with ``UnsupportedLayout``; its bytes are never guessed. Imports torch, not vllm.
Layouts and the fused view: docs/notes/kv-layout.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

KNOWN_LAYOUTS = frozenset({"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"})


class UnsupportedLayout(ValueError):
    """The engine's KV cache is laid out in a way kvkeep does not copy. Says what and why."""


class LayoutDescription(NamedTuple):
    """vLLM's own description of the KV cache, extracted by ``compat`` (plain values)."""

    layout: str  # a KVCacheLayout name, e.g. "LBHNC"
    num_blocks: int
    block_size: int
    num_groups: int
    layer_names: tuple[str, ...]  # the single group's layers, in order
    page_size_bytes: int  # the spec's page, padding included (a state group's: its content)
    state: bool = False  # a recurrent state group: a [blocks, 1, 1, bytes] int8 view per layer


@dataclass(frozen=True)
class _Layer:
    name: str
    view: torch.Tensor  # logical [B, H, N, C]


class KVLayout:
    """Gathers and scatters whole blocks between engine KV views and flat byte buffers.

    Build with ``KVLayout.build``; ``gather``/``scatter`` copy, block until the copy is done
    (a device copy from or to host memory is synchronous), and raise only on a buffer of the
    wrong size.
    """

    def __init__(self, description: LayoutDescription, layers: Sequence[_Layer]) -> None:
        self.description = description
        self._layers = tuple(layers)
        first = self._layers[0].view
        self.page_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        self.page_bytes = first[0].numel() * first.element_size()
        self.block_bytes = self.page_bytes * len(self._layers)
        self._fused = fused_view([layer.view for layer in self._layers])

    @property
    def fused(self) -> bool:
        """Whether one op moves all layers of a batch of blocks (see ``fused_view``)."""
        return self._fused is not None

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @classmethod
    def build(
        cls, description: LayoutDescription, kv_caches: Mapping[str, torch.Tensor]
    ) -> KVLayout:
        """Validate vLLM's description against the tensors it registered; raises
        UnsupportedLayout naming the mismatch. Layers that share one tensor are kept once."""
        _check_description(description)
        layers, seen = [], set()
        for name in description.layer_names:
            if name not in kv_caches:
                raise UnsupportedLayout(f"layer {name} of the cache config was not registered")
            view = kv_caches[name]
            _check_view(name, view, description)
            if (view.data_ptr(), tuple(view.stride())) not in seen:
                seen.add((view.data_ptr(), tuple(view.stride())))
                layers.append(_Layer(name, view))
        if not layers:
            raise UnsupportedLayout("the KV cache has no attention layers to copy")
        _check_uniform(layers)
        return cls(description, layers)

    def gather(self, block_id: int, out: np.ndarray) -> None:
        """Copy every layer of engine block ``block_id`` into ``out`` (uint8, block_bytes)."""
        flat = self._flat(out)
        if self._fused is not None:
            self._block(flat).copy_(self._fused[block_id])
            return
        for i, layer in enumerate(self._layers):
            self._page(flat, i).copy_(layer.view[block_id])

    def scatter(self, block_id: int, data: np.ndarray) -> None:
        """Copy ``data`` (uint8, block_bytes) into every layer of engine block ``block_id``."""
        flat = self._flat(data)
        if self._fused is not None:
            self._fused[block_id].copy_(self._block(flat))
            return
        for i, layer in enumerate(self._layers):
            layer.view[block_id].copy_(self._page(flat, i))

    def gather_blocks(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy engine blocks ``block_ids`` (int64, n) into the rows of ``out`` (uint8,
        ``[n, block_bytes]``, contiguous, on the cache's device): row j = block_ids[j]'s bytes.
        One op per layer, or one in all when fused. Asynchronous on a CUDA stream."""
        stage = self._stage(block_ids, out)
        if self._fused is not None:
            torch.index_select(self._fused, 0, block_ids, out=stage)
            return
        for i, layer in enumerate(self._layers):
            torch.index_select(layer.view, 0, block_ids, out=stage[:, i])

    def scatter_blocks(self, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Copy the rows of ``data`` (as in ``gather_blocks``) into engine blocks
        ``block_ids``, which must be distinct. One op per layer, or one in all when fused."""
        stage = self._stage(block_ids, data)
        if self._fused is not None:
            self._fused.index_copy_(0, block_ids, stage)
            return
        for i, layer in enumerate(self._layers):
            layer.view.index_copy_(0, block_ids, stage[:, i])

    def _stage(self, block_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        n = block_ids.numel()
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (n, self.block_bytes):
            raise ValueError(
                f"a batch of {n} blocks is uint8 [{n}, {self.block_bytes}], "
                f"got {rows.dtype} {tuple(rows.shape)}"
            )
        return rows.view(self.dtype).view(n, self.num_layers, *self.page_shape)

    def _block(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.dtype).view(self.num_layers, *self.page_shape)

    def _flat(self, buf: np.ndarray) -> torch.Tensor:
        if buf.dtype != np.uint8 or buf.size != self.block_bytes:
            raise ValueError(f"a block buffer is {self.block_bytes} uint8, got {buf.size}")
        return torch.from_numpy(buf)

    def _page(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        raw = flat[layer * self.page_bytes : (layer + 1) * self.page_bytes]
        return raw.view(self.dtype).view(self.page_shape)


def fused_view(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A ``[B, L, H, N, C]`` view over per-layer ``[B, H, N, C]`` views, when they are equal
    in shape, dtype and strides, share one storage and start evenly spaced (layer l at
    ``first + l * step``, ``step > 0``); else None. ``fused[b]`` is block b of every layer,
    in the order of ``views``: for BLHNC one contiguous run, the kvkeep block as it is."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(1)
    size = first.element_size()
    step, rest = divmod(views[1].data_ptr() - first.data_ptr(), size)
    storage = first.untyped_storage().data_ptr()
    for i, view in enumerate(views):
        same = (view.shape, view.stride(), view.dtype) == (first.shape, first.stride(), first.dtype)
        if not same or view.untyped_storage().data_ptr() != storage:
            return None
        if view.data_ptr() != first.data_ptr() + i * step * size:
            return None
    if rest or step <= 0:
        return None
    b, h, n, c = first.stride()
    return first.as_strided(
        (first.shape[0], len(views), *first.shape[1:]), (b, step, h, n, c), first.storage_offset()
    )


def _check_description(d: LayoutDescription) -> None:
    if d.num_groups != 1:
        raise UnsupportedLayout(
            f"{d.num_groups} KV cache groups (a hybrid or sliding-window model); kvkeep "
            "handles models with one group of full-attention layers"
        )
    if d.layout not in KNOWN_LAYOUTS:
        raise UnsupportedLayout(
            f"KV cache layout {d.layout!r} is not one kvkeep knows ({sorted(KNOWN_LAYOUTS)})"
        )
    if d.num_blocks < 1 or d.block_size < 1:
        raise UnsupportedLayout(f"bad geometry: {d.num_blocks} blocks of {d.block_size}")


def _check_view(name: str, view: torch.Tensor, d: LayoutDescription) -> None:
    if d.state:
        _check_state_view(name, view, d)
        return
    if view.dim() != 4:
        raise UnsupportedLayout(
            f"{name}: expected a logical [blocks, heads, tokens, content] view, "
            f"got shape {tuple(view.shape)}"
        )
    blocks, _, tokens, _ = view.shape
    if blocks != d.num_blocks or tokens != d.block_size:
        raise UnsupportedLayout(
            f"{name}: view {tuple(view.shape)} disagrees with the cache config "
            f"({d.num_blocks} blocks of {d.block_size} tokens); kernel-block splitting?"
        )
    page = view[0].numel() * view.element_size()
    if page != d.page_size_bytes:
        raise UnsupportedLayout(
            f"{name}: a page is {page} bytes but the spec says {d.page_size_bytes} "
            "(padded or packed pages are not copied by kvkeep)"
        )


def _check_state_view(name: str, view: torch.Tensor, d: LayoutDescription) -> None:
    """A state layer's cache as vLLM registers it: one page of raw bytes per block,
    ``[blocks, 1, 1, content bytes]`` in int8, its block stride the padded page; the state
    tensors (a conv window, an SSM matrix) are views at fixed offsets inside that page."""
    if view.dim() != 4 or tuple(view.shape[1:3]) != (1, 1) or view.element_size() != 1:
        raise UnsupportedLayout(
            f"{name}: expected a state page per block ([blocks, 1, 1, bytes] of int8), got "
            f"{tuple(view.shape)} {view.dtype}"
        )
    if view.shape[0] != d.num_blocks or view.shape[3] != d.page_size_bytes:
        raise UnsupportedLayout(
            f"{name}: state view {tuple(view.shape)} disagrees with the cache config "
            f"({d.num_blocks} blocks of a {d.page_size_bytes}-byte state)"
        )


def _check_uniform(layers: Sequence[_Layer]) -> None:
    first = layers[0].view
    for layer in layers[1:]:
        if layer.view.shape != first.shape or layer.view.dtype != first.dtype:
            raise UnsupportedLayout(
                f"layers differ: {layers[0].name} {tuple(first.shape)} {first.dtype} vs "
                f"{layer.name} {tuple(layer.view.shape)} {layer.view.dtype}"
            )
