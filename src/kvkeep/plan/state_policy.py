"""Which block boundaries' recurrent state to keep for a linear-attention hybrid, and what the
choice costs: replayed over a block trace, for kvkeep's policy and for every boundary.

A hybrid's claim needs every attention block of the prefix and one state at the hit's last
boundary (`kvkeep.vllm.scheduler_side`), so a boundary whose state was not kept costs a
prefix hit, and a kept one costs a snapshot, tens of MiB on a large model
(`kvkeep.plan.state`). The connector's policies (`kvkeep.vllm.book.RequestBook.state_saves`):

- ``reused`` keeps the prompt's last claimable boundary (an agent's next turn extends the
  prompt), the boundaries past it (its reply's), and the branch point, where the prompt left
  the prefix kvkeep held (the next prompt sharing it, e.g. a sub-agent's system prompt, hits
  there);
- ``every`` keeps every boundary a request computes.

The replay mirrors the claim: the attention hit is the longest stored prefix, and the state
hit steps back from it to the last boundary with a state, at most ``STEPS_BACK`` boundaries.
A prompt's last claimable boundary is vLLM's ``(tokens - 1) // block`` whatever rules the
trace follows. An unbounded store; under vLLM's rules a request's reply boundaries
(``tail_blocks``) are kept by both policies and never read again, as the block trace has it.
Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvkeep.plan.trace import BlockTrace

POLICIES = ("reused", "every")
STEPS_BACK = 64  # the connector's STATE_STEPS_BACK


@dataclass(frozen=True)
class PolicyOutcome:
    """One policy replayed over a trace: snapshots kept and prompt tokens served."""

    policy: str
    snapshots: int
    hit_tokens: int  # served from cache: attention blocks and the state at their end
    attention_hit_tokens: int  # what the attention blocks alone would serve
    prompt_tokens: int
    stored_blocks: int  # distinct attention blocks stored
    block_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def attention_hit_rate(self) -> float:
        return self.attention_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def state_bytes(self, snapshot_bytes: int) -> int:
        return self.snapshots * snapshot_bytes

    def state_bytes_per_token(self, snapshot_bytes: int) -> float:
        """The snapshots' bytes spread over the stored attention tokens."""
        tokens = self.stored_blocks * self.block_tokens
        return self.state_bytes(snapshot_bytes) / tokens if tokens else 0.0


def replay(trace: BlockTrace, policy: str, steps_back: int = STEPS_BACK) -> PolicyOutcome:
    """``policy`` ('reused' or 'every') over ``trace``, every request in arrival order."""
    if policy not in POLICIES:
        raise ValueError(f"state policy {policy!r}: use one of {', '.join(POLICIES)}")
    stored: set[int] = set()
    states: set[int] = set()  # block ids whose end has a kept state
    snapshots = hit = attention = 0
    block = trace.block_tokens
    for r in trace.requests:
        # The connector keeps the prompt's last claimable boundary, as vLLM claims (the last
        # token is always computed), whatever rules the trace's own hits follow.
        claimable = min(len(r.blocks), (r.tokens - 1) // block, r.hit_cap)
        held = 0
        while held < r.hit_cap and r.blocks[held] in stored:
            held += 1
        candidates = range(held, max(0, held - steps_back), -1)
        hit_blocks = next((n for n in candidates if r.blocks[n - 1] in states), 0)
        hit += hit_blocks * block
        attention += held * block
        stored.update(r.blocks)
        # The boundaries this request computes, after the state it started from.
        for j in range(hit_blocks + 1, len(r.blocks) + 1):
            kept = policy == "every" or j in (claimable, held) or j > claimable
            if kept and r.blocks[j - 1] not in states:
                states.add(r.blocks[j - 1])
                snapshots += 1
        snapshots += r.tail_blocks
    return PolicyOutcome(policy, snapshots, hit, attention, trace.prompt_tokens, len(stored), block)


def compare(trace: BlockTrace) -> tuple[PolicyOutcome, ...]:
    """Every policy over ``trace``, kvkeep's default first."""
    return tuple(replay(trace, p) for p in POLICIES)
