"""Agent workloads: deterministic coding-agent sessions in the chat API's `messages` form.

A session starts from a system prompt, tool definitions and a task; each later turn appends
the assistant's previous reply with a tool call, the tool's result (a real local source file,
a grep listing or test output) and a short instruction, so every prompt strictly extends the
previous one. Sizes follow the study (``STUDY_TURNS`` turns, ``STUDY_FINAL_CONTEXT`` tokens on
the last at `scale=1`), shrink with `scale` and grow fastest early (``GROWTH_EXPONENT``).
Replies are synthetic text of `max_output_tokens` tokens, so every mode sees byte-identical
prompts. Token counts come from a `TokenCounter`: the model's tokenizer, or
``CHARS_PER_TOKEN`` characters per token.

It also holds the other shapes bench runs and plan replays: random token-id prompts
(`random_ids`), the question appended to a document (`QUESTION_TOKENS`) and the bench's
cache-server tier sizes (`BENCH_CACHE_RAM`, `BENCH_CACHE_DISK`), so plan never imports bench.
The growth curve and the reasons: docs/notes/workload.md.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

STUDY_TURNS = 30
STUDY_FINAL_CONTEXT = 115_000
STUDY_SYSTEM_TOKENS = 10_000
GROWTH_EXPONENT = 0.8
CHARS_PER_TOKEN = 3.5
MAX_CHARS_PER_TOKEN = 16
MESSAGE_OVERHEAD_TOKENS = 6  # role markers and newlines a chat template wraps a message in
DEFAULT_SCALE = 0.4  # mode `none` finishes a session in about 7 minutes on 2 cores (measured)
QUESTION_TOKENS = 16  # appended to a document, so queries of it share all its full blocks
# The one cache-server setup of every `kvkeep bench` scenario in mode kvkeep (alone or in
# `bench all`): a RAM tier, and a disk tier below it that survives the server's restarts.
BENCH_CACHE_RAM = "1GiB"
BENCH_CACHE_DISK = "2GiB"

Message = dict[str, Any]


def random_ids(count: int, seed: object) -> list[int]:
    """``count`` token ids in [100, 1000), deterministic in ``seed``: a prompt that shares no
    prefix block with one of another seed (ids below 100 are left to `question`)."""
    rng = random.Random(f"kvkeep-ids:{seed}")
    return [rng.randrange(100, 1000) for _ in range(count)]


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


class CharEstimate:
    """Token count estimated from the character count (for unknown tokenizers)."""

    def __init__(self, chars_per_token: float = CHARS_PER_TOKEN) -> None:
        self.chars_per_token = chars_per_token

    def count(self, text: str) -> int:
        return int(len(text) / self.chars_per_token) + 1


class HFTokenizer:
    """Exact token count with a `tokenizer.json` (a model directory's own tokenizer)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {path}")
        self._tok = Tokenizer.from_file(str(file))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True)
class SessionSpec:
    """One agent session. All token sizes are the study's, multiplied by `scale`."""

    turns: int = STUDY_TURNS
    final_context_tokens: int = STUDY_FINAL_CONTEXT
    system_tokens: int = STUDY_SYSTEM_TOKENS
    scale: float = DEFAULT_SCALE
    max_output_tokens: int = 32
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the parameter to change."""
        if self.turns < 1:
            raise ValueError("--turns must be at least 1")
        if not 0 < self.scale <= 4:
            raise ValueError(f"--scale must be in (0, 4], got {self.scale}")
        if self.max_output_tokens < 1:
            raise ValueError("--max-output-tokens must be at least 1")
        if self.final_context_tokens <= self.system_tokens:
            raise ValueError("--final-context must be larger than the system prompt")

    @property
    def system_target(self) -> int:
        return max(200, int(self.system_tokens * self.scale))

    @property
    def final_target(self) -> int:
        return max(self.system_target + 200, int(self.final_context_tokens * self.scale))

    def context_target(self, turn: int) -> int:
        """Target prompt size (tokens) of turn `turn` (0-based)."""
        if self.turns == 1:
            return self.final_target
        frac = (turn / (self.turns - 1)) ** GROWTH_EXPONENT
        return int(self.system_target + (self.final_target - self.system_target) * frac)


@dataclass(frozen=True)
class Turn:
    """The request an agent sends on one turn: the whole conversation so far."""

    index: int
    messages: list[Message]
    tools: list[dict[str, Any]]
    max_tokens: int
    target_tokens: int


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository and return its text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "path relative to the root"},
                    "start_line": {"type": "integer"},
                    "end_line": {"type": "integer"},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "Search the code for a regular expression; returns path:line:text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string"},
                    "glob": {"type": "string", "description": "only files matching this glob"},
                },
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, or the tests matching a selector.",
            "parameters": {
                "type": "object",
                "properties": {"selector": {"type": "string"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Replace an exact snippet of a file with new text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                },
                "required": ["path", "old", "new"],
            },
        },
    },
]

SYSTEM_PREAMBLE = """You are a coding agent working in a Python repository on the user's machine.
You can read files, search the code, edit files and run the tests through the tools you are
given. Work in small steps: read before you edit, run the tests after every change, and explain
what you found in one or two sentences before each tool call. Never invent file contents; quote
what the tools return. When the task is done, summarise the change and the test results.

