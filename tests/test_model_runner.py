"""A real transformer through every tier: a small random Llama serves interleaved multi-turn
conversations over the cache, and every turn is checked three ways:

- its logits match a no-cache full forward of the whole sequence within `LOGIT_TOLERANCE`;
- its greedy tokens are the full forward's argmax at every step (so a no-cache greedy
  decode of the same prompt yields the same tokens);
- every K and V that attention reads, at every layer, is bitwise one that was written for
  that exact prefix (`KVRecord`, the runner's observer), whichever tier supplied it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from hicache.runtime import (
    Config,
    HiCache,
    HostLayout,
    PrefetchPolicy,
    Request,
    RequestError,
    StorageKind,
    ThreadedRuntime,
    WritePolicy,
)
from hicache.runtime.demo import Generation, ModelRunner, ModelRunnerError, tiny_llama
from hicache.runtime.demo._tiny_model import TINY_SHAPE, incremental_drift
from hicache.runtime.testing import ReferenceScheduler, SchedulerConfig, ServeRequest

from conftest import FailFirstLoads

LOGIT_TOLERANCE = 1e-4
"""Largest |logit| difference allowed from a no-cache full forward: about 7x the worst drift of
transformers' own incremental decode from its full forward on the tiny model (1.3e-5 over 20
seeds, logits up to 5.7; `python -m hicache.runtime.demo._tiny_model`, docs/engine.md). The bitwise
K/V check, not this tolerance, is what catches misplaced KV: attention does not depend on the
order of keys once rotary embeddings are applied, so two positions swapped together barely move
the logits."""

PAGE = 4
SYSTEM = 12
"""Tokens of the system prompt every conversation starts with."""
USER = 10
"""Tokens of each user turn."""
NEW = 4
"""Greedy tokens of each answer."""


def _prefix_keys(tokens: Sequence[int]) -> list[int]:
    """One key per position, chained over every token up to it: equal keys, equal prefixes."""
    keys, key = [], 0
    for t in tokens:
        key = hash((key, t))
        keys.append(key)
    return keys


class KVRecord:
    """Every K/V the runner wrote, per layer and exact prefix; every K/V attention reads is
    checked bitwise against them. A prefix computed twice may give other bits (another chunk
    shape); each distinct version is kept, and a read must be one of them."""

    def __init__(self) -> None:
        self.versions: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.cached_reads = 0
        """Position-layers read that this pass did not compute (the cache supplied them)."""
        self._start: dict[int, int] = {}

    def wrote(self, layer: int, tokens: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        keys = _prefix_keys(tokens)
        for i in range(start, len(tokens)):
            kv = (k[i - start].cpu().clone(), v[i - start].cpu().clone())
            seen = self.versions.setdefault((layer, keys[i]), [])
            if not any(torch.equal(kv[0], a) and torch.equal(kv[1], b) for a, b in seen):
                seen.append(kv)
        self._start[layer] = start

    def read(self, layer: int, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.cpu(), v.cpu()
        for i, key in enumerate(_prefix_keys(tokens)):
            seen = self.versions.get((layer, key))
            assert seen, f"layer {layer} position {i}: attention read K/V that was never written for this prefix"
            if not any(torch.equal(k[i], a) and torch.equal(v[i], b) for a, b in seen):
                raise AssertionError(f"layer {layer} position {i}: the K/V attention read differs from every "
                                     f"K/V written for this prefix ({len(seen)} versions)")
        self.cached_reads += self._start[layer]


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama(seed=0)


def _config(model: Any, device_slots: int, host_slots: int = 1024, **fields: Any) -> Config:
    per_slot = Config.for_model(model.config, device_bytes=1 << 20, host_ratio=2, page_size=PAGE).bytes_per_slot
    return Config.for_model(model.config, device_bytes=device_slots * per_slot, host_bytes=host_slots * per_slot,
                            page_size=PAGE, **fields)


def _user(conv: int, turn: int, n: int = USER) -> list[int]:
    gen = torch.Generator().manual_seed(1000 * conv + turn + 1)
    return torch.randint(0, TINY_SHAPE["vocab_size"], (n,), generator=gen).tolist()


def _check_against_full_forward(model: Any, prompt: list[int], g: Generation) -> None:
    """Logits within tolerance of the full forward at each step, and its greedy choices."""
    seq = prompt + list(g.tokens[:-1])
    with torch.inference_mode():
        full = model(torch.tensor([seq], device=model.device)).logits[0, len(prompt) - 1 :].float().cpu()
    gap = float((full - g.logits).abs().max())
    assert gap <= LOGIT_TOLERANCE, f"{g.request_id}: logits differ from the full forward by {gap}"
    assert full.argmax(-1).tolist() == list(g.tokens), f"{g.request_id}: greedy tokens differ from the full forward"


def converse(runner: ModelRunner, model: Any, history: dict[int, list[int]], turns: range,
             conversations: int = 3) -> list[Generation]:
    """Serve `turns` of each conversation, interleaved (turn by turn), checking every turn."""
    out = []
    for turn in turns:
        for c in range(conversations):
            prompt = history.get(c, _user(99, 0, SYSTEM)) + _user(c, turn)
            g = runner.generate(Request(f"c{c}-t{turn}", prompt), NEW)
            _check_against_full_forward(model, prompt, g)
            runner.cache.check_invariants()
            history[c] = prompt + list(g.tokens)
            out.append(g)
    return out


def _hits(gens: list[Generation]) -> tuple[int, int, int]:
    """Tokens served from L1, from L2 (loaded back) and from L3 (prefetched, then loaded back)."""
    device = sum(g.admitted.device_hit for g in gens)
    storage = sum(g.admitted.storage_hit for g in gens)
    return device, sum(g.admitted.host_hit for g in gens) - storage, storage


# -- the tolerance ------------------------------------------------------------------------------


def test_transformers_own_incremental_decode_stays_well_within_the_tolerance() -> None:
    for seed in range(3):
        tokens = torch.randint(0, TINY_SHAPE["vocab_size"], (96,), generator=torch.Generator().manual_seed(seed))
        assert incremental_drift(tiny_llama(seed), tokens.tolist(), 48) <= LOGIT_TOLERANCE / 4


# -- tiers --------------------------------------------------------------------------------------


def test_conversations_hit_in_device_memory_and_match_the_full_forward(model: Any) -> None:
    record = KVRecord()
    with HiCache(_config(model, device_slots=512)) as hc:
        gens = converse(ModelRunner(model, hc, observer=record), model, {}, range(3))
        device, host, storage = _hits(gens)
    assert gens[0].admitted.cached_tokens == 0
    assert all(g.admitted.cached_tokens >= SYSTEM - SYSTEM % PAGE for g in gens[1:])  # the shared system prompt
    assert all(g.admitted.cached_tokens > SYSTEM for g in gens[3:])  # the conversation so far
    assert device > 0 and (host, storage) == (0, 0)
    assert record.cached_reads >= device * TINY_SHAPE["num_hidden_layers"]


@pytest.mark.parametrize("layout", list(HostLayout))
@pytest.mark.parametrize("policy", list(WritePolicy))
def test_a_small_device_memory_loads_prefixes_back_from_host_memory(
    model: Any, policy: WritePolicy, layout: HostLayout
) -> None:
    record = KVRecord()
    cfg = _config(model, device_slots=96, write_policy=policy, host_layout=layout)
    with HiCache(cfg) as hc:
        gens = converse(ModelRunner(model, hc, observer=record), model, {}, range(4))
        device, host, storage = _hits(gens)
    assert host > 0 and storage == 0, f"{policy.value}: no prefix came back from host memory"
    assert record.cached_reads >= (device + host) * TINY_SHAPE["num_hidden_layers"]


@pytest.mark.parametrize("layout", list(HostLayout))
def test_a_second_instance_prefetches_the_conversations_from_storage(
    model: Any, layout: HostLayout, tmp_path: Any
) -> None:
    record = KVRecord()
    cfg = _config(model, device_slots=256, host_layout=layout, storage=StorageKind.FILE, storage_dir=str(tmp_path),
                  prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold_pages=1)
    history: dict[int, list[int]] = {}
    with HiCache(cfg) as hc:
        converse(ModelRunner(model, hc, observer=record), model, history, range(2))
        hc.quiesce()  # the backups to storage have landed
    with HiCache(cfg) as hc:  # empty L1 and L2, the same storage
        gens = converse(ModelRunner(model, hc, observer=record), model, history, range(2, 3))
        device, host, storage = _hits(gens)
    assert gens[0].admitted.storage_hit > 0, "the first request of the second instance found nothing in storage"
    assert storage > 0 and record.cached_reads >= storage * TINY_SHAPE["num_hidden_layers"]


def test_the_reference_scheduler_runs_the_model_with_chunked_prefill_and_load_backs(model: Any) -> None:
    record = KVRecord()
    history: dict[int, list[int]] = {}
    hits = [0, 0]
    # Every write into its own slots, every read of live slots whose load-back landed.
    with HiCache(_config(model, device_slots=128, check_kv_writes=True, check_kv_reads=True)) as hc:
        runner = ModelRunner(model, hc, observer=record)
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=3, prefill_tokens_per_tick=16, chunk_tokens=8,
                                                       device_budget_ratio=2.0), model=runner)
        for turn in range(4):
            prompts = {f"c{c}-t{turn}": history.get(c, _user(99, 0, SYSTEM)) + _user(c, turn) for c in range(3)}
            sched.submit(ServeRequest(rid, torch.tensor(p), NEW) for rid, p in prompts.items())
            sched.run(on_tick=lambda s: hc.check_invariants())
            for c, (rid, prompt) in enumerate(prompts.items()):
                out = sched.outcomes[rid]
                hits[0] += out.device_hit
                hits[1] += out.host_hit
                seq = prompt + out.output_tokens[:-1]
                with torch.inference_mode():
                    full = model(torch.tensor([seq])).logits[0, len(prompt) - 1 :]
                assert full.argmax(-1).tolist() == out.output_tokens, f"{rid}: greedy tokens differ"
                history[c] = prompt + out.output_tokens
    assert hits[0] > 0 and hits[1] > 0
    assert record.cached_reads > 0


class _WaitsBeforeReads(KVRecord):
    """A `KVRecord` that also holds every read of a layer to a wait on that layer's load-back
    (since the last `start_loads`), through the waiter it hands out."""

    def __init__(self, hc: HiCache) -> None:
        super().__init__()
        self.waited: set[int] | None = None
        self.reads_after_loads = 0
        start_loads = hc.start_loads

        def recording() -> Any:
            real = start_loads()
            self.waited = set()
            log = self.waited

            class Waiter:
                def wait_layer(self, layer: int, timeout_s: float | None = None) -> None:
                    real.wait_layer(layer, timeout_s)
                    log.add(layer)

            return Waiter()

        hc.start_loads = recording  # type: ignore[method-assign]

    def read(self, layer: int, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        if self.waited is not None:
            assert layer in self.waited, f"attention read layer {layer} before waiting for its load-back"
            self.reads_after_loads += 1
        super().read(layer, tokens, k, v)


def test_each_layer_waits_for_its_load_back_before_attention_reads_it(model: Any) -> None:
    with HiCache(_config(model, device_slots=96)) as hc:
        record = _WaitsBeforeReads(hc)
        gens = converse(ModelRunner(model, hc, observer=record), model, {}, range(4))
    assert _hits(gens)[1] > 0 and record.reads_after_loads > 0


def test_a_failed_load_back_is_recomputed_and_the_answer_is_unchanged(model: Any) -> None:
    record = KVRecord()
    faults = FailFirstLoads(1)
    with HiCache(_config(model, device_slots=96), runtime=ThreadedRuntime(faults=faults)) as hc:
        gens = converse(ModelRunner(model, hc, observer=record), model, {}, range(4))
        assert faults.left == 0, "no load-back was attempted"
        hc.check_invariants()
    assert _hits(gens)[1] > 0


# -- refusals -----------------------------------------------------------------------------------


def test_a_cache_of_another_shape_or_dtype_is_refused_in_one_line(model: Any) -> None:
    with HiCache(_config(model, device_slots=64).replace(kv_heads=4)) as hc:
        with pytest.raises(ModelRunnerError, match=r"^the cache holds \(layers, kv_heads, head_dim\) = \(3, 4, 16\) "
                                                   r"but the model computes \(3, 2, 16\): build the config with "):
            ModelRunner(model, hc)
    with HiCache(_config(model, device_slots=64, dtype="bfloat16")) as hc:
        with pytest.raises(ModelRunnerError, match=r"^the model computes in torch.float32 but the cache holds "
                                                   r"torch.bfloat16: make them equal"):
            ModelRunner(model, hc)


def test_bad_generate_arguments_are_refused_and_the_cache_serves_on(model: Any) -> None:
    with HiCache(_config(model, device_slots=64)) as hc:
        runner = ModelRunner(model, hc)
        with pytest.raises(ModelRunnerError, match=r"^max_new_tokens must be an int >= 1, got 0$"):
            runner.generate(Request("r", [1, 2, 3]), 0)
        with pytest.raises(ModelRunnerError, match=r"^request 'r' has an empty prompt"):
            runner.generate(Request("r", []), 2)
        with pytest.raises(ModelRunnerError, match=r"^request 'long': the device pool is \d+ slots short"):
            runner.generate(Request("long", list(range(100))), 2)
        vocab = model.config.vocab_size
        with pytest.raises(ModelRunnerError, match=rf"^request 'v': token id {vocab} is outside the model's "
                                                   rf"vocabulary \(0\.\.{vocab - 1}\)$"):
            runner.generate(Request("v", [1, vocab]), 2)  # an embedding's IndexError before
        with pytest.raises(ModelRunnerError, match=r"^generate takes a Request, got 'r'$"):
            runner.generate("r", 2)  # type: ignore[arg-type]
        with pytest.raises(RequestError, match=r"must be int token ids, got 1\.5 \(float\)"):
            runner.generate(Request("f", [1, 1.5]), 2)  # type: ignore[list-item]  # was truncated to 1
        assert hc.live_requests == ()
        hc.check_invariants()
        prompt = _user(0, 0, 20)
        _check_against_full_forward(model, prompt, runner.generate(Request("r", prompt), 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is absent on this machine")
def test_conversations_on_cuda_load_back_and_match_the_full_forward() -> None:
    model = tiny_llama(seed=0).cuda()
    record = KVRecord()
    with HiCache(_config(model, device_slots=96, device="cuda")) as hc:
        assert hc.kv.device.type == "cuda"
        gens = converse(ModelRunner(model, hc, observer=record), model, {}, range(4))
    assert _hits(gens)[1] > 0 and record.cached_reads > 0
