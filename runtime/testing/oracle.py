"""The fingerprint oracle: KV values derived from (token prefix, layer, position).

Each token position gets a hash of its whole prefix; the K and V of every layer
at that position are small integers mixed from that hash and the layer, plus a
fixed ramp over heads and head_dim (so a transposition shows). Whatever tier
path the bytes took (L1 hit, L2 load-back, L3 prefetch, after eviction and slot
reuse), reading a cached prefix back must give exactly the values computed for
it; `verify` reports the first slot and layer that does not.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy
import torch

from hicache.actors import KVBuffer, KVShape

_MIX_A = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX_B = 0x2545F4914F6CDD1D
_SPREAD = 241  # values in -120..120: exact in float16 and bfloat16


def _ids(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Token ids as an int64 tensor: a list through an `array` (a third of what torch's
    conversion of a list costs), an `array("q")` copied in one call (a view would keep the
    caller from growing it), a tensor as it is."""
    if type(tokens) is list or type(tokens) is tuple:
        return torch.frombuffer(array("q", tokens), dtype=torch.int64) if tokens else torch.empty(0, dtype=torch.int64)
    if type(tokens) is array and tokens.typecode == "q":
        return torch.frombuffer(tokens, dtype=torch.int64).clone() if tokens else torch.empty(0, dtype=torch.int64)
    return torch.as_tensor(tokens, dtype=torch.int64)


class FingerprintMismatchError(AssertionError):
    """KV read back differs from what was computed for its prefix."""

    def __init__(self, message: str, *, slot: int, position: int, layer: int, kv: str, label: str = "") -> None:
        super().__init__(message)
        self.slot = slot
        self.position = position
        self.layer = layer
        self.kv = kv
        self.label = label
        """What the caller named the read (`verify(..., label=)`): the request, the tier its prefix came from."""


