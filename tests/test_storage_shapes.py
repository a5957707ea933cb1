"""Instances of another dtype or KV shape of the same byte size share one storage and never
load each other's pages: each page records dtype, KV shape, payload layout and page size, and
any mismatch is a miss. Both pairs, on both backends (a real `mooncake_master` on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.actors import KVBuffer, KVShape, PageFormat, open_backend
from hicache.runtime import Config, HostLayout
from hicache.runtime.testing import MooncakeMaster

pytestmark = pytest.mark.timeout(60)

PAGE = 4
PAIRS = {
    "fp16 vs bf16": ({"dtype": "float16"}, {"dtype": "bfloat16"}),
    "4 layers x head_dim 4 vs 2 x 8": ({"layers": 4, "head_dim": 4}, {"layers": 2, "head_dim": 8}),
}


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as m:
        yield m


def _config(kind: str, where: dict[str, Any], **shape: Any) -> Config:
    values: dict[str, Any] = dict(layers=2, kv_heads=1, head_dim=8, page_size=PAGE, device_slots=8 * PAGE,
                                  host_slots=16 * PAGE, storage=kind, mooncake_segment_mb=16)
    return Config(**{**values, **shape, **where})


def _slots(n: int) -> torch.Tensor:
    return torch.arange(n * PAGE)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("kind", ["file", "mooncake"])
def test_an_instance_of_another_kv_shape_of_the_same_size_misses_every_page(
    kind: str, pair: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    where = ({"storage_dir": str(tmp_path)} if kind == "file"
             else request.getfixturevalue("master").config_fields())
    mine, theirs = (_config(kind, where, **shape) for shape in PAIRS[pair])
    assert PageFormat(KVShape.of(mine)).payload_bytes == PageFormat(KVShape.of(theirs)).payload_bytes
    a, b = open_backend(mine), open_backend(theirs)
    try:
        keys = [f"shape-{pair.replace(' ', '_')}-{i}" for i in range(3)]
        src = KVBuffer.allocate(KVShape.of(mine), 16 * PAGE, HostLayout.PAGE_FIRST, "cpu")
        src.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(1))
        assert a.write(keys, src, _slots(3)).written == 3

        dst = KVBuffer.allocate(KVShape.of(theirs), 16 * PAGE, HostLayout.PAGE_FIRST, "cpu")
        assert b.exists(keys) == 0
        got = b.read(keys, dst, _slots(3))
        assert got.pages == 0 and "not in storage" in got.error
        # Its own pages under the same keys are stored beside them, and each reads its own.
        own = KVBuffer.allocate(KVShape.of(theirs), 16 * PAGE, HostLayout.PAGE_FIRST, "cpu")
        own.tensor.view(torch.uint8).random_(generator=torch.Generator().manual_seed(2))
        assert b.write(keys, own, _slots(3)).written == 3
        assert b.read(keys, dst, _slots(3)).pages == 3
        assert torch.equal(dst.tensor[:3].view(torch.uint8), own.tensor[:3].view(torch.uint8))
        back = KVBuffer.allocate(KVShape.of(mine), 16 * PAGE, HostLayout.LAYER_FIRST, "cpu")
        assert a.read(keys, back, _slots(3)).pages == 3
        assert torch.equal(back.read(_slots(3)).view(torch.uint8), src.read(_slots(3)).view(torch.uint8))
    finally:
        a.close()
        b.close()


def test_a_header_of_another_kv_shape_is_refused_by_the_format_check() -> None:
    mine = PageFormat(KVShape(2, 1, 8, torch.float16, PAGE))
    theirs = PageFormat(KVShape(2, 1, 8, torch.bfloat16, PAGE))
    header = bytearray(theirs.header_bytes)
    theirs.pack(memoryview(header), "k", 123)
    assert theirs.problem("k", header, 123) == ""
    assert "another KV shape (bfloat16 x 2 layers" in mine.problem("k", header, 123)
    assert mine.tag != theirs.tag
