"""The traces `hicache simulate` reads: Mooncake's format, or one prompt's token ids per line.

- **mooncake**: one JSON object per line with `input_length`, `hash_ids` (one id per block
  of `block_size` tokens; equal ids mean an equal prefix chain) and optionally
  `output_length` and `timestamp`, as in kvcache-ai/Mooncake's FAST'25 traces. Each hash
  id becomes a deterministic block of tokens (`trace.block_tokens`).
- **tokens**: one request per line, its prompt's token ids: a JSON array of ints, or an
  object with the array under `tokens`, `input_ids` or `prompt_token_ids` (and optionally
  `output_length`).

`auto` picks the format from the first non-empty line. A malformed line is a `TraceError`
naming the file, the line and what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from ..trace import TOKEN_ID_BOUND, TraceError, block_tokens

FORMATS: Final = ("auto", "mooncake", "tokens")
TOKEN_KEYS: Final = ("tokens", "input_ids", "prompt_token_ids")


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a user's trace (the shape `TraceRequest` has, for the demo's serving loop)."""

    index: int
    """Line number in the file (0-based)."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()
    block_size: int = 0
    token_ids: tuple[int, ...] = ()

    def tokens(self) -> torch.Tensor:
        """The prompt's token ids (int64)."""
        if not self.hash_ids:
            return torch.tensor(self.token_ids, dtype=torch.int64)
        return torch.cat([block_tokens(h, self.block_size) for h in self.hash_ids])[: self.input_length]


def read_trace(path: Path, fmt: str = "auto", block_size: int = 512, limit: int | None = None) -> list[SimRequest]:
    """The first `limit` requests (all if None) of the trace at `path`."""
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; use one of {', '.join(FORMATS)}")
    try:
        text = path.open(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read the trace {path}: {e.strerror}") from None
    out: list[SimRequest] = []
    with text:
        for n, record in _records(path, text):
            if limit is not None and len(out) >= limit:
                break
            if fmt == "auto":
                fmt = "mooncake" if isinstance(record, dict) and "hash_ids" in record else "tokens"
            out.append(_mooncake(path, n, record, block_size) if fmt == "mooncake" else _tokens(path, n, record))
    if not out:
        raise TraceError(f"the trace {path} holds no request")
    return out


def _records(path: Path, lines: Any) -> Iterator[tuple[int, Any]]:
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path} line {n + 1}: not JSON ({e.msg})") from None
        except UnicodeDecodeError:
            raise TraceError(f"{path} line {n + 1}: not UTF-8 text (is it a JSONL trace?)") from None


def _mooncake(path: Path, n: int, rec: Any, block_size: int) -> SimRequest:
    where = f"{path} line {n + 1}"
    if not isinstance(rec, dict) or "hash_ids" not in rec or "input_length" not in rec:
        raise TraceError(f"{where}: a Mooncake record needs input_length and hash_ids (got {_brief(rec)})")
    hashes, length = rec["hash_ids"], rec["input_length"]
    if not isinstance(hashes, list) or not all(type(h) is int and h >= 0 for h in hashes):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative ints")
    if type(length) is not int or not 0 < length <= len(hashes) * block_size:
        raise TraceError(f"{where}: input_length {length!r} must be an int in 1..{len(hashes) * block_size} "
                         f"({len(hashes)} blocks of {block_size}; is --block-size right?)")
    return SimRequest(n, length, _output(where, rec), tuple(hashes), block_size)


def _tokens(path: Path, n: int, rec: Any) -> SimRequest:
    where = f"{path} line {n + 1}"
    ids = rec
    if isinstance(rec, dict):
        key = next((k for k in TOKEN_KEYS if k in rec), None)
        if key is None:
            raise TraceError(f"{where}: a token record is an array of token ids or an object with one of "
                             f"{', '.join(TOKEN_KEYS)} (got {_brief(rec)})")
        ids = rec[key]
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < TOKEN_ID_BOUND for t in ids):
        raise TraceError(f"{where}: the prompt must be a non-empty list of token ids in 0..{TOKEN_ID_BOUND - 1}")
    return SimRequest(n, len(ids), _output(where, rec) if isinstance(rec, dict) else 1, token_ids=tuple(ids))


def _output(where: str, rec: dict[str, Any]) -> int:
    out = rec.get("output_length", 1)
    if type(out) is not int or out < 0:
        raise TraceError(f"{where}: output_length {out!r} must be a non-negative int")
    return max(1, out)


def _brief(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
