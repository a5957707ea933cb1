"""What both storage backends share: the host slots of a call (`page_starts`), the key check,
and the headers of a batch (`Headers`), on small and large batches (which take different
paths)."""

from __future__ import annotations

import pytest
import torch

from hicache.actors import KVBuffer, KVShape, PageFormat
from hicache.actors._stored_page import Headers, check_keys, page_starts
from hicache.runtime import HostLayout

PAGE = 8
HOST_PAGES = 1024
HOST = KVBuffer.allocate(KVShape(2, 1, 8, torch.float16, PAGE), HOST_PAGES * PAGE, HostLayout.PAGE_FIRST, "cpu")


def _slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)).flatten()


@pytest.mark.parametrize("n", [3, 100], ids=["few slots", "many slots"])
def test_page_starts_are_the_first_slot_of_each_page_in_key_order(n: int) -> None:
    scattered = [(7 * i + 5) % HOST_PAGES for i in range(n)]
    assert page_starts(["k"] * n, HOST, _slots(scattered)) == [p * PAGE for p in scattered]
    assert page_starts(["k"] * n, HOST, _slots(list(range(40, 40 + n)))) == [p * PAGE for p in range(40, 40 + n)]


@pytest.mark.parametrize("n", [3, 100], ids=["few slots", "many slots"])
@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda s: s + 1, "whole pages"),  # a run, but not aligned
        (lambda s: torch.cat([s[:PAGE].flip(0), s[PAGE:]]), "whole pages"),
        (lambda s: torch.cat([s[:-1], s[-1:] + 3]), "whole pages"),
        (lambda s: s + (HOST_PAGES - 2) * PAGE, "within the host buffer"),
        (lambda s: s - 4 * PAGE, "within the host buffer"),
        (lambda s: s[:-1], r"x page_size 8 = \d+ host slots"),
        (lambda s: s.to(torch.int32), r"x page_size 8 = \d+ host slots"),
    ],
    ids=["unaligned", "a page reversed", "a stray slot", "past the end", "negative", "one short", "int32"],
)
def test_slots_that_are_not_whole_pages_of_the_buffer_are_a_value_error(n: int, change, error: str) -> None:
    for pages in (list(range(2, 2 + n)), [(7 * i + 2) % HOST_PAGES for i in range(n)]):
        with pytest.raises(ValueError, match=error):
            page_starts(["k"] * n, HOST, change(_slots(pages)))


@pytest.mark.parametrize("bad", ["a\nb", "", "x" * 81, "é", "a.b"])
def test_a_batch_with_one_bad_key_names_it(bad: str) -> None:
    keys = ["0123456789abcdef-r0"] * 40
    keys[17] = bad
    with pytest.raises(ValueError, match="is not allowed"):
        check_keys(keys)
    check_keys(keys[:17] + keys[18:])
    with pytest.raises(ValueError, match="is not allowed"):
        check_keys(["ok", 5])  # type: ignore[list-item]


def test_headers_filled_for_a_batch_are_the_headers_pack_makes_one_by_one() -> None:
    fmt = PageFormat(KVShape(2, 1, 8, torch.float16, PAGE))
    keys = [f"{i:016x}-r{i % 3}" for i in range(40)] + ["k"]
    sums = [i * 0x9E3779B97F4A7C15 % (1 << 64) for i in range(len(keys))]
    batch = Headers.allocate(fmt, 64)
    batch.memory[:] = b"\xff" * len(batch.memory)  # what a get of a damaged object may have left there
    batch.fill(keys, sums)
    for i, (key, s) in enumerate(zip(keys, sums, strict=True)):
        one = bytearray(fmt.header_bytes)
        fmt.pack(memoryview(one), key, s)
        assert batch.views[i].tobytes() == bytes(one), i
        assert fmt.problem(key, batch.views[i], s) == ""
    other = Headers.allocate(fmt, 64)
    other.fill(keys, sums)
    assert batch.same(other, len(keys))
    sums[9] ^= 1
    other.fill(keys, sums)
    assert not batch.same(other, len(keys))
    assert batch.first_bad(other, keys, sums) == (9, "checksum mismatch: the payload is corrupt")