Conventions of this repository: four-space indentation, type hints on public functions,
docstrings that state what a function returns and raises, tests next to the code they test.

Repository overview (path: first line of the module docstring):
"""

TASKS = (
    "The tests in {mod} fail after the last refactor. Find the cause and fix it.",
    "Add type hints to the public functions of {mod} and make sure the tests still pass.",
    "A user reports that {mod} is slow on large inputs. Profile it and propose a fix.",
    "Refactor {mod} so that its parsing and its I/O are separated, without changing behaviour.",
)

INSTRUCTIONS = (
    "Good. Now look at how {mod} is used elsewhere.",
    "That is not it yet. Check the error handling in {mod}.",
    "Run the tests again and tell me what fails.",
    "Read the rest of {mod} before changing anything.",
    "Search for other callers of that function.",
    "Apply the fix you proposed and run the tests.",
    "Keep going; the edge case with empty input is still open.",
    "Explain the failure in one sentence, then continue.",
)

REPLY_WORDS = (
    "the function returns early when the buffer is empty so the caller never sees the last",
    "chunk and the test expects it to flush first I will read the module and check where the",
    "state is reset then search for the other callers before editing anything",
)
REPLY_VOCAB = tuple(" ".join(REPLY_WORDS).split(" "))


@cache
def _source_files() -> tuple[Path, ...]:
    """Real local source files to serve as tool results: the standard library's modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(stdlib.glob("*.py")) if p.stat().st_size > 2000]
    if not files:
        raise RuntimeError(f"no source files under {stdlib} to build tool results from")
    return tuple(files)


@cache
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _first_doc_line(path: Path) -> str:
    for line in _read(path).splitlines()[:30]:
        text = line.strip().strip("\"'r").strip()
        if text and not text.startswith("#"):
            return text[:100]
    return ""


def _fit(text: str, tokens: int, counter: TokenCounter) -> str:
    """The longest prefix of `text` (cut at a line end) with at most about `tokens` tokens."""
    if tokens <= 0:
        return ""
    text = text[: tokens * MAX_CHARS_PER_TOKEN]  # bound the search: no token is this long
    if counter.count(text) <= tokens:
        return text
    lo, hi = 0, len(text)
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if counter.count(text[:mid]) <= tokens:
            lo = mid
        else:
            hi = mid
    cut = text.rfind("\n", 0, lo)
    return text[: cut + 1 if cut > 0 else lo]


