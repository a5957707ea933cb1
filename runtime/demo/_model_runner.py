"""`ModelRunner`: a transformers decoder-only causal LM served over the cache.

For each request it does what an engine does: admit the prompt minus its last token
(the last one is always computed, its logits give the first output token), start the
load-backs, allocate slots for the uncached positions, prefill only those, then decode
greedily, one `allocate(..., commit=...)` per step, and finish. A forward pass runs the
model with a `PoolCache`, a transformers `Cache` whose layers live in the device pool:
at each layer, attention's call to `Cache.update` waits for that layer's load-back
(`LayerWaiter.wait_layer`), writes the new tokens' K and V into their slots and gathers
the request's K and V from the pool (`DeviceKV`), in transformers' `[1, kv_heads, n,
head_dim]`. `forward(steps, waiter)` is the same pass for the reference scheduler's
ticks (`ReferenceScheduler(hc, model=runner)`).

One request per forward pass (batch 1): transformers' attention takes one padded batch,
not a paged one. Decoder-only models of full (and sliding-window) attention layers
are served (Llama, Qwen2, Mistral and their kin); the pool holds every position of a
request, and the model's own mask hides what a sliding window does not see.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy
import torch
from transformers import Cache, CacheLayerMixin

from hicache.actors._layers import LayerWaiter, LoadFailedError
from hicache.messages._model_shape import model_shape
from hicache.messages.config import StorageKind

from .._engine_kv import DeviceKV, SlotIndex
from .._facade import AdmitResult, HiCache, Insufficient, Request
from .._facade_types import request_id, shown, token_bytes

LOAD_ATTEMPTS_MAX = 3
"""Admissions of one request whose load-back failed before `generate` gives up (each failure
drops the failed prefix from the tree, so the next admission recomputes more)."""

PREFETCH_WAIT_MAX_S = 120.0
"""Longest `generate` waits for a storage prefetch that `prefetch_policy` keeps unready."""

PREFETCH_POLL_S = 0.001

_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class KVObserver(Protocol):
    """Sees the K/V a forward pass writes and reads, per layer (`[n, kv_heads, head_dim]`, on the
    pool's device): tests compare them bitwise with what was written for the same prefix."""

    def wrote(self, layer: int, tokens: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The K/V of positions `start .. len(tokens) - 1` of `tokens`, just written."""

    def read(self, layer: int, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """The K/V of positions `0 .. len(tokens) - 1` that attention reads."""


class ModelRunnerError(RuntimeError):
    """The model cannot be served over this cache, or a request could not be served."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One request served by `ModelRunner.generate`."""

    request_id: str
    prompt_tokens: int
    tokens: tuple[int, ...]
    """The greedy output tokens."""
    logits: torch.Tensor
    """`[len(tokens), vocab]` float32 on CPU: row `i` is what `tokens[i]` was chosen from."""
    admitted: AdmitResult
    """The admission that served it (its hits; the last one when a load-back failed)."""
    ttft_s: float
    """Measured: from the call (prefetch wait included) to the first output token."""
    total_s: float


class _Pass:
    """One forward pass of one request over the pool (what every `PoolCache` layer shares)."""

    def __init__(self, kv: DeviceKV, tokens: Sequence[int], start: int, slots: SlotIndex,
                 new: SlotIndex, waiter: LayerWaiter | None, observer: KVObserver | None,
                 request_id: str | None = None) -> None:
        self.kv, self.tokens, self.start, self.slots, self.new = kv, tokens, start, slots, new
        self.waiter, self.observer, self.request_id = waiter, observer, request_id

    def update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != 1 or key_states.shape[2] != len(self.new):
            raise ModelRunnerError(f"layer {layer} computed K/V of shape {tuple(key_states.shape)}; a pass over the "
                                   f"pool takes one request of {len(self.new)} new tokens")
        if self.waiter is not None:
            self.waiter.wait_layer(layer)  # its cached prefix may still be loading back
        k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        self.kv.write(layer, self.new, k, v, request_id=self.request_id)
        keys, values = self.kv.gather(layer, self.slots, request_id=self.request_id)
        if self.observer is not None:
            self.observer.wrote(layer, self.tokens, self.start, k, v)
            self.observer.read(layer, self.tokens, keys, values)
        return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


class _PoolLayer(CacheLayerMixin):
    """One model layer of a `PoolCache`: its past is the request's cached positions."""

    is_compileable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, p: _Pass, layer: int) -> None:
        super().__init__()
        self._pass, self._layer = p, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pass.update(self._layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._pass.start + query_length, 0

    def get_seq_length(self) -> int:
        return self._pass.start

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise ModelRunnerError("a PoolCache serves one forward pass; the pool, not the cache object, keeps the KV")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.reset()


class PoolCache(Cache):
    """A transformers `Cache` over the device pool for one forward pass of one request:
    positions before `start` of `tokens` are cached in `slots[:start]`, the pass computes
    the rest into `slots[start:]`. Given its `request_id`, the writes and reads of each layer
    are checked to be of that request's pages (with `Config.check_kv_writes`, `check_kv_reads`)."""

    def __init__(self, kv: DeviceKV, tokens: Sequence[int], start: int, slots: torch.Tensor,
                 waiter: LayerWaiter | None = None, observer: KVObserver | None = None,
                 request_id: str | None = None) -> None:
        if not 0 <= start < len(tokens) or len(slots) != len(tokens):
            raise ModelRunnerError(f"a pass computes positions start..{len(tokens) - 1} with a slot for each of "
                                   f"the {len(tokens)}; got start={start} and {len(slots)} slots")
        # The new slots are distinct; the cached ones may meet them only when a load-back
        # failed and its pages were granted again, and then `wait_layer` raises before any write.
        p = _Pass(kv, tokens, start, kv.index(slots, distinct=False, request_id=request_id),
                  kv.index(slots[start:], request_id=request_id), waiter, observer, request_id)
        super().__init__(layers=[_PoolLayer(p, i) for i in range(kv.layers)])


class ModelRunner:
    """Serves a transformers causal LM (`model`, in eval mode) over a started `HiCache` whose
    shape is the model's (build the config with `Config.for_model(model.config, ...)`)."""

    def __init__(self, model: Any, cache: HiCache, *, observer: KVObserver | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
        self.model, self.cache, self.observer = model, cache, observer
        self._clock, self._sleep = clock, sleep
        _check_model(model, cache)
        self.device = next(model.parameters()).device

    # -- one forward pass -----------------------------------------------------------------

    def compute(self, tokens: Sequence[int], start: int, slots: torch.Tensor,
                waiter: LayerWaiter | None = None, request_id: str | None = None) -> torch.Tensor:
        """Compute positions `start .. len(tokens) - 1` of `tokens` (their K/V into `slots[start:]`,
        attention over `slots`, one slot per position) and return the last position's logits,
        `[vocab]` float32 on CPU. `request_id`: the request they are (its reads checked, `PoolCache`)."""
        cache = PoolCache(self.cache.kv, tokens, start, slots, waiter, self.observer, request_id)
        ids = torch.tensor([list(tokens[start:])], dtype=torch.int64, device=self.device)
        positions = torch.arange(start, len(tokens), device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu()

    def forward(self, steps: Iterable[Any], waiter: LayerWaiter | None) -> dict[str, int]:
        """A tick of the reference scheduler: each `ForwardStep` computed; the greedy next token
        of each request whose step reached the end of its sequence."""
        out = {}
        for st in steps:
            end = st.start + st.count
            logits = self.compute(st.tokens[:end], st.start, st.slots, waiter, st.request_id)
            if end == len(st.tokens):
                out[st.request_id] = int(logits.argmax())
        return out

    # -- a whole request ------------------------------------------------------------------

    def generate(self, request: Request, max_new_tokens: int) -> Generation:
        """Serve `request` from admission to finish: its storage prefetch first when the cache
        has storage, then prefill of the uncached positions and `max_new_tokens` greedy tokens."""
        if not isinstance(request, Request):
            raise ModelRunnerError(f"generate takes a Request, got {shown(request)}")
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ModelRunnerError(f"max_new_tokens must be an int >= 1, got {shown(max_new_tokens)}")
        rid = request_id(request.request_id)
        prompt = numpy.frombuffer(token_bytes(request.tokens, "tokens of request", rid), dtype=numpy.int64).tolist()
        if not prompt:
            raise ModelRunnerError(f"request {rid!r} has an empty prompt: give at least one token")
        vocab, top = self.model.config.get_text_config(decoder=True).vocab_size, max(prompt)
        if top >= vocab:
            raise ModelRunnerError(f"request {rid!r}: token id {top} is outside the model's vocabulary "
                                   f"(0..{vocab - 1})")
        began = self._clock()
        self._prefetch(request, prompt)
        admitted, slots, logits = self._prefill(request, prompt)
        ttft = self._clock() - began
        tokens, rows = self._decode(request.request_id, prompt, slots, admitted.cached_tokens, logits, max_new_tokens)
        return Generation(request.request_id, len(prompt), tuple(tokens), torch.stack(rows), admitted, ttft,
                          self._clock() - began)

    def _prefetch(self, request: Request, prompt: list[int]) -> None:
        hc = self.cache
        if hc.config.storage is StorageKind.NONE:
            return
        rid = request.request_id
        if not hc.prefetch([Request(rid, prompt[:-1], request.namespace)])[rid]:
            return
        deadline = self._clock() + PREFETCH_WAIT_MAX_S
        while not hc.ready([rid]):
            if self._clock() > deadline:
                hc.abort([rid])
                raise ModelRunnerError(f"request {rid!r}: its storage prefetch was not ready after "
                                       f"{PREFETCH_WAIT_MAX_S}s (prefetch_policy={hc.config.prefetch_policy.value})")
            self._sleep(PREFETCH_POLL_S)

    def _prefill(self, request: Request, prompt: list[int]) -> tuple[AdmitResult, torch.Tensor, torch.Tensor]:
        """Admit, allocate and compute the uncached positions; admitted again when a load-back
        failed (the tree dropped what did not load)."""
        hc, rid = self.cache, request.request_id
        for attempt in range(1, LOAD_ATTEMPTS_MAX + 1):
            [admitted] = hc.admit([Request(rid, prompt[:-1], request.namespace)])
            try:
                waiter = hc.start_loads() if admitted.host_hit else None
                new = self._allocate(rid, {rid: len(prompt) - admitted.cached_tokens})
                slots = torch.cat((admitted.device_indices, new))
                return admitted, slots, self.compute(prompt, admitted.cached_tokens, slots, waiter, rid)
            except LoadFailedError:
                hc.retract([hc.handle(rid)])
                if attempt == LOAD_ATTEMPTS_MAX:
                    raise
            except BaseException:
                _release(hc, rid)
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _decode(self, rid: str, prompt: list[int], slots: torch.Tensor, cached: int, logits: torch.Tensor,
                max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        hc = self.cache
        try:
            seq, written = list(prompt), prompt[cached:]
            tokens, rows = [int(logits.argmax())], [logits]
            while len(tokens) < max_new_tokens:
                new = self._allocate(rid, {rid: 1}, commit={rid: written})
                slots = torch.cat((slots, new))
                seq.append(tokens[-1])
                written = [tokens[-1]]
                rows.append(self.compute(seq, len(seq) - 1, slots, request_id=rid))
                tokens.append(int(rows[-1].argmax()))
            hc.commit({rid: written})
            hc.finish([hc.handle(rid)])
            return tokens, rows
        except BaseException:
            _release(hc, rid)
            raise

    def _allocate(self, rid: str, demand: dict[str, int], commit: dict[str, list[int]] | None = None) -> torch.Tensor:
        got = self.cache.allocate(demand, commit=commit)
        if isinstance(got, Insufficient):
            raise ModelRunnerError(f"request {rid!r}: the device pool is {got.shortfall_slots} slots short even after "
                                   "eviction; give the cache more device memory or serve shorter requests")
        return got[rid]


def _release(hc: HiCache, rid: str) -> None:
    """End a request cut short by an error (its committed prefix stays cached; nothing leaks)."""
    if rid in hc.live_requests:
        hc.abort([hc.handle(rid)])


def _check_model(model: Any, cache: HiCache) -> None:
    """The model must be a decoder-only LM of attention layers whose K/V shape, dtype and device
    are the pool's."""
    cfg = model.config.get_text_config(decoder=True)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ModelRunnerError("the model is an encoder-decoder; the runner serves decoder-only causal LMs")
    kinds = set(getattr(cfg, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES
    if kinds:
        raise ModelRunnerError(f"the model has {', '.join(sorted(kinds))} layers; the runner serves models whose "
                               "layers are all full or sliding-window attention")
    c = cache.config
    if c.tp_size != 1:
        raise ModelRunnerError(f"the runner serves a whole model on one rank; the cache says tp_size={c.tp_size}")
    shape = model_shape(cfg, 1, c.dtype)
    mine, theirs = (c.layers, c.kv_heads, c.head_dim), (shape.layers, shape.kv_heads, shape.head_dim)
    if mine != theirs:
        raise ModelRunnerError(f"the cache holds (layers, kv_heads, head_dim) = {mine} but the model computes "
                               f"{theirs}: build the config with Config.for_model(model.config, ...)")
    kv = cache.kv
    param = next(model.parameters())
    if param.dtype != kv.dtype:
        raise ModelRunnerError(f"the model computes in {param.dtype} but the cache holds {kv.dtype}: make them "
                               "equal (Config.for_model takes the model's dtype)")
    if param.device != kv.device:
        raise ModelRunnerError(f"the model is on {param.device} but the device pool is on {kv.device}: put them "
                               "on one device (Config.device)")
