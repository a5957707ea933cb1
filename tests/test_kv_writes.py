"""`Config.check_kv_writes`: a K/V write lands only in slots a live request holds for its own
positions, on both runtimes. A refused write names the first bad slot, says what it is and
writes nothing; with the option off (the default) the same writes land, as they always did."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import torch

from hicache.runtime import Config, HiCache, Insufficient, KVArgumentError, Request
from hicache.runtime._kv_checks import LiveSlots

from conftest import opened_caches, small_config

PROMPT = list(range(100, 113))  # 13 tokens: three whole pages and one token at page size 4
TODO_PREFIX = "write only the positions past the cached prefix"
TODO_GONE = "write a step's K/V before its request ends"
TODO_FREE = "write only into slots allocate() gave a live request"


@pytest.fixture
def open_cache(runtime_kind: str) -> Iterator[Callable[..., HiCache]]:
    """`open_cache(**config_fields)`: a started HiCache (2 layers, page size 4, 16 device pages,
    writes checked unless the fields say otherwise) on this test's runtime."""
    yield from opened_caches(runtime_kind, check_kv_writes=True)


def _write(hc: HiCache, slots: torch.Tensor, value: float = 7.0) -> None:
    """Every layer's K and V of `slots`, all `value`."""
    kv = hc.kv
    x = torch.full((len(slots), kv.kv_heads, kv.head_dim), value, dtype=kv.dtype, device=kv.device)
    for layer in range(kv.layers):
        kv.write(layer, slots, x, x)


def _landed(hc: HiCache, slots: torch.Tensor, value: float = 7.0) -> bool:
    return bool((hc.device_kv.read(slots) == value).all())


def _refused(hc: HiCache, slots: torch.Tensor, message: str) -> None:
    """A write of `slots` and an index of them for writing are refused with `message` (the whole
    line, a regex), and the pool is unchanged."""
    before = hc.device_kv.tensor.clone()
    for call in (lambda: _write(hc, slots), lambda: hc.kv.index(slots)):
        with pytest.raises(KVArgumentError, match=f"^{message}$"):
            call()
    assert torch.equal(hc.device_kv.tensor, before), "a refused write changed the pool"


def _line(slot: int, what: str, todo: str) -> str:
    return re.escape(f"slot {slot} {what}; ") + re.escape(todo) + r".* \(Config\.check_kv_writes\)"


def _served(hc: HiCache, rid: str, tokens: list[int], *, end: str = "finish") -> torch.Tensor:
    """Admit, allocate, write and commit every position of `tokens`, then end the request; its slots."""
    [adm] = hc.admit([Request(rid, tokens[:-1])])
    slots = torch.cat([adm.device_indices, hc.allocate({rid: len(tokens) - adm.cached_tokens})[rid]])
    _write(hc, slots[adm.cached_tokens:], 1.0)
    hc.commit({rid: tokens[adm.cached_tokens:]})
    getattr(hc, end)([adm.handle])
    return slots


# -- what is writable ---------------------------------------------------------------------------


