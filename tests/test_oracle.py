"""The fingerprint oracle: KV derived from (token prefix, layer, position), and
`verify` pointing at the first wrong slot, position and layer."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from hicache.actors import KVBuffer, KVShape
from hicache.runtime import Config, HostLayout
from hicache.runtime.testing.oracle import FingerprintMismatchError, FingerprintOracle

TOKENS = [random.Random(3).randrange(50_000) for _ in range(40)]


@pytest.fixture
def cfg(make_config: Callable[..., Config]) -> Config:
    return make_config(page_size=4, device_pages=16, host_pages=32, layers=3)


def _buffer(cfg: Config, layout: HostLayout = HostLayout.LAYER_FIRST) -> KVBuffer:
    return KVBuffer.allocate(KVShape.of(cfg), cfg.host_slots, layout, "cpu")


@pytest.mark.parametrize("layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST], ids=["layer_first", "page_first"])
def test_what_was_written_verifies(cfg: Config, layout: HostLayout) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    buf = _buffer(cfg, layout)
    slots = torch.tensor([17, 3, 4, 5, 90, 91, 92, 93, 0, 127])
    oracle.write(buf, TOKENS, slots)
    oracle.verify(buf, TOKENS, slots)
    assert bool(buf.tensor.any())


def test_a_write_at_an_offset_verifies_at_the_same_offset_only(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    buf = _buffer(cfg)
    slots = torch.arange(8, 16)
    oracle.write(buf, TOKENS, slots, start=12)
    oracle.verify(buf, TOKENS, slots, start=12)
    with pytest.raises(FingerprintMismatchError):
        oracle.verify(buf, TOKENS, slots, start=0)


def test_verifying_no_slots_passes_even_on_a_buffer_that_holds_nothing(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    buf = _buffer(cfg)
    oracle.verify(buf, TOKENS, torch.empty(0, dtype=torch.int64))
    with pytest.raises(FingerprintMismatchError):
        oracle.verify(buf, TOKENS, torch.arange(1))


def test_untouched_zero_kv_does_not_verify(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    with pytest.raises(FingerprintMismatchError) as err:
        oracle.verify(_buffer(cfg), TOKENS, torch.arange(4, 12))
    assert (err.value.slot, err.value.position) == (4, 0)


def test_a_changed_token_is_reported_at_its_position(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    buf = _buffer(cfg)
    slots = torch.arange(100, 120)
    oracle.write(buf, TOKENS, slots)
    changed = list(TOKENS)
    changed[7] += 1
    with pytest.raises(FingerprintMismatchError, match=r"slot 107 \(position 7\) layer 0 K: expected") as err:
        oracle.verify(buf, changed, slots)
    assert (err.value.slot, err.value.position, err.value.layer, err.value.kv) == (107, 7, 0, "K")


def test_a_changed_token_changes_every_later_position_and_no_earlier_one(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    changed = list(TOKENS)
    changed[10] ^= 1
    a = oracle.expected(TOKENS, 0, 30)
    b = oracle.expected(changed, 0, 30)
    assert torch.equal(a[:, :, :10], b[:, :, :10])
    differs = (a != b).flatten(3).any(-1).any(0).any(0)  # per position
    assert differs[10:].all()


def test_swapped_slots_are_reported_at_the_first_moved_position(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    buf = _buffer(cfg)
    slots = torch.tensor([40, 41, 42, 43, 8, 9, 10, 11])
    oracle.write(buf, TOKENS, slots)
    a, b = buf.read(torch.tensor([42])), buf.read(torch.tensor([9]))
    buf.write(torch.tensor([42]), b)
    buf.write(torch.tensor([9]), a)
    with pytest.raises(FingerprintMismatchError, match=r"slot 42 \(position 2\)") as err:
        oracle.verify(buf, TOKENS, slots)
    assert err.value.position == 2 and err.value.slot == 42


def test_one_wrong_layer_of_one_slot_is_reported_with_its_layer_and_kv(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    buf = _buffer(cfg)
    slots = torch.arange(20, 30)
    oracle.write(buf, TOKENS, slots)
    buf.tensor[1, 2, 25, 0, 5] += 1  # V of layer 2 at slot 25 (position 5), one element
    with pytest.raises(FingerprintMismatchError, match=r"slot 25 \(position 5\) layer 2 V") as err:
        oracle.verify(buf, TOKENS, slots)
    assert (err.value.slot, err.value.position, err.value.layer, err.value.kv) == (25, 5, 2, "V")


def test_a_labelled_read_names_its_label_first_in_the_error(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    buf = _buffer(cfg)
    slots = torch.arange(20, 30)
    oracle.write(buf, TOKENS, slots)
    buf.tensor[0, 1, 22, 0, 0] += 1
    labelled = r"^request 'r7', prefix from L2: slot 22 \(position 2\) layer 1 K"
    with pytest.raises(FingerprintMismatchError, match=labelled) as err:
        oracle.verify(buf, TOKENS, slots, label="request 'r7', prefix from L2")
    assert err.value.label == "request 'r7', prefix from L2" and err.value.slot == 22
    with pytest.raises(FingerprintMismatchError, match=r"^slot 22 ") as plain:  # unlabelled: as before
        oracle.verify(buf, TOKENS, slots)
    assert plain.value.label == ""
    with pytest.raises(TypeError, match=r"^label must be a str naming the read \(a request, a tier\), got int$"):
        oracle.verify(buf, TOKENS, slots, label=7)  # type: ignore[arg-type]


def test_the_first_wrong_position_wins_over_a_lower_layer_later(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    buf = _buffer(cfg)
    slots = torch.arange(10)
    oracle.write(buf, TOKENS, slots)
    buf.tensor[0, 0, 8] += 1  # K layer 0 at position 8
    buf.tensor[1, 1, 3] += 1  # V layer 1 at position 3: earlier, reported first
    with pytest.raises(FingerprintMismatchError) as err:
        oracle.verify(buf, TOKENS, slots)
    assert (err.value.position, err.value.layer, err.value.kv) == (3, 1, "V")


def test_two_oracles_with_the_same_seed_agree_however_they_grew(cfg: Config) -> None:
    shape = KVShape.of(cfg)
    grown = FingerprintOracle(shape)
    grown.expected(TOKENS, 0, 2)
    grown.expected(TOKENS, 0, 5)
    fresh = FingerprintOracle(shape)
    long_tokens = TOKENS * 30
    assert torch.equal(grown.expected(long_tokens, 0, len(long_tokens)), fresh.expected(long_tokens, 0, len(long_tokens)))
    buf = _buffer(cfg)
    slots = torch.arange(16)
    grown.write(buf, TOKENS, slots)
    fresh.verify(buf, TOKENS, slots)


def test_oracles_with_different_seeds_disagree(cfg: Config) -> None:
    shape = KVShape.of(cfg)
    assert not torch.equal(FingerprintOracle(shape, seed=0).expected(TOKENS, 0, 8),
                           FingerprintOracle(shape, seed=1).expected(TOKENS, 0, 8))


def test_a_prefix_gets_the_same_kv_whatever_follows_it(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    whole = oracle.expected(TOKENS, 0, 40)
    assert torch.equal(oracle.expected(TOKENS[:12], 0, 12), whole[:, :, :12])
    assert torch.equal(oracle.expected(TOKENS, 12, 20), whole[:, :, 12:20])
    assert torch.equal(oracle.expected(torch.tensor(TOKENS), 0, 40), whole)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_expected_values_are_small_integers_exact_in_the_kv_dtype(make_config: Callable[..., Config], dtype: str) -> None:
    shape = KVShape.of(make_config(dtype=dtype))
    values = FingerprintOracle(shape).expected(TOKENS, 0, 40)
    assert values.dtype == shape.dtype
    as_float = values.float()
    assert torch.equal(as_float, as_float.round())
    assert float(as_float.abs().max()) <= 123
    assert len(torch.unique(as_float)) > 50


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_window_gets_the_values_a_long_run_gives_it(make_config: Callable[..., Config], dtype: str) -> None:
    """Any window of positions, from the start or extending a prefix's hash, equals the long
    run's, whatever form the tokens come in (a list and a tuple go through an `array`, a
    tensor as it is), with ids large enough that the int64 products wrap."""
    shape = KVShape.of(make_config(dtype=dtype, kv_heads=2, head_dim=4))
    oracle = FingerprintOracle(shape)
    tokens = [random.Random(5).randrange(2**62) for _ in range(300)]  # large ids: the products wrap
    whole = oracle.expected(tokens, 0, 300)
    for a, b in [(0, 1), (7, 8), (0, 64), (10, 74), (100, 165), (299, 300), (20, 20)]:
        for form in (tokens, tuple(tokens), torch.tensor(tokens)):
            got = oracle.expected(form, a, b)
            assert got.dtype == shape.dtype and torch.equal(got, whole[:, :, a:b]), (a, b, type(form))
        base = oracle.hash_at(tokens, a - 1)
        assert torch.equal(oracle.expected(tokens, a, b, base=base), whole[:, :, a:b])


def test_heads_and_head_dims_differ_so_a_transposition_shows(make_config: Callable[..., Config]) -> None:
    shape = KVShape.of(make_config(kv_heads=2, head_dim=4))
    values = FingerprintOracle(shape).expected(TOKENS, 0, 1)[0, 0, 0]  # [H, D]
    assert not torch.equal(values, values.flip(-1))
    assert not torch.equal(values[0], values[1])


def test_positions_outside_the_tokens_are_refused(cfg: Config) -> None:
    oracle = FingerprintOracle(KVShape.of(cfg))
    with pytest.raises(ValueError, match="positions 5..50 outside a prefix of 40 tokens"):
        oracle.expected(TOKENS, 5, 50)
    with pytest.raises(ValueError, match="positions 6..5"):
        oracle.expected(TOKENS, 6, 5)
    buffer = KVBuffer.allocate(KVShape.of(cfg), cfg.device_slots, HostLayout.LAYER_FIRST, "cpu")
    with pytest.raises(ValueError, match="positions 30..50 outside a prefix of 40 tokens"):
        oracle.write(buffer, TOKENS, torch.arange(20), start=30, base=0)  # with a base as without
    assert not buffer.tensor.any()
