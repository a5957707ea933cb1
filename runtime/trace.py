"""The embedded serving trace: Mooncake FAST'25 conversation trace (Apache-2.0).

Source: kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl
(commit 3b5a594133958449a1feaf1c9e0fc1b553e34a28), 12,031 requests. Each record
has a relative `timestamp` (ms), `input_length` and `output_length` (tokens) and
`hash_ids`: one id per 512-token block of the input, equal ids meaning an equal
prefix chain. `block_tokens` turns each id into a deterministic 512-token block,
so requests that share hash ids share token prefixes exactly.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

import torch

BLOCK_TOKENS = 512
"""Tokens per hash id in the trace."""

VOCAB_SIZE = 32000
"""Token ids are drawn from 0..VOCAB_SIZE-1."""

TRACE_RECORDS = 12031

TOKEN_ID_BOUND = 2**63
"""Token ids travel as int64: a prompt's ids lie in 0..TOKEN_ID_BOUND - 1."""

_MIX_A = -7046029254386353131
_MIX_B = 0x2545F4914F6CDD1D


class TraceError(ValueError):
    """A trace record is malformed; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    """Line number in the trace (0-based)."""
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def tokens(self) -> torch.Tensor:
        """The request's `input_length` prompt tokens (int64): its blocks' `block_tokens`, one
        after the other, computed together."""
        needed = self.hash_ids[: -(-self.input_length // BLOCK_TOKENS)]
        if not needed:
            return torch.empty(0, dtype=torch.int64)
        starts = torch.tensor([_wrap64((h + 1) * _MIX_B) for h in needed], dtype=torch.int64)
        return _mix(torch.arange(BLOCK_TOKENS, dtype=torch.int64) + starts.unsqueeze(1)).view(-1)[: self.input_length]


def block_tokens(hash_id: int, size: int = BLOCK_TOKENS) -> torch.Tensor:
    """The `size` tokens of one trace block: a pure function of its hash id (and size)."""
    return _mix(torch.arange(size, dtype=torch.int64) + _wrap64((hash_id + 1) * _MIX_B))


def _mix(i: torch.Tensor) -> torch.Tensor:
    """Token ids of the positions `i` (int64, wrapping)."""
    x = i * _MIX_A
    x = (x ^ (x >> 31)) * _MIX_B
    x = x ^ (x >> 29)
    return x.remainder(VOCAB_SIZE)


def _wrap64(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


def load_trace(limit: int | None = None) -> Iterator[TraceRequest]:
    """The embedded trace's requests in file order (the first `limit` if given)."""
    ref = resources.files("hicache.runtime") / "data" / "mooncake_conversation_trace.jsonl.gz"
    with ref.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        for n, line in enumerate(lines):
            if limit is not None and n >= limit:
                return
            yield _parse(n, line)


def _parse(n: int, line: str) -> TraceRequest:
    try:
        rec = json.loads(line)
        req = TraceRequest(
            index=n,
            timestamp_ms=int(rec["timestamp"]),
            input_length=int(rec["input_length"]),
            output_length=int(rec["output_length"]),
            hash_ids=tuple(int(h) for h in rec["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError) as err:
        raise TraceError(f"trace line {n + 1}: {err}") from err
    if req.input_length > len(req.hash_ids) * BLOCK_TOKENS:
        raise TraceError(
            f"trace line {n + 1}: input_length {req.input_length} exceeds {len(req.hash_ids)} blocks"
        )
    return req