def test_a_request_writes_its_own_fresh_slots_and_its_decode_steps(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache()
    [adm] = hc.admit([Request("a", PROMPT[:-1])])
    slots = hc.allocate({"a": len(PROMPT)})["a"]
    _write(hc, slots)
    for step in range(5):  # decode steps, within the last page and onto new ones
        slot = hc.allocate({"a": 1}, commit={"a": PROMPT if step == 0 else [7]})["a"]
        _write(hc, slot, 8.0 + step)
        assert _landed(hc, slot, 8.0 + step)
    assert _landed(hc, slots)
    hc.commit({"a": [7]})
    hc.finish([adm.handle])


def test_after_a_hit_the_positions_past_the_cached_prefix_are_writable(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache()
    _served(hc, "a", PROMPT)
    longer = PROMPT + [1, 2, 3]
    [adm] = hc.admit([Request("b", longer[:-1])])
    assert adm.device_hit == 12
    new = hc.allocate({"b": len(longer) - 12})["b"]
    _write(hc, new)
    assert _landed(hc, new)
    index = hc.kv.index(torch.cat([adm.device_indices, new]), distinct=False)  # reading the prefix is fine
    assert torch.equal(hc.kv.gather(0, index)[0][:12], hc.device_kv.read(adm.device_indices)[0, 0])


def test_pages_held_ahead_are_writable(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache(ahead_slots=8)  # two pages ahead of a decode step that needs a page
    [adm] = hc.admit([Request("a", PROMPT[:11])])
    hc.allocate({"a": 12})
    hc.commit({"a": PROMPT[:12]})
    [slot] = hc.allocate({"a": 1})["a"].tolist()  # a new page, and two held ahead
    ahead = [slot // 4 * 4 + 4 + i for i in range(8)]
    _write(hc, torch.tensor(ahead))
    assert _landed(hc, torch.tensor(ahead))
    assert hc.allocate({"a": 4})["a"].tolist() == [slot + 1, slot + 2, slot + 3, ahead[0]]
    hc.abort([adm.handle])


# -- what is refused ----------------------------------------------------------------------------


def test_a_write_into_a_cached_prefix_is_refused_and_nothing_lands(open_cache: Callable[..., HiCache]) -> None:
    """An engine that recomputes a whole prompt and writes every position: the prefix's first
    slot is named, and the new slots of the same call are not written either."""
    hc = open_cache()
    _served(hc, "a", PROMPT)
    [adm] = hc.admit([Request("b", PROMPT + [1, 2])])
    new = hc.allocate({"b": 3})["b"]
    prefix = adm.device_indices
    _refused(hc, torch.cat([new, prefix]),
             _line(int(prefix[0]), "is in the cached prefix of request 'b' (shared: other requests read it)",
                   TODO_PREFIX))
    assert not _landed(hc, new)


def test_a_write_into_a_free_slot_is_refused(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache()
    hc.admit([Request("a", PROMPT[:-1])])
    mine = hc.allocate({"a": 4})["a"]
    free = next(s for s in range(64) if s // 4 != int(mine[0]) // 4)
    _refused(hc, torch.tensor([int(mine[0]), free]), _line(free, "is free (no request holds its page)", TODO_FREE))


@pytest.mark.parametrize(("end", "how"), [("finish", "finished"), ("abort", "was aborted"),
                                          ("retract", "was retracted")])
def test_a_write_into_an_ended_request_s_slots_is_refused(
    open_cache: Callable[..., HiCache], end: str, how: str
) -> None:
    """A finished request's last step written late, a retracted request's old slot row: the
    cached whole pages and the freed last page alike belong to no live request."""
    hc = open_cache()
    slots = _served(hc, "a", PROMPT, end=end)
    for slot in (int(slots[12]), int(slots[0])):  # its last page (freed), its first (cached)
        _refused(hc, torch.tensor([slot]),
                 _line(slot, f"belongs to no live request (request 'a' {how})", TODO_GONE))


def test_a_write_through_an_index_made_before_the_request_ended_is_refused(
    open_cache: Callable[..., HiCache]
) -> None:
    """The index was writable when it was made; the check is made again once the requests'
    pages changed."""
    hc = open_cache()
    [adm] = hc.admit([Request("a", PROMPT[:-1])])
    slots = hc.allocate({"a": len(PROMPT)})["a"]
    index = hc.kv.index(slots[12:])
    _write(hc, index)
    hc.commit({"a": PROMPT})
    hc.finish([adm.handle])
    _refused(hc, index, _line(int(slots[12]), "belongs to no live request (request 'a' finished)", TODO_GONE))


def test_a_retracted_request_admitted_again_cannot_write_its_old_prefix(open_cache: Callable[..., HiCache]) -> None:
    hc = open_cache()
    [adm] = hc.admit([Request("a", PROMPT[:-1])])
    old = hc.allocate({"a": len(PROMPT)})["a"]
    _write(hc, old[:8])
    hc.commit({"a": PROMPT[:8]})
    hc.retract([adm.handle])
    [again] = hc.admit([Request("a", PROMPT[:-1])])
    assert again.device_hit == 8 and torch.equal(again.device_indices, old[:8])
    _refused(hc, old, _line(int(old[0]), "is in the cached prefix of request 'a' (shared: other requests read it)",
                            TODO_PREFIX))


def test_the_pages_a_request_handed_to_the_tree_by_cache_unfinished_are_refused(
    open_cache: Callable[..., HiCache]
) -> None:
    hc = open_cache()
    [adm] = hc.admit([Request("a", PROMPT[:-1])])
    first = hc.allocate({"a": 10})["a"]  # a prefill chunk: two whole pages and two positions
    _write(hc, first)
    hc.commit({"a": PROMPT[:10]})
    [handle] = hc.cache_unfinished([adm.handle])
    _refused(hc, first[4:5], _line(int(first[4]), "is in the cached prefix of request 'a' "
                                   "(shared: other requests read it)", TODO_PREFIX))
    _write(hc, first[8:])  # its last page is still its own
    rest = hc.allocate({"a": 3})["a"]
    _write(hc, rest)
    hc.commit({"a": PROMPT[10:]})
    hc.finish([handle])


def test_pages_swapped_for_the_tree_s_copy_in_cache_unfinished_are_refused(
    open_cache: Callable[..., HiCache]
) -> None:
    """Two requests compute the same prompt side by side; the second's `cache_unfinished`
    finds the first's copy in the tree and reads that one from then on."""
    hc = open_cache()
    [a, b] = hc.admit([Request("a", PROMPT[:-1]), Request("b", PROMPT[:-1])])
    got = hc.allocate({"a": 8, "b": 8})
    for rid in ("a", "b"):
        _write(hc, got[rid])
    hc.commit({"a": PROMPT[:8], "b": PROMPT[:8]})
    hc.finish([a.handle])
    hc.cache_unfinished([b.handle])
    assert torch.equal(hc.slots("b"), got["a"])
    mine = int(got["b"][0])
    _refused(hc, torch.tensor([mine]), _line(mine, "belongs to no live request (request 'b' gave it up in "
                                                   "cache_unfinished(), for the tree's copy of the same tokens)",
                                             TODO_GONE))
    _refused(hc, got["a"][:1], _line(int(got["a"][0]), "is in the cached prefix of request 'b' "
                                     "(shared: other requests read it)", TODO_PREFIX))


def test_pages_held_ahead_and_given_back_when_memory_ran_short_are_refused(
    open_cache: Callable[..., HiCache]
) -> None:
    hc = open_cache(ahead_slots=8, device_pages=8)
    [a] = hc.admit([Request("a", PROMPT[:3])])
    hc.allocate({"a": 4})
    hc.commit({"a": PROMPT[:4]})
    [slot] = hc.allocate({"a": 1})["a"].tolist()  # its second page, and two held ahead
    ahead = slot + 4
    hc.admit([Request("b", [5, 6, 7])])
    assert isinstance(hc.allocate({"b": 28}), Insufficient)  # short: a's pages ahead went back, to no avail
    _refused(hc, torch.tensor([ahead]), _line(ahead, "belongs to no live request (request 'a' gave it back: a page "
                                                     "held ahead, when memory ran short)", TODO_GONE))
    hc.abort([a.handle, hc.handle("b")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent on this machine")
def test_on_cuda_slots_on_the_device_are_checked_there() -> None:
    with HiCache(small_config(check_kv_writes=True, device="cuda")) as hc:
        _served(hc, "a", PROMPT)
        [adm] = hc.admit([Request("b", PROMPT + [1, 2])])
        new = hc.allocate({"b": 3})["b"].cuda()
        _write(hc, new)
        assert hc.kv.index(new).tensor.device.type == "cuda"
        prefix = adm.device_indices.cuda()
        _refused(hc, torch.cat([new, prefix]),
                 _line(int(prefix[0]), "is in the cached prefix of request 'b' (shared: other requests read it)",
                       TODO_PREFIX))


# -- off by default -----------------------------------------------------------------------------


def test_the_check_is_off_by_default_and_then_the_same_writes_land(open_cache: Callable[..., HiCache]) -> None:
    assert Config().check_kv_writes is False
    hc = open_cache(check_kv_writes=False)
    slots = _served(hc, "a", PROMPT)
    [adm] = hc.admit([Request("b", PROMPT + [1, 2])])
    for bad in (adm.device_indices[:2], slots[12:13], torch.tensor([63])):  # a prefix, an ended request's, free
        _write(hc, bad, 9.0)
        assert _landed(hc, bad, 9.0)
    assert hc.kv._writable is None


def test_the_mask_is_rebuilt_only_after_the_live_pages_changed(open_cache: Callable[..., HiCache],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward pass's layers share one check; a decode step served from the request's own
    pages changes nothing; a grant does."""
    builds = []
    real = LiveSlots._build
    monkeypatch.setattr(LiveSlots, "_build", lambda self, write: builds.append(1) or real(self, write))
    hc = open_cache()
    hc.admit([Request("a", PROMPT[:-1])])
    slots = hc.allocate({"a": len(PROMPT)})["a"]
    index = hc.kv.index(slots)
    _write(hc, index)
    _write(hc, slots)
    assert len(builds) == 1
    _write(hc, hc.allocate({"a": 1}, commit={"a": PROMPT})["a"])  # the last page's next slot
    assert len(builds) == 1
    _write(hc, hc.allocate({"a": 3})["a"])  # a new page
    assert len(builds) == 2


# -- writes for one request ---------------------------------------------------------------------


def test_a_write_for_a_request_takes_its_own_new_pages_and_refuses_another_s(
    open_cache: Callable[..., HiCache],
) -> None:
    """Two live requests: each writes its own new pages for itself; a write for one into the
    other's new page (an output-slot row kept after its pages changed hands) is refused, naming
    whose the slot is, and lands nothing. Without the request's id, both are live requests'
    own pages: the general check lets it through."""
    hc = open_cache()
    [b, c] = hc.admit([Request("b", PROMPT[:-1]), Request("c", PROMPT[:-1])])
    got = hc.allocate({"b": 4, "c": 4})
    kv = hc.kv
    x = torch.full((4, kv.kv_heads, kv.head_dim), 3.0, dtype=kv.dtype, device=kv.device)
    kv.write(0, got["b"], x, x, request_id="b")
    kv.index(got["c"], request_id="c")
    before = hc.device_kv.tensor.clone()
    refusal = "^" + re.escape(f"slot {int(got['c'][0])} is request 'c''s, not request 'b''s; a request writes only "
                              "into the slots allocate() gave it for its new positions: take them from allocate() "
                              "or slots('b') (Config.check_kv_writes)") + "$"
    for call in (lambda: kv.write(1, got["c"], x, x, request_id="b"),
                 lambda: kv.index(got["c"], request_id="b"),
                 lambda: kv.write(1, kv.index(got["c"]), x, x, request_id="b")):
        with pytest.raises(KVArgumentError, match=refusal):
            call()
    assert torch.equal(hc.device_kv.tensor, before), "a refused write changed the pool"
    kv.write(1, got["c"], x, x)  # for no request in particular
    with pytest.raises(KVArgumentError, match=r"^request 'z' is not live \(never admitted, or it ended\): a write"):
        kv.write(0, got["b"], x, x, request_id="z")
    hc.abort([b.handle, c.handle])


def test_a_write_for_a_request_into_its_own_cached_prefix_is_refused_as_any_prefix_write(
    open_cache: Callable[..., HiCache],
) -> None:
    hc = open_cache()
    _served(hc, "a", PROMPT)
    [adm] = hc.admit([Request("b", PROMPT)])
    assert adm.device_hit == 12
    slot = int(adm.device_indices[0])
    with pytest.raises(KVArgumentError, match="^" + _line(slot, "is in the cached prefix of request 'b' (shared: "
                                                          "other requests read it)", TODO_PREFIX) + "$"):
        hc.kv.index(adm.device_indices[:4], request_id="b")
    hc.abort([adm.handle])
