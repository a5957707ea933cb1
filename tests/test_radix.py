"""`RadixTree` driven directly: matching, insertion, splits, namespaces, the page
hash chain, locks and their counters, eviction order under every policy, the
node lifecycle and index copies.

Every tree here is wrapped by the `checked` fixture: `check_invariants()` runs
after every call, including calls that raised (a refused operation must leave the
tree consistent).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.actors import NODE_TRANSITIONS, InvariantError, Node, NodeState, NodeStateError, RadixTree, chain_hashes
from hicache.messages import Indices, Tokens
from hicache.runtime import EvictionPolicy

P = 4
"""Tokens per page in every tree here."""

S = NodeState


def toks(n: int, start: int = 1) -> Tokens:
    """`n` token ids `start, start + 1, ...`."""
    return Tokens.from_tensor(torch.arange(start, start + n, dtype=torch.int64))


def pages(n: int, start: int = 0) -> Indices:
    """`n` page numbers `start, start + 1, ...` (a node holds one per `P` tokens)."""
    return Indices.from_range(start, n)


def cat(*parts: Indices) -> Indices:
    return Indices.concat(parts)


@pytest.fixture
def make_tree(checked: Callable[[Any], Any]) -> Callable[..., Any]:
    """`make_tree(policy=LRU)`: a RadixTree with pages of 4 tokens, checked after every call."""
    return lambda policy=EvictionPolicy.LRU: checked(RadixTree(P, policy, index_tokens=P))


@pytest.fixture
def tree(make_tree: Callable[..., Any]) -> Any:
    return make_tree()


def back_up(tree: Any, node: Node, host: Indices) -> None:
    """DEVICE -> WRITING (with host pages) -> SYNCED, as a write-through does."""
    tree.set_state(node, S.WRITING)
    tree.set_host(node, host)
    tree.set_state(node, S.SYNCED)


def to_host_only(tree: Any, node: Node, host: Indices) -> None:
    back_up(tree, node, host)
    tree.evict_to_host(node)


def drain_device(tree: Any) -> list[list[int]]:
    """Pop device victims until none is left, deleting DEVICE ones and dropping the device copy
    of SYNCED ones; the first token of each victim, in eviction order."""
    order = []
    while (victim := tree.pop_device_victim()) is not None:
        order.append(victim.token_ids()[0])
        if victim.state is S.SYNCED:
            tree.evict_to_host(victim)
        else:
            tree.remove(victim)
    return order


# -- match -----------------------------------------------------------------------------


def test_match_finds_the_longest_page_aligned_prefix_and_ignores_a_partial_last_page(tree: Any) -> None:
    tree.insert("", toks(12), pages(3))
    path = tree.match("", cat(toks(10), Tokens.of([99, 98])))  # 10 cached, then a difference
    assert sum(nd.tokens for nd in path) == 8
    assert path[-1].device.tolist() == pages(2).tolist()
    assert sum(nd.tokens for nd in tree.match("", toks(11))) == 8  # 11 = 2 pages + a partial page
    assert sum(nd.tokens for nd in tree.match("", toks(3))) == 0  # less than a page never matches
    assert tree.match("", toks(8, start=50)) == []


def test_match_of_a_prefix_ending_inside_a_node_splits_it_at_the_page_boundary(tree: Any) -> None:
    tree.insert("", toks(12), pages(3))
    [upper] = tree.match("", toks(4))
    assert upper.token_ids() == toks(4).tolist()
    [lower] = upper.children.values()
    assert lower.token_ids() == toks(8, start=5).tolist()
    assert tree.nodes == 2


# -- insert --------------------------------------------------------------------------------


def test_insert_returns_how_many_tokens_were_already_present_and_which_pages_it_adopted(tree: Any) -> None:
    first = tree.insert("", toks(8), pages(2))
    assert first.present == 0
    assert [a.tolist() for a in first.adopted] == [pages(2).tolist()]
    assert first.duplicates == []

    # The same 8 tokens computed again in pages 5..6, then 8 new tokens in pages 7..8.
    second = tree.insert("", toks(16), cat(pages(2, 5), pages(2, 7)))
    assert second.present == 8
    assert [d.tolist() for d in second.duplicates] == [pages(2, 5).tolist()]
    assert [a.tolist() for a in second.adopted] == [pages(2, 7).tolist()]
    assert [nd.tokens for nd in second.path] == [8, 8]
    assert tree.device_tokens == 16


def test_insert_of_the_trees_own_pages_reports_no_duplicates(tree: Any) -> None:
    tree.insert("", toks(8), pages(2))
    again = tree.insert("", toks(8), pages(2))
    assert (again.present, again.duplicates, again.adopted) == (8, [], [])


def test_insert_reports_only_the_pages_that_differ_as_duplicates(tree: Any) -> None:
    tree.insert("", toks(8), pages(2))
    mixed = cat(pages(1), pages(1, 10))  # first page is the tree's own, the second a copy
    out = tree.insert("", toks(8), mixed)
    assert [d.tolist() for d in out.duplicates] == [pages(1, 10).tolist()]


@pytest.mark.parametrize("n", [2, 64, 65, 1024])  # pages: up to 64 are compared as ints
def test_the_differing_pages_are_the_same_whether_compared_as_ints_or_vectorised(tree: Any, n: int) -> None:
    tree.insert("", toks(n * P), pages(n))
    mine = Indices.of(i if i % 3 else 10_000 + i for i in range(n))  # every third page a copy
    out = tree.insert("", toks(n * P), mine)
    assert [d.tolist() for d in out.duplicates] == [[10_000 + i for i in range(n) if i % 3 == 0]]


def test_insert_refuses_partial_pages_and_a_page_count_that_differs(tree: Any) -> None:
    with pytest.raises(ValueError, match="whole pages and an index per 4 tokens, got 6 tokens, 2 indices"):
        tree.insert("", toks(6), pages(2))
    with pytest.raises(ValueError, match="got 8 tokens, 1 indices"):
        tree.insert("", toks(8), pages(1))
    with pytest.raises(ValueError, match="got 8 tokens, 8 indices"):  # one per token, as slots are
        tree.insert("", toks(8), pages(8))
    assert tree.nodes == 0


def test_insert_of_a_length_takes_only_that_many_tokens_as_a_slice_would(
        make_tree: Callable[..., Any]) -> None:
    whole, cut = make_tree(), make_tree()
    for t in (whole, cut):
        t.insert("", toks(8), pages(2))
    got = whole.insert("", toks(14), pages(3), length=12)  # two pages present, one new; the partial page left out
    want = cut.insert("", toks(14)[:12], pages(3))
    assert (got.present, [a.tolist() for a in got.adopted]) == (want.present, [a.tolist() for a in want.adopted])
    assert [(nd.key, nd.tokens) for nd in got.path] == [(nd.key, nd.tokens) for nd in want.path]
    assert [nd.tokens for nd in whole.match("", toks(14))] == [8, 4]
    with pytest.raises(ValueError, match="got 16 tokens, 4 indices"):  # longer than the tokens
        whole.insert("", toks(14), pages(4), length=16)


def test_a_tree_of_slots_takes_one_index_per_token_and_splits_them_per_token() -> None:
    """The default tree holds slots (one index per token), as SGLang's radix cache does."""
    tree = RadixTree(P, EvictionPolicy.LRU)
    [node] = tree.insert("", toks(8), Indices.from_range(100, 8)).path
    assert node.device.tolist() == list(range(100, 108))  # type: ignore[union-attr]
    path = tree.match("", toks(4))
    assert path[0].device.tolist() == [100, 101, 102, 103] and node.device.tolist() == [104, 105, 106, 107]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="an index per 1 tokens, got 8 tokens, 2 indices"):
        tree.insert("", toks(8, start=50), pages(2))
    with pytest.raises(ValueError, match="index_tokens must be 1 \\(slots\\) or page_size=4 \\(pages\\), got 2"):
        RadixTree(P, EvictionPolicy.LRU, index_tokens=2)
    tree.check_invariants()