class SessionGenerator:
    """Builds a session's turns. Same spec, agent and counter: identical messages."""

    def __init__(self, spec: SessionSpec, counter: TokenCounter, agent: int = 0) -> None:
        spec.validate()
        self.spec = spec
        self.counter = counter
        self.agent = agent
        self.rng = random.Random(f"kvkeep-session:{spec.seed}:{agent}")
        self.files = _source_files()

    def turns(self) -> list[Turn]:
        """All turns of the session, in order."""
        messages: list[Message] = [
            {"role": "system", "content": self._system_prompt()},
            {"role": "user", "content": self._task()},
        ]
        used = self._count(messages)
        out = [self._turn(0, messages, used)]
        for t in range(1, self.spec.turns):
            step = self._step(t, self.spec.context_target(t) - used)
            messages = messages + step
            used += self._count(step)
            out.append(self._turn(t, messages, used))
        return out

    def _turn(self, index: int, messages: list[Message], used: int) -> Turn:
        return Turn(index, list(messages), TOOLS, self.spec.max_output_tokens, used)

    def _count(self, messages: Sequence[Message]) -> int:
        """Tokens these messages add to the rendered prompt (text plus per-message framing)."""
        total = 0
        for m in messages:
            total += self.counter.count(m["content"]) + MESSAGE_OVERHEAD_TOKENS
            for call in m.get("tool_calls", ()):
                total += self.counter.count(json.dumps(call["function"])) + 4
        return total

    def _module(self) -> Path:
        return self.rng.choice(self.files)

    def _system_prompt(self) -> str:
        budget = self.spec.system_target - self.counter.count(json.dumps(TOOLS))
        lines = [f"{p.name}: {_first_doc_line(p)}" for p in self.files]
        overview = "\n".join(lines * (1 + budget // max(1, self.counter.count("\n".join(lines)))))
        return SYSTEM_PREAMBLE + _fit(
            overview, budget - self.counter.count(SYSTEM_PREAMBLE), self.counter
        )

    def _task(self) -> str:
        return self.rng.choice(TASKS).format(mod=self._module().name)

    def _step(self, t: int, budget: int) -> list[Message]:
        """Assistant reply + tool call, tool result and instruction adding ~`budget` tokens."""
        call_id = f"call_{self.agent}_{t}"
        kind = self.rng.choice(("read_file", "read_file", "grep", "run_tests"))
        args, result = self._tool(kind)
        reply = self._reply()
        instruction = self.rng.choice(INSTRUCTIONS).format(mod=self._module().name)
        fixed = self.counter.count(reply + instruction + json.dumps(args)) + 40
        budget = max(budget, fixed + 64)  # every turn carries a tool result, however small
        return [
            {
                "role": "assistant",
                "content": reply,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": kind, "arguments": json.dumps(args)},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _fit(result, budget - fixed, self.counter),
            },
            {"role": "user", "content": instruction},
        ]

    def _reply(self) -> str:
        n = self.spec.max_output_tokens
        words = [self.rng.choice(REPLY_VOCAB) for _ in range(max(1, int(n * 0.8)))]
        return " ".join(words).capitalize() + "."

    def _tool(self, kind: str) -> tuple[dict[str, Any], str]:
        if kind == "read_file":
            path = self._module()
            return {"path": f"lib/{path.name}"}, _read(path)
        if kind == "grep":
            return self._grep()
        return self._tests()

    def _grep(self) -> tuple[dict[str, Any], str]:
        pattern = self.rng.choice(("def ", "return ", "raise ", "import ", "self."))
        rows: list[str] = []
        start = self.rng.randrange(len(self.files))
        for path in self.files[start:] + self.files[:start]:
            for no, line in enumerate(_read(path).splitlines(), 1):
                if pattern in line:
                    rows.append(f"lib/{path.name}:{no}:{line.strip()}")
            if len(rows) > 4000:
                break
        return {"pattern": pattern, "glob": "*.py"}, "\n".join(rows) + "\n"

    def _tests(self) -> tuple[dict[str, Any], str]:
        rows: list[str] = []
        start = self.rng.randrange(len(self.files))
        for path in self.files[start:] + self.files[:start]:
            names = [
                ln.split("(")[0][4:] for ln in _read(path).splitlines() if ln.startswith("def ")
            ]
            for i, name in enumerate(names):
                verdict = "FAILED" if (i * 7 + len(name)) % 23 == 0 else "PASSED"
                rows.append(f"tests/test_{path.stem}.py::test_{name.strip('_')} {verdict}")
            if len(rows) > 4000:
                break
        failed = sum(r.endswith("FAILED") for r in rows)
        summary = f"==== {failed} failed, {len(rows) - failed} passed ===="
        return {"selector": "tests/"}, "\n".join(rows) + "\n" + summary + "\n"


def generate_sessions(
    spec: SessionSpec, counter: TokenCounter, agents: int = 1
) -> list[list[Turn]]:
    """`agents` independent sessions (different seeds per agent, same shape)."""
    return [SessionGenerator(spec, counter, agent=a).turns() for a in range(agents)]
