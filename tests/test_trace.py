"""The embedded trace's tokens: a pure function of each block's hash id (the peer harness
rebuilds them with `block_tokens`, so both must agree)."""

import torch

from hicache.runtime.trace import BLOCK_TOKENS, TraceRequest, block_tokens, load_trace


def test_a_requests_tokens_are_its_blocks_tokens_one_after_the_other() -> None:
    for r in list(load_trace(40)):
        want = torch.cat([block_tokens(h) for h in r.hash_ids])[: r.input_length]
        assert torch.equal(r.tokens(), want), r.index


def test_a_prompt_that_ends_within_a_block_is_cut_there_and_no_prompt_is_empty_tokens() -> None:
    r = TraceRequest(index=0, timestamp_ms=0, input_length=BLOCK_TOKENS + 3, output_length=1, hash_ids=(7, 8, 9))
    assert torch.equal(r.tokens(), torch.cat([block_tokens(7), block_tokens(8)[:3]]))
    assert TraceRequest(0, 0, 0, 1, ()).tokens().numel() == 0