def test_insert_counts_a_hit_on_every_node_it_passes(tree: Any) -> None:
    tree.insert("", toks(8), pages(2))
    out = tree.insert("", toks(16), pages(4))
    assert [nd.hit_count for nd in out.path] == [2, 1]


def test_insert_below_own_from_neither_adopts_nor_reports_duplicates(tree: Any) -> None:
    tree.insert("", toks(8), pages(2))
    # The caller's first 8 positions are in the tree's pages (its cached prefix); whatever it
    # passes there is not its own and must not be reported back.
    garbage = pages(2, 25)
    out = tree.insert("", toks(16), cat(garbage, pages(2, 10)), own_from=8)
    assert out.present == 8
    assert out.duplicates == []
    assert [a.tolist() for a in out.adopted] == [pages(2, 10).tolist()]
    assert out.path[0].device.tolist() == pages(2).tolist()


def test_insert_with_own_from_inside_a_node_splits_it_so_only_the_callers_part_is_compared(tree: Any) -> None:
    tree.insert("", toks(16), pages(4))
    out = tree.insert("", toks(16), cat(pages(2, 25), pages(2, 10)), own_from=8)
    assert [nd.tokens for nd in out.path] == [8, 8]
    assert out.present == 16
    assert [d.tolist() for d in out.duplicates] == [pages(2, 10).tolist()]  # only positions 8..15
    assert out.adopted == []


def _state(tree: RadixTree) -> list[tuple[Any, ...]]:
    """Every node of the tree, depth first by key: what an insert may change."""
    out, todo = [], [tree.root("")]
    while todo:
        node = todo.pop()
        if not node.is_root:
            out.append((bytes(node.key), node.device.tolist(), node.hit_count, node.last_access, node.priority))
        todo.extend(sorted(node.children.values(), key=lambda nd: bytes(nd.key), reverse=True))
    return out


@settings(max_examples=150, deadline=None)
@given(before=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=5), max_size=5),
       final=st.lists(st.integers(1, 3), min_size=1, max_size=6), priority=st.integers(0, 2))