class FingerprintOracle:
    def __init__(self, shape: KVShape, *, seed: int = 0) -> None:
        self.shape = shape
        self._seed = seed
        self._weights = torch.empty(0, dtype=torch.int64)
        h, d = shape.heads, shape.head_dim
        self._ramp = (torch.arange(h * d, dtype=torch.float32) % 7 - 3).view(h, d)
        self._layer_salt = (torch.arange(2 * shape.layers, dtype=torch.int64) + 1).view(2, shape.layers, 1) * _MIX_B
        self._table = ((torch.arange(_SPREAD) - _SPREAD // 2).to(torch.float32).view(-1, 1, 1) + self._ramp).to(shape.dtype)
        """Row `b`: the `[H, D]` values of a position whose mixed hash gives `b` (`_values` picks
        a row per position and layer instead of adding the ramp and casting for each)."""

    def prefix_hashes(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One int64 per position, depending on every token up to and including it."""
        t = _ids(tokens)
        self._grow(len(t))
        return torch.cumsum((t + 1) * self._weights[: len(t)], dim=0)

    def hash_at(self, tokens: Sequence[int] | torch.Tensor, position: int, *, base: int = 0, start: int = 0) -> int:
        """The prefix hash of `position` (0 before position 0), extending `base`, the hash of
        `start - 1`: so a caller that keeps it pays only for the new tokens."""
        if position < start:
            return base
        t = _ids(tokens[start : position + 1])
        self._grow(position + 1)
        total = base + int(((t + 1) * self._weights[start : position + 1]).sum())
        return (total + 2**63) % 2**64 - 2**63  # int64 arithmetic wraps, as in prefix_hashes

    def expected(
        self, tokens: Sequence[int] | torch.Tensor, start: int, end: int, *, base: int | None = None
    ) -> torch.Tensor:
        """The KV of positions `start..end` of `tokens`, as `[2, L, end - start, H, D]`.

        `base`, if given, is `hash_at(tokens, start - 1)`: only `tokens[start:end]` are read."""
        return self._values(self._hashes(tokens, start, end, base))

    def _hashes(self, tokens: Sequence[int] | torch.Tensor, start: int, end: int, base: int | None) -> torch.Tensor:
        """The prefix hashes of positions `start..end`; from `base`, the hash of `start - 1`, if given."""
        if not 0 <= start <= end <= len(tokens):
            raise ValueError(f"positions {start}..{end} outside a prefix of {len(tokens)} tokens")
        if base is None:
            return self.prefix_hashes(tokens[:end])[start:end]
        t = _ids(tokens[start:end])
        self._grow(end)
        return base + torch.cumsum((t + 1) * self._weights[start:end], dim=0)

    def _values(self, h: torch.Tensor) -> torch.Tensor:
        x = h.view(1, 1, -1) * _MIX_A + self._layer_salt
        x ^= x >> 29
        x *= _MIX_A
        row = (x >> 33).remainder_(_SPREAD)  # the value before the ramp, + _SPREAD // 2
        return self._table.index_select(0, row.view(-1)).view(*row.shape, *self._table.shape[1:])

    def write(
        self, buffer: KVBuffer, tokens: Sequence[int] | torch.Tensor, slots: torch.Tensor, start: int = 0,
        *, base: int | None = None,
    ) -> int:
        """Write the KV of positions `start .. start + len(slots)` into `slots`; the prefix hash
        of the last of them (`hash_at`), which a caller extending the prefix passes as `base`."""
        h = self._hashes(tokens, start, start + len(slots), base)
        buffer.write(slots, self._values(h))
        if len(h):
            return int(h[-1])
        return self.hash_at(tokens, start - 1) if base is None else base

    def verify(
        self, buffer: KVBuffer, tokens: Sequence[int] | torch.Tensor, slots: torch.Tensor, start: int = 0,
        *, layer: int | None = None, label: str = "",
    ) -> None:
        """Raise `FingerprintMismatchError` at the first wrong slot (lowest position, then layer).

        With `layer`, only that layer is read and checked (a forward pass checks each
        layer right after waiting for its load). `label` names the read in the error (say, the
        request and the tier its prefix came from): slots alone do not say whose call was wrong."""
        if not isinstance(label, str):
            raise TypeError(f"label must be a str naming the read (a request, a tier), got {type(label).__name__}")
        if not len(slots):
            return
        self.compare(buffer.read(slots), self.expected(tokens, start, start + len(slots)), slots, start, layer=layer,
                     label=label)

    def compare(
        self, actual: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, start: int, *,
        layer: int | None = None, first_layer: int = 0, label: str = "",
    ) -> None:
        """`verify` for KV already read (`[2, L, n, H, D]`) against `expected(...)` of the same
        positions; `first_layer` is the model layer of index 0 when only some layers were read."""
        want = want.to(actual.device)
        if _same_bits(actual, want):  # the common case, in one pass; else find where
            return
        wrong = (actual != want).flatten(3).any(-1)  # [2, L, n]
        if layer is not None:
            wrong[:, [i for i in range(wrong.shape[1]) if i != layer]] = False
        if not bool(wrong.any()):
            return
        pos = int(wrong.any(0).any(0).nonzero()[0, 0])
        kv_i, bad_layer = (int(v) for v in wrong[:, :, pos].nonzero()[0])
        kv = "KV"[kv_i]
        slot = int(slots[pos])
        raise FingerprintMismatchError(
            f"{label + ': ' if label else ''}slot {slot} (position {start + pos}) layer {first_layer + bad_layer} "
            f"{kv}: expected {want[kv_i, bad_layer, pos].flatten()[:4].tolist()}..., found "
            f"{actual[kv_i, bad_layer, pos].flatten()[:4].tolist()}...",
            slot=slot, position=start + pos, layer=first_layer + bad_layer, kv=kv, label=label,
        )

    def _grow(self, n: int) -> None:
        """Position weights: a pure function of (seed, position), so two oracles agree."""
        if n > len(self._weights):
            j = torch.arange(max(n, 2 * len(self._weights)), dtype=torch.int64) + (self._seed * _MIX_B + 2**63) % 2**64 - 2**63
            x = j * _MIX_A
            x = (x ^ (x >> 31)) * _MIX_B
            self._weights = (x ^ (x >> 27)) | 1


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two KV tensors of one shape and dtype hold the same bytes (numpy's comparison of
    64-bit words on the CPU: a tenth of the time of torch's elementwise `!=` on half floats)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_cpu and b.is_cpu and a.dim() and a.shape[-1] * a.element_size() % 8 == 0:
        try:
            return bool(numpy.array_equal(a.view(torch.int64).numpy(), b.view(torch.int64).numpy()))
        except RuntimeError:  # strides no 64-bit view fits: torch's comparison
            pass
    return torch.equal(a, b)
