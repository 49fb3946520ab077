"""`kvkeep model tiny DIR`: a tiny Llama-style model that vLLM serves with `--load-format dummy`.

No weights are ever downloaded. The model is a `config.json`, a byte-level BPE tokenizer trained
offline on the Python standard library's own sources, and a `tokenizer_config.json` with a chat
template that understands tools. Cache behaviour and timing depend on the shapes, not on the
weight values, so this is enough for tests, benchmarks and the demo.

The same arguments give byte-identical files: the training corpus is a sorted, size-capped list
of standard-library files, and training runs single-threaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
CORPUS_BYTES = 3_000_000  # enough for a 8k vocabulary in about a second

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

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


def llama_config(spec: TinyModelSpec) -> dict[str, object]:
    """The HF `config.json` for a Llama-architecture model of these shapes (bf16)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }


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
    """Write config.json, tokenizer.json, tokenizer_config.json and generation_config.json.

    Idempotent: the same spec gives the same bytes. Returns `out_dir`.
    """
    spec.validate()
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": _dumps(llama_config(spec)),
        "tokenizer.json": train_tokenizer(spec.vocab),
        "tokenizer_config.json": _dumps(tokenizer_config(spec)),
        "special_tokens_map.json": _dumps(
            {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
        ),
        "generation_config.json": _dumps({"bos_token_id": 0, "eos_token_id": 1}),
        "kvkeep-model.json": _dumps({"generator": "kvkeep model tiny", **asdict(spec)}),
    }
    for name, text in files.items():
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out_dir / name)
    return out_dir


def _dumps(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvkeep model", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("tiny", help="write a tiny Llama-style model (config + tokenizer)")
    t.add_argument("dir", type=Path, help="output directory")
    d = TinyModelSpec()
    for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "intermediate"):
        t.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(d, field))
    t.add_argument("--max-positions", type=int, default=d.max_positions)
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    spec = TinyModelSpec(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab=args.vocab,
        intermediate=args.intermediate,
        max_positions=args.max_positions,
    )
    try:
        write_tiny_model(args.dir, spec)
    except ValueError as exc:
        print(f"kvkeep model tiny: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.dir} ({spec.layers} layers, {spec.kv_heads} KV heads x {spec.head_dim}, "
        f"vocab {spec.vocab}, {spec.kv_bytes_per_token} KV bytes/token in bf16)"
    )
    return 0