def test_insert_after_the_cached_prefix_does_what_a_whole_insert_with_own_from_does(
    before: list[list[int]], final: list[int], priority: int,
) -> None:
    """Sequences of pages (each page's 4 tokens one repeated id, so that they share prefixes)."""
    def tokens(page_ids: list[int]) -> Tokens:
        return Tokens.of([t for i in page_ids for t in [i] * P])

    trees, outcomes = [], []
    for after in (False, True):
        tree = RadixTree(P, EvictionPolicy.LRU, index_tokens=P)
        for k, ids in enumerate(before):
            tree.insert("", tokens(ids), pages(len(ids), 100 * k))
        whole = tokens(final)
        path = tree.match("", whole)  # the request's admission: its cached prefix
        prefix = sum(nd.tokens for nd in path)
        device = pages(len(final), 1000)  # the request's own pages (a duplicate of each cached one)
        if after and path:
            out = tree.insert("", whole[prefix:], device[prefix // P :], priority=priority, after=path[-1])
        else:
            out = tree.insert("", whole, device, own_from=prefix, priority=priority)
        tree.check_invariants()
        trees.append(_state(tree))
        outcomes.append(([nd.key for nd in out.path], out.present, [a.tolist() for a in out.adopted],
                         [d.tolist() for d in out.duplicates]))
    assert trees[0] == trees[1]
    assert outcomes[0] == outcomes[1]


def test_views_of_a_larger_value_match_and_insert_as_their_copies_do(make_tree: Callable[..., Any]) -> None:
    """Large slices are views of their parent's bytes (`Indices`): the tree reads them at
    their place there, and a key it keeps is a view of most of those bytes or a copy of
    exactly its part, never a small view of a large buffer."""
    base = toks(1100 * P)
    view = base[8 * P : 1008 * P]  # 1,000 pages of the parent's 1,100, from page 8
    assert view.span()[1] == 8 * P * 8
    copy = Tokens(view.to_bytes())
    trees = []
    for tokens in (view, copy):
        tree = make_tree()
        tree.insert("", tokens[: 600 * P], pages(600))
        out = tree.insert("", tokens, pages(1000, 5000))
        assert out.present == 600 * P and [a.tolist() for a in out.adopted] == [pages(400, 5600).tolist()]
        path = tree.match("", tokens[: 999 * P + 3])
        assert [nd.tokens for nd in path] == [600 * P, 399 * P]
        assert len(path[0].key) == 600 * P * 8
        assert [bytes(nd.key) for nd in path] == [tokens.to_bytes()[: 600 * P * 8],
                                                 tokens.to_bytes()[600 * P * 8 : 999 * P * 8]]
        for nd in path:
            assert type(nd.key) is bytes or 2 * len(nd.key) >= len(nd.key.obj), f"{nd} keeps a larger buffer alive"
        tree.check_invariants()
        trees.append(_state(tree))
    assert trees[0] == trees[1]


@pytest.mark.parametrize("cut", [1, 100, 150, 250, 299])
def test_a_key_over_most_of_a_prompt_is_a_view_and_its_split_parts_keep_at_most_twice_their_bytes(
        make_tree: Callable[..., Any], cut: int) -> None:
    """An insert's new node over a whole prompt keeps the prompt's bytes without a copy; a
    split makes each part a view only while it is at least half of those bytes (else its
    own copy), so a small part never keeps the large buffer alive. Matches are unchanged."""
    tree = make_tree()
    prompt = toks(300 * P)
    [node] = tree.insert("", prompt, pages(300)).path
    assert node.key is prompt.span()[0]
    upper = tree.split(node, cut * P)
    for nd, lo, hi in ((upper, 0, cut), (node, cut, 300)):
        assert bytes(nd.key) == prompt.to_bytes()[8 * P * lo : 8 * P * hi]
        is_view = type(nd.key) is memoryview
        assert is_view == (2 * (hi - lo) >= 300 and 8 * P * (hi - lo) >= 4096), (nd, type(nd.key))
        assert not is_view or nd.key.obj is prompt.span()[0]
    assert tree.match("", prompt) == [upper, node]
    assert tree.match("", prompt[: cut * P]) == [upper]
    # Page hashes (storage keys) read a view as they read bytes.
    assert upper.hashes + node.hashes == chain_hashes(tree.root("").hashes[-1], prompt.to_bytes(), 8 * P)
    tree.check_invariants()


def test_page_hashes_are_a_blake2b_128_chain() -> None:
    """A page's hash is blake2b-128 of the previous page's hash (16 bytes, little-endian)
    and the page's token bytes, read as a little-endian number: the storage keys of a
    prefix are the same in every process and every run."""
    data = bytes(range(256)) * 3  # three pages of 256 bytes
    expect, prev = [], 2**128 - 5
    for at in range(0, len(data), 256):
        digest = hashlib.blake2b(prev.to_bytes(16, "little") + data[at : at + 256], digest_size=16).digest()
        prev = int.from_bytes(digest, "little")
        expect.append(prev)
    assert chain_hashes(2**128 - 5, data, 256) == tuple(expect)
    assert chain_hashes(expect[0], memoryview(data)[256:], 256) == tuple(expect[1:])  # a view, from a parent
    assert chain_hashes(7, b"", 256) == ()


def test_a_key_that_views_a_small_part_of_its_buffer_is_caught_by_the_invariant_check(tree: Any) -> None:
    [node] = tree.insert("", toks(300 * P), pages(300)).path
    node.key = memoryview(toks(1000 * P).span()[0])[: 300 * P * 8]
    with pytest.raises(InvariantError, match="its key views 9600 of the 32000 bytes it keeps alive"):
        tree.check_invariants()
    tree.remove(node)  # the parent's entry is found under the same first page


def test_insert_after_a_node_takes_no_own_from_and_needs_a_live_node_of_the_namespace(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    with pytest.raises(ValueError, match="insert after a node takes no own_from"):
        tree.insert("", toks(4, 9), pages(1, 5), own_from=4, after=node)
    with pytest.raises(InvariantError, match="must be a live node of namespace 'other'"):
        tree.insert("other", toks(4, 9), pages(1, 5), after=node)
    tree.remove(node)
    with pytest.raises(InvariantError, match="must be a live node of namespace ''"):
        tree.insert("", toks(4, 9), pages(1, 5), after=node)


def test_insert_refuses_a_cached_prefix_that_is_no_longer_in_the_tree(tree: Any) -> None:
    tree.insert("", toks(4), pages(1))
    with pytest.raises(InvariantError, match=r"cached prefix \(8 tokens\) is no longer in the tree at 4"):
        tree.insert("", toks(12), pages(3), own_from=8)


def test_insert_revives_a_host_only_node_with_the_callers_fresh_device_pages(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    to_host_only(tree, node, pages(2, 16))
    assert (tree.device_tokens, tree.host_tokens) == (0, 8)

    out = tree.insert("", toks(8), pages(2, 4))
    assert out.revived == [node]
    assert [a.tolist() for a in out.adopted] == [pages(2, 4).tolist()]
    assert (out.present, out.duplicates) == (8, [])
    assert node.state is S.SYNCED
    assert node.device.tolist() == pages(2, 4).tolist()
    assert node.host.tolist() == pages(2, 16).tolist()
    assert (tree.device_tokens, tree.host_tokens, tree.evictable_tokens) == (8, 8, 8)


def test_insert_stops_at_a_loading_node_and_leaves_the_callers_pages_to_it(tree: Any) -> None:
    # The load has not landed: the node's pages hold no KV yet, and a node under it would
    # outlive a failed load (device residency must stay prefix-closed).
    [node] = tree.insert("", toks(8), pages(2)).path
    to_host_only(tree, node, pages(2, 16))
    tree.start_load(node, pages(2, 8))
    out = tree.insert("", toks(12), pages(3, 4))
    assert (out.path, out.present, out.adopted, out.duplicates, out.revived) == ([], 0, [], [], [])
    assert node.device.tolist() == pages(2, 8).tolist() and not node.children
    tree.check_invariants()


# -- split -------------------------------------------------------------------------------------


def test_split_divides_keys_device_and_host_indices_hashes_and_keeps_lock_refs(tree: Any) -> None:
    [node] = tree.insert("", toks(12), pages(3)).path
    back_up(tree, node, pages(3, 25))
    tree.lock(node, +1)
    tree.lock(node, +1)
    hashes = node.hashes
    upper = tree.split(node, 4)
    assert upper.parent is tree.root("") and node.parent is upper
    assert upper.token_ids() == toks(4).tolist() and node.token_ids() == toks(8, start=5).tolist()
    assert upper.device.tolist() == pages(1).tolist() and node.device.tolist() == pages(2, 1).tolist()
    assert upper.host.tolist() == pages(1, 25).tolist() and node.host.tolist() == pages(2, 26).tolist()
    assert upper.hashes + node.hashes == hashes
    assert len(upper.hashes) == 1 and len(node.hashes) == 2
    assert (upper.lock_ref, node.lock_ref) == (2, 2)
    assert upper.state is node.state is S.SYNCED
    assert (tree.protected_tokens, tree.evictable_tokens, tree.nodes) == (12, 0, 2)
    tree.lock(node, -1)
    tree.lock(node, -1)
    assert (upper.lock_ref, tree.protected_tokens, tree.evictable_tokens) == (0, 0, 12)


@pytest.mark.parametrize("at", [0, 2, 5, 12, 16])
def test_split_refuses_a_cut_that_is_not_an_inner_page_boundary(tree: Any, at: int) -> None:
    [node] = tree.insert("", toks(12), pages(3)).path
    with pytest.raises(ValueError, match=f"cannot split .* at {at}"):
        tree.split(node, at)
    assert tree.nodes == 1


def test_split_and_insert_keep_exactly_their_part_of_a_larger_buffer(tree: Any) -> None:
    big_tokens, big_pages = toks(4096), pages(1024)
    [node] = tree.insert("", big_tokens[:12], big_pages[100:103]).path
    back_up(tree, node, big_pages[200:203])
    upper = tree.split(node, 8)
    for nd in (upper, node):
        assert len(nd.key) == 8 * nd.tokens, f"{nd} keeps {len(nd.key)} key bytes"
        assert len(nd.device.to_bytes()) == len(nd.host.to_bytes()) == 8 * (nd.tokens // P)  # type: ignore[union-attr]
    assert (upper.device.tolist(), node.host.tolist()) == ([100, 101], [202])  # type: ignore[union-attr]
    out = tree.insert("", big_tokens[:16], big_pages[300:304])
    assert [len(i) for i in out.adopted] == [1] and out.adopted[0].tolist() == [303]
    assert len(out.path[-1].key) == 8 * 4


def test_a_node_holding_pages_that_are_not_indices_is_caught_by_the_invariant_check() -> None:
    tree = RadixTree(P, EvictionPolicy.LRU, index_tokens=P)
    [node] = tree.insert("", toks(8), pages(2)).path
    node.device = torch.arange(2, dtype=torch.int64)  # type: ignore[assignment]
    with pytest.raises(InvariantError, match="device pages are a Tensor, not Indices"):
        tree.check_invariants()


# -- namespaces and the hash chain -------------------------------------------------------------------


def test_the_same_tokens_in_two_namespaces_make_two_nodes_with_different_hashes(tree: Any) -> None:
    a = tree.insert("model-a", toks(8), pages(2)).path
    b = tree.insert("model-b", toks(8), pages(2, 2)).path
    assert a[0] is not b[0]
    assert tree.nodes == 2
    assert set(a[0].hashes).isdisjoint(b[0].hashes)
    assert tree.root("model-a") is not tree.root("model-b")
    assert tree.match("model-a", toks(8))[0] is a[0]
    assert tree.match("model-b", toks(8))[0] is b[0]
    assert tree.match("model-c", toks(8)) == []


def test_an_insert_in_one_namespace_never_reports_anothers_pages_as_present(tree: Any) -> None:
    tree.insert("model-a", toks(8), pages(2))
    out = tree.insert("model-b", toks(8), pages(2, 2))
    assert (out.present, out.duplicates) == (0, [])


def test_the_same_prefix_gets_the_same_page_hashes_in_any_tree(make_tree: Callable[..., Any]) -> None:
    one, two = make_tree(), make_tree()
    [a] = one.insert("m", toks(12), pages(3)).path
    two.insert("m", toks(4), pages(1))
    two.insert("m", toks(8), pages(2))
    b = two.insert("m", toks(12), pages(3)).path
    assert len(b) == 3
    assert a.hashes == tuple(h for nd in b for h in nd.hashes)
    assert len(set(a.hashes)) == 3


def test_a_differing_earlier_page_changes_every_later_page_hash(tree: Any) -> None:
    [a] = tree.insert("", toks(12), pages(3)).path
    other = Tokens.of([1, 999, *range(3, 13)])  # only the first page differs
    [b] = tree.insert("", other, pages(3, 3)).path
    assert all(ha != hb for ha, hb in zip(a.hashes, b.hashes, strict=True))
    assert a.token_ids()[4:] == b.token_ids()[4:]  # same tokens in the later pages


# -- locks ------------------------------------------------------------------------------------------------


def test_a_lock_counts_up_the_whole_path_with_exact_protected_and_evictable_counts(tree: Any) -> None:
    x, = tree.insert("", toks(8), pages(2)).path
    _, y = tree.insert("", toks(16), pages(4)).path
    _, _, z = tree.insert("", toks(24), pages(6)).path
    tree.lock(z, +1)
    assert [n.lock_ref for n in (x, y, z)] == [1, 1, 1]
    assert (tree.protected_tokens, tree.evictable_tokens) == (24, 0)
    tree.lock(y, +1)
    assert [n.lock_ref for n in (x, y, z)] == [2, 2, 1]
    tree.lock(z, -1)
    assert [n.lock_ref for n in (x, y, z)] == [1, 1, 0]
    assert (tree.protected_tokens, tree.evictable_tokens) == (16, 8)
    tree.lock(y, -1)
    assert (tree.protected_tokens, tree.evictable_tokens) == (0, 24)


def test_a_lock_on_one_branch_leaves_the_other_branch_evictable(tree: Any) -> None:
    tree.insert("", toks(8), pages(2))
    _, left = tree.insert("", cat(toks(8), toks(4, 100)), cat(pages(2), pages(1, 2))).path
    _, right = tree.insert("", cat(toks(8), toks(4, 200)), cat(pages(2), pages(1, 3))).path
    tree.lock(left, +1)
    assert (tree.protected_tokens, tree.evictable_tokens) == (12, 4)
    assert right.lock_ref == 0


def test_releasing_a_lock_that_is_not_held_is_refused_and_changes_nothing(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    with pytest.raises(InvariantError, match=r"lock ref of .* would become -1 \(invariant: lock ref >= 0"):
        tree.lock(node, -1)
    assert node.lock_ref == 0
    assert (tree.protected_tokens, tree.evictable_tokens) == (0, 8)
    tree.lock(node, +1)
    tree.lock(node, -1)
    with pytest.raises(InvariantError, match="released twice"):
        tree.lock(node, -1)


def test_a_lock_moves_by_one_at_a_time(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    with pytest.raises(ValueError, match="lock delta must be \\+1 or -1, got 2"):
        tree.lock(node, 2)
    assert node.lock_ref == 0


def test_a_host_pin_below_zero_is_refused(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    with pytest.raises(InvariantError, match="host ref of .* would become -1"):
        tree.pin_host(node, -1)
    assert node.host_ref == 0


# -- device eviction order ---------------------------------------------------------------------------------


def _three_leaves(tree: Any, priorities: tuple[int, int, int] = (0, 0, 0)) -> list[Node]:
    """Leaves starting with tokens 1, 101 and 201, inserted in that order."""
    return [
        tree.insert("", toks(4, start), pages(1, i), priority=prio).path[0]
        for i, (start, prio) in enumerate(zip((1, 101, 201), priorities, strict=True))
    ]


def test_lru_evicts_the_least_recently_used_leaf_first(make_tree: Callable[..., Any]) -> None:
    tree = make_tree(EvictionPolicy.LRU)
    _three_leaves(tree)
    tree.match("", toks(4, 1))  # the oldest becomes the most recent
    tree.match("", toks(4, 201))
    assert drain_device(tree) == [101, 1, 201]


@pytest.mark.parametrize("access", ["match", "insert"])
def test_an_access_that_cuts_a_node_touches_only_the_part_it_reached(
    make_tree: Callable[..., Any], access: str,
) -> None:
    """A prompt that diverges inside a node reached the part above the cut; the part below
    keeps its own access time, so it goes before a leaf used after it (SGLang's RadixCache
    touches the whole node before it cuts it: docs/benchmarks.md has what that changes)."""
    tree = make_tree(EvictionPolicy.LRU)
    tree.insert("", toks(8, 1), pages(2))  # the node the access will cut: 1..8
    tree.insert("", toks(4, 101), pages(1, 10))  # a leaf used after it
    if access == "match":
        tree.match("", cat(toks(4, 1), Tokens.of([7] * P)))
    else:
        tree.insert("", cat(toks(4, 1), Tokens.of([7] * P)), pages(2, 20))
    upper = tree.root("").children[toks(4, 1).to_bytes()]  # children are keyed by their first page
    lower = upper.children[toks(4, 5).to_bytes()]
    assert upper.tokens == 4 and lower.last_access < upper.last_access
    tree.check_invariants()
    order = drain_device(tree)
    assert order.index(5) < order.index(101)  # the remainder before the leaf used after it


def test_stale_eviction_entries_are_compacted_and_the_order_survives(tree: Any) -> None:
    _three_leaves(tree)
    for _ in range(700):  # every access re-offers the leaf: 2,100 stale entries, past the bound
        for start in (201, 1, 101):
            tree.match("", toks(4, start))
    assert len(tree._device_heap) <= 2 * tree.nodes + 1024
    assert drain_device(tree) == [201, 1, 101]


def test_lfu_evicts_the_least_frequently_hit_leaf_first(make_tree: Callable[..., Any]) -> None:
    tree = make_tree(EvictionPolicy.LFU)
    _three_leaves(tree)
    for _ in range(3):
        tree.insert("", toks(4, 1), pages(1))  # hit count 4
    tree.insert("", toks(4, 201), pages(1, 2))  # hit count 2
    assert drain_device(tree) == [101, 201, 1]


def test_fifo_evicts_in_creation_order_whatever_the_accesses(make_tree: Callable[..., Any]) -> None:
    tree = make_tree(EvictionPolicy.FIFO)
    _three_leaves(tree)
    tree.match("", toks(4, 1))
    tree.insert("", toks(4, 1), pages(1))
    assert drain_device(tree) == [1, 101, 201]


def test_priority_evicts_the_lowest_priority_first(make_tree: Callable[..., Any]) -> None:
    tree = make_tree(EvictionPolicy.PRIORITY)
    _three_leaves(tree, priorities=(5, 1, 3))
    tree.match("", toks(4, 101))  # access does not outrank priority
    assert drain_device(tree) == [101, 201, 1]


def test_priority_of_a_node_is_the_highest_any_insert_gave_it(make_tree: Callable[..., Any]) -> None:
    tree = make_tree(EvictionPolicy.PRIORITY)
    _three_leaves(tree, priorities=(1, 2, 3))
    tree.insert("", toks(4, 1), pages(1), priority=9)
    tree.insert("", toks(4, 1), pages(1), priority=0)
    assert drain_device(tree) == [101, 201, 1]


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_eviction_skips_locked_leaves_under_every_policy(make_tree: Callable[..., Any], policy: EvictionPolicy) -> None:
    tree = make_tree(policy)
    first, _, _ = _three_leaves(tree)
    tree.lock(first, +1)
    assert drain_device(tree) == [101, 201]
    assert tree.pop_device_victim() is None
    tree.lock(first, -1)  # unlocked: evictable again
    assert drain_device(tree) == [1]


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_a_node_with_device_resident_children_is_evicted_only_after_them(
    make_tree: Callable[..., Any], policy: EvictionPolicy
) -> None:
    tree = make_tree(policy)
    [parent] = tree.insert("", toks(4), pages(1)).path  # the oldest, least hit, lowest priority
    tree.insert("", toks(8), pages(2), priority=5)
    tree.insert("", cat(toks(4), toks(4, 50)), cat(pages(1), pages(1, 2)), priority=5)
    assert parent.resident_children == 2
    order = drain_device(tree)
    assert sorted(order[:2]) == [5, 50] and order[2] == 1


def test_a_locked_child_keeps_its_parent_off_the_eviction_list(tree: Any) -> None:
    tree.insert("", toks(4), pages(1))
    _, child = tree.insert("", toks(8), pages(2)).path
    tree.lock(child, +1)
    assert tree.pop_device_victim() is None
    tree.lock(child, -1)
    assert drain_device(tree) == [5, 1]


def test_a_host_only_child_does_not_keep_its_synced_parent_on_the_device(tree: Any) -> None:
    [parent] = tree.insert("", toks(4), pages(1)).path
    _, child = tree.insert("", toks(8), pages(2)).path
    back_up(tree, parent, pages(1, 25))
    to_host_only(tree, child, pages(1, 26))
    assert tree.pop_device_victim() is parent


def test_evicting_a_leaf_makes_its_parent_a_victim(tree: Any) -> None:
    tree.insert("", toks(4), pages(1))
    _, child = tree.insert("", toks(8), pages(2)).path
    assert tree.pop_device_victim() is child
    tree.remove(child)
    assert tree.pop_device_victim().token_ids()[0] == 1


def test_writing_and_loading_nodes_are_never_device_victims(tree: Any) -> None:
    [writing] = tree.insert("", toks(4, 1), pages(1)).path
    tree.set_state(writing, S.WRITING)
    [loading] = tree.insert("", toks(4, 101), pages(1, 1)).path
    to_host_only(tree, loading, pages(1, 25))
    tree.start_load(loading, pages(1, 2))
    assert tree.pop_device_victim() is None


def test_only_a_leaf_can_be_removed(tree: Any) -> None:
    [parent] = tree.insert("", toks(4), pages(1)).path
    tree.insert("", toks(8), pages(2))
    with pytest.raises(InvariantError, match="only a leaf can be removed"):
        tree.remove(parent)
    assert tree.nodes == 2


# -- pages from storage -------------------------------------------------------------------------------


def test_insert_host_takes_one_host_page_per_page_and_leaves_those_the_tree_holds_unused(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    back_up(tree, node, pages(2, 25))
    out = tree.insert_host(tree.root(""), toks(16), pages(4, 40))
    [new] = out.new
    assert new.parent is node and new.state is S.HOST_ONLY and new.token_ids() == toks(8, start=9).tolist()
    assert new.host.tolist() == [42, 43]  # type: ignore[union-attr]
    assert [u.tolist() for u in out.unused] == [[40, 41]]  # the pages of the tokens the tree held
    assert tree.host_tokens == 16
    with pytest.raises(ValueError, match="an index per 4 tokens past the 0 held, got 8 tokens, 8 indices"):
        tree.insert_host(tree.root(""), toks(8), pages(8, 100))


def test_insert_host_walks_the_held_tokens_without_pages_and_attaches_the_read_ones_after(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    back_up(tree, node, pages(2, 25))
    out = tree.insert_host(tree.root(""), toks(16), pages(2, 40), held=8)  # pages only for tokens 8..15
    [new] = out.new
    assert new.parent is node and new.host.tolist() == [40, 41] and out.unused == []  # type: ignore[union-attr]
    assert out.last is new
    # a held part the tree lost, or one that is not backed up: nothing after it attaches
    [lone] = tree.insert("", toks(4, start=200), pages(1, 60)).path  # device only
    out = tree.insert_host(tree.root(""), toks(12, start=200), pages(2, 70), held=4)
    assert out.new == [] and [u.tolist() for u in out.unused] == [[70, 71]] and lone.children == {}
    out = tree.insert_host(tree.root(""), toks(12, start=500), pages(2, 80), held=4)
    assert out.new == [] and [u.tolist() for u in out.unused] == [[80, 81]]
    tree.check_invariants()


def test_insert_host_takes_no_page_past_a_node_that_is_not_backed_up(tree: Any) -> None:
    tree.insert("", toks(4), pages(1))
    out = tree.insert_host(tree.root(""), toks(12), pages(3, 40))
    assert out.new == []
    assert [u.tolist() for u in out.unused] == [[40, 41, 42]]
    assert (tree.nodes, tree.host_tokens) == (1, 0)


# -- host eviction -------------------------------------------------------------------------------------


def test_host_eviction_takes_host_only_leaves_in_policy_order(tree: Any) -> None:
    nodes = _three_leaves(tree)
    for i, nd in enumerate(nodes):
        to_host_only(tree, nd, pages(1, 25 + i))
    tree.match("", toks(4, 1))  # most recent now
    order = []
    while (victim := tree.pop_host_victim()) is not None:
        order.append(victim.token_ids()[0])
        tree.remove(victim)
    assert order == [101, 201, 1]
    assert tree.host_tokens == 0


def test_host_eviction_skips_device_resident_pinned_locked_and_inner_nodes(tree: Any) -> None:
    [synced] = tree.insert("", toks(4, 1), pages(1)).path
    back_up(tree, synced, pages(1, 25))  # host copy, but still on the device
    [pinned] = tree.insert("", toks(4, 101), pages(1, 1)).path
    to_host_only(tree, pinned, pages(1, 26))
    tree.pin_host(pinned, +1)
    [locked] = tree.insert("", toks(4, 201), pages(1, 2)).path
    to_host_only(tree, locked, pages(1, 27))
    tree.lock(locked, +1)
    [inner] = tree.insert("", toks(4, 301), pages(1, 3)).path
    _, leaf = tree.insert("", cat(toks(4, 301), toks(4, 401)), cat(pages(1, 3), pages(1, 4))).path
    back_up(tree, inner, pages(1, 28))  # backups parent first, evictions child first
    to_host_only(tree, leaf, pages(1, 29))
    tree.evict_to_host(inner)

    assert tree.pop_host_victim() is leaf  # the only host-only leaf with no pin and no lock
    tree.remove(leaf)
    assert tree.pop_host_victim() is inner  # a leaf now
    tree.remove(inner)
    assert tree.pop_host_victim() is None
    tree.pin_host(pinned, -1)
    tree.lock(locked, -1)
    got = {tree.pop_host_victim(), tree.pop_host_victim()}
    assert got == {pinned, locked}
    assert tree.pop_host_victim() is None


def test_a_host_only_node_is_not_a_device_victim_and_a_device_node_is_not_a_host_victim(tree: Any) -> None:
    [dev] = tree.insert("", toks(4, 1), pages(1)).path
    [host] = tree.insert("", toks(4, 101), pages(1, 1)).path
    to_host_only(tree, host, pages(1, 25))
    assert tree.pop_device_victim() is dev
    assert tree.pop_host_victim() is host
    assert tree.pop_device_victim() is None and tree.pop_host_victim() is None


# -- node lifecycle -----------------------------------------------------------------------------------


def test_every_legal_lifecycle_move_keeps_the_counters_exact(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    tree.set_state(node, S.WRITING)  # DEVICE -> WRITING
    tree.set_state(node, S.DEVICE)  # WRITING -> DEVICE (failed write)
    back_up(tree, node, pages(2, 25))  # DEVICE -> WRITING -> SYNCED
    assert (tree.device_tokens, tree.host_tokens) == (8, 8)
    tree.evict_to_host(node)  # SYNCED -> HOST_ONLY
    assert (tree.device_tokens, tree.evictable_tokens) == (0, 0)
    tree.start_load(node, pages(2, 4))  # HOST_ONLY -> LOADING
    assert (tree.device_tokens, tree.evictable_tokens) == (8, 8)
    tree.fail_load(node)  # LOADING -> HOST_ONLY
    assert node.device is None and tree.device_tokens == 0
    tree.start_load(node, pages(2, 4))
    tree.set_state(node, S.SYNCED)  # LOADING -> SYNCED
    tree.evict_to_host(node)
    tree.insert("", toks(8), pages(2, 6))  # HOST_ONLY -> SYNCED (revival)
    assert node.state is S.SYNCED
    seen = {(S.DEVICE, S.WRITING), (S.WRITING, S.DEVICE), (S.WRITING, S.SYNCED), (S.SYNCED, S.HOST_ONLY),
            (S.HOST_ONLY, S.LOADING), (S.LOADING, S.HOST_ONLY), (S.LOADING, S.SYNCED), (S.HOST_ONLY, S.SYNCED)}
    assert seen == NODE_TRANSITIONS


def _node_in(tree: Any, state: NodeState) -> Node:
    [node] = tree.insert("", toks(8), pages(2)).path
    if state is S.DEVICE:
        return node
    tree.set_state(node, S.WRITING)
    if state is S.WRITING:
        return node
    tree.set_host(node, pages(2, 25))
    tree.set_state(node, S.SYNCED)
    if state is S.SYNCED:
        return node
    tree.evict_to_host(node)
    if state is S.HOST_ONLY:
        return node
    tree.start_load(node, pages(2, 4))
    return node


@pytest.mark.parametrize(
    ("start", "to"),
    sorted(
        ((a, b) for a in NodeState for b in NodeState if (a, b) not in NODE_TRANSITIONS),
        key=lambda ab: (ab[0].value, ab[1].value),
    ),
    ids=lambda s: s.value,
)
def test_an_illegal_lifecycle_move_is_refused_naming_both_states_and_changes_nothing(
    tree: Any, start: NodeState, to: NodeState
) -> None:
    node = _node_in(tree, start)
    counters = (tree.device_tokens, tree.host_tokens, tree.protected_tokens, tree.evictable_tokens)
    with pytest.raises(NodeStateError, match=f"illegal node transition {start.value} -> {to.value}"):
        tree.set_state(node, to)
    assert node.state is start
    assert (tree.device_tokens, tree.host_tokens, tree.protected_tokens, tree.evictable_tokens) == counters


def test_dropping_the_device_copy_of_a_node_that_is_not_backed_up_is_refused(tree: Any) -> None:
    [node] = tree.insert("", toks(8), pages(2)).path
    with pytest.raises(NodeStateError, match="illegal node transition device -> host_only"):
        tree.evict_to_host(node)
    assert node.device is not None and tree.device_tokens == 8


def test_a_scheduler_joining_its_prefix_pages_to_new_ones_hands_the_tree_the_new_ones_uncopied(tree: Any) -> None:
    # As a scheduler does: the cached prefix's pages and the new ones in one value, the
    # new part sliced back out by the tree (lazy `Indices.concat`: no copy of either).
    tree.insert("", toks(4 * 600), pages(600))
    [prefix] = tree.match("", toks(4 * 1200))
    new = pages(600, 5000)
    device = cat(prefix.device, new)[:1200]
    out = tree.insert("", toks(4 * 1200), device, own_from=4 * 600)
    assert out.present == 2400 and out.duplicates == []
    [adopted] = out.adopted
    assert adopted.span()[0] is new.span()[0] and adopted == new
    # Pages across both parts of such a value make a node too (its bytes joined when read).
    spanning = cat(pages(600, 9000), pages(600, 20_000))
    out = tree.insert("", toks(4 * 1200, start=10**6), spanning)
    [node] = out.path
    assert node.device == Indices.of(list(range(9000, 9600)) + list(range(20_000, 20_600)))
    upper, lower = tree.match("", toks(4 * 700, start=10**6))[0], node  # a split inside the second part
    assert upper.device.tolist() == list(range(9000, 9600)) + list(range(20_000, 20_100))
    assert lower.device.tolist() == list(range(20_100, 20_600)) and lower.parent is upper
