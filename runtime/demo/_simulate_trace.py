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
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final

import torch

from ..trace import TOKEN_ID_BOUND, TraceError, block_tokens

FORMATS: Final = ("auto", "mooncake", "tokens")
TOKEN_KEYS: Final = ("tokens", "input_ids", "prompt_token_ids")
LINE_BYTES_MAX: Final = 64 << 20
"""Longest line read: a prompt of a million token ids takes under 8 MiB; a file without line
breaks (a device, a binary) is refused at this size rather than read whole into memory."""


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
        lines = path.open("rb")
    except OSError as e:
        raise TraceError(f"cannot read the trace {path}: {e.strerror}") from None
    out: list[SimRequest] = []
    with lines:
        for n, record in _records(path, lines):
            if limit is not None and len(out) >= limit:
                break
            if fmt == "auto":
                fmt = "mooncake" if isinstance(record, dict) and "hash_ids" in record else "tokens"
            out.append(_mooncake(path, n, record, block_size) if fmt == "mooncake" else _tokens(path, n, record))
    if not out:
        raise TraceError(f"the trace {path} holds no request")
    return out


def _records(path: Path, lines: BinaryIO) -> Iterator[tuple[int, Any]]:
    """Each non-empty line's number (0-based) and JSON value. The file is read as bytes and
    decoded a line at a time, so that bytes that are not UTF-8 are reported at their line."""
    n = 0
    try:
        while raw := lines.readline(LINE_BYTES_MAX + 1):
            if len(raw) > LINE_BYTES_MAX:
                raise TraceError(f"{path} line {n + 1}: longer than {LINE_BYTES_MAX >> 20} MiB (is it a JSONL "
                                 "trace, one request per line?)")
            if raw.strip():
                yield n, _record(f"{path} line {n + 1}", raw)
            n += 1
    except OSError as e:
        raise TraceError(f"cannot read the trace {path} at line {n + 1}: {e.strerror or e}") from None


def _record(where: str, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise TraceError(f"{where}: not UTF-8 text (is it a JSONL trace?)") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply to read (a record is one array of token ids "
                         "or one object)") from None
    except ValueError:  # an integer of more digits than Python converts
        raise TraceError(f"{where}: a number of more than {sys.get_int_max_str_digits()} digits (token ids and "
                         "lengths are far shorter)") from None


def _mooncake(path: Path, n: int, rec: Any, block_size: int) -> SimRequest:
    where = f"{path} line {n + 1}"
    if not isinstance(rec, dict) or "hash_ids" not in rec or "input_length" not in rec:
        raise TraceError(f"{where}: a Mooncake record needs input_length and hash_ids (got {_brief(rec)})")
    hashes, length = rec["hash_ids"], rec["input_length"]
    if not isinstance(hashes, list) or not all(type(h) is int and h >= 0 for h in hashes):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative ints")
    if not hashes:
        raise TraceError(f"{where}: hash_ids is empty; a request's prompt needs at least one block id")
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
