"""Block traces of the study's workloads, generated rather than recorded.

- :func:`session_trace`: N coding agents of kvkeep's session generator (the `bench session` /
  `bench agents` workload). Each turn's messages are rendered with the model's chat template
  (jinja2, as vLLM renders them) and tokenized with its tokenizer, and the token ids are cut
  into chained block keys with :func:`kvkeep.keys.chain_keys`, so two turns share exactly the
  blocks vLLM would find shared. Without a model directory, the messages are concatenated in
  ChatML form and cut into pseudo-tokens of a fixed number of characters (prefix-exact, sizes
  approximate).
- :func:`tile_trace`: N documents queried in tile order over R rounds (the `bench capacity`
  workload, S3): the cyclic pattern LRU handles worst.

Agents' turns are interleaved round-robin (turn t of every agent before turn t + 1), which is
what closed-loop agents of equal pace produce.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvkeep.keys import BlockKey, chain_keys
from kvkeep.plan.trace import BlockTrace, make_request
from kvkeep.traffic.workload import (
    CharEstimate,
    HFTokenizer,
    Message,
    SessionSpec,
    TokenCounter,
    generate_sessions,
)

ROOT = BlockKey(hashlib.sha256(b"kvkeep/plan/root").digest())
PSEUDO_TOKEN_CHARS = 4

Encode = Callable[[list[Message], list[dict[str, Any]]], list[int]]


class _BlockIds:
    """Dense integer ids for block keys, in order of first appearance."""

    def __init__(self) -> None:
        self.ids: dict[BlockKey, int] = {}

    def of(self, token_ids: Sequence[int], block_tokens: int) -> list[int]:
        keys = chain_keys(ROOT, token_ids, block_tokens)
        return [self.ids.setdefault(k, len(self.ids)) for k in keys]


def session_trace(
    spec: SessionSpec, agents: int, block_tokens: int, model_dir: Path | None = None
) -> BlockTrace:
    """The block trace of ``agents`` generated sessions, under vLLM's block rules."""
    counter: TokenCounter = HFTokenizer(model_dir) if model_dir else CharEstimate()
    encode = template_encoder(model_dir) if model_dir else pseudo_encoder()
    sessions = generate_sessions(spec, counter, agents)
    ids = _BlockIds()
    requests = []
    for t in range(spec.turns):
        for agent, turns in enumerate(sessions):
            tokens = encode(turns[t].messages, turns[t].tools)
            blocks = ids.of(tokens, block_tokens)
            extra = {"output_tokens": turns[t].max_tokens, "stream": agent}
            requests.append(make_request(blocks, len(tokens), block_tokens, True, **extra))
    source = f"{agents} generated session(s), {spec.turns} turns, scale {spec.scale}"
    return BlockTrace(tuple(requests), block_tokens, source, "vllm")


def template_encoder(model_dir: Path) -> Encode:
    """Render with ``tokenizer_config.json``'s chat template, then tokenize (no special-token
    insertion: the template writes them, as vLLM's chat endpoint does).

    The jinja environment is the one transformers' ``apply_chat_template`` (hence vLLM) builds:
    ``trim_blocks`` and ``lstrip_blocks`` drop the newline after a block tag, and ``tojson``
    keeps key order and does not escape HTML. jinja2's own ``tojson`` sorts keys, and without
    trimming every tool call gains a newline: both made prompts a few tokens longer than vLLM's
    and shifted block boundaries (measured against `bench all --quick`'s session turns).
    """
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    if not config.get("chat_template"):
        raise ValueError(f"{model_dir}/tokenizer_config.json has no chat_template")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    template = env.from_string(config["chat_template"])
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}

    def encode(messages: list[Message], tools: list[dict[str, Any]]) -> list[int]:
        text = template.render(
            messages=messages, tools=tools, add_generation_prompt=True, **specials
        )
        return list(tok.encode(text, add_special_tokens=False).ids)

    return encode


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` filter: plain ``json.dumps``, key order kept."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(token: object) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return str(token or "")


def pseudo_encoder(chars: int = PSEUDO_TOKEN_CHARS) -> Encode:
    """ChatML-style concatenation cut into ``chars``-character pseudo-tokens."""

    def encode(messages: list[Message], tools: list[dict[str, Any]]) -> list[int]:
        parts = [f"<|im_start|>tools\n{json.dumps(tools)}<|im_end|>\n"] if tools else []
        for m in messages:
            calls = json.dumps(m.get("tool_calls")) if m.get("tool_calls") else ""
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}{calls}<|im_end|>\n")
        text = "".join(parts) + "<|im_start|>assistant\n"
        return [_chunk_id(text[i : i + chars]) for i in range(0, len(text), chars)]

    return encode


def _chunk_id(chunk: str) -> int:
    return int.from_bytes(hashlib.blake2b(chunk.encode(), digest_size=4).digest(), "little")


@dataclass(frozen=True)
class TileSpec:
    """``documents`` documents of ``doc_tokens`` tokens, each queried once per round, in order,
    for ``rounds`` rounds; every query appends ``question_tokens`` tokens of its own."""

    documents: int
    doc_tokens: int
    rounds: int = 2
    question_tokens: int = 32

    def __post_init__(self) -> None:
        if self.documents < 1 or self.doc_tokens < 1 or self.rounds < 1:
            raise ValueError("--tiles needs documents, --doc-tokens and --rounds >= 1")
        if self.question_tokens < 1:
            raise ValueError("--question-tokens must be at least 1 (vLLM computes >= 1 token)")


def tile_trace(spec: TileSpec, block_tokens: int) -> BlockTrace:
    """The tile-order trace: document blocks shared across rounds, question blocks unique."""
    shared = spec.doc_tokens // block_tokens
    tokens = spec.doc_tokens + spec.question_tokens
    fresh = spec.documents * shared  # ids above every document block are question blocks
    requests = []
    for _ in range(spec.rounds):
        for d in range(spec.documents):
            own = tokens // block_tokens - shared
            blocks = [d * shared + j for j in range(shared)] + list(range(fresh, fresh + own))
            fresh += own
            requests.append(make_request(blocks, tokens, block_tokens, True, stream=d))
    source = f"{spec.documents} documents x {spec.doc_tokens} tokens in tile order"
    return BlockTrace(tuple(requests), block_tokens, f"{source}, {spec.rounds} rounds", "vllm")
