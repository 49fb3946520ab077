"""How "block b" of a kvkeep block maps onto the engine's paged KV tensors.

A kvkeep block holds one engine block of every layer, layer after layer::

    block bytes = [ layer 0 page | layer 1 page | ... | layer L-1 page ]
    page        = the layer's logical [H, N, C] view of that block, C-order

vLLM hands ``register_kv_caches`` one logical ``[B, H, N, C]`` view per layer, whatever the
physical layout (``KVCacheLayout`` permutes the strides, §8 of VLLM-NOTES). Copies go through
those typed views (``kv[b].copy_(page)``), so a page's bytes are in logical order and one code
path serves every layout: for a block-contiguous layout (LBHNC on CPU, LBNHC on CUDA) it is
one memcpy per layer. The bytes inside a page stay opaque (the CPU backend stores K transposed
in an ISA-specific packing): whole blocks are copied, never token slices.

Anything the adapter cannot account for exactly (several KV cache groups, a padded page, a
view whose shape disagrees with the cache config, an unknown layout name) stops start-up with
``UnsupportedLayout``; its bytes are never guessed. This module imports torch, not vllm.
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
    page_size_bytes: int  # the spec's page, padding included


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
        self.page_bytes = first[0].numel() * first.element_size()
        self.block_bytes = self.page_bytes * len(self._layers)

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
        for i, layer in enumerate(self._layers):
            self._page(flat, i).copy_(layer.view[block_id])

    def scatter(self, block_id: int, data: np.ndarray) -> None:
        """Copy ``data`` (uint8, block_bytes) into every layer of engine block ``block_id``."""
        flat = self._flat(data)
        for i, layer in enumerate(self._layers):
            layer.view[block_id].copy_(self._page(flat, i))

    def _flat(self, buf: np.ndarray) -> torch.Tensor:
        if buf.dtype != np.uint8 or buf.size != self.block_bytes:
            raise ValueError(f"a block buffer is {self.block_bytes} uint8, got {buf.size}")
        return torch.from_numpy(buf)

    def _page(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        raw = flat[layer * self.page_bytes : (layer + 1) * self.page_bytes]
        return raw.view(self.dtype).view(self.page_shape)


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


def _check_uniform(layers: Sequence[_Layer]) -> None:
    first = layers[0].view
    for layer in layers[1:]:
        if layer.view.shape != first.shape or layer.view.dtype != first.dtype:
            raise UnsupportedLayout(
                f"layers differ: {layers[0].name} {tuple(first.shape)} {first.dtype} vs "
                f"{layer.name} {tuple(layer.view.shape)} {layer.view.dtype}"
            )
