"""A seeded randomised workload through the reference scheduler, on both runtimes.

Prompts are built from a small pool of shared blocks so prefixes repeat; the device
pool is small so eviction, load-back and retraction all happen; chunks are short so
prefill is chunked; some requests are aborted. After every tick every actor's
invariants hold, and the fake model checks every cached prefix it reads with the
fingerprint oracle. At the end, with nothing live and nothing in flight: no lock is
held and every device and host slot is accounted for.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from hicache.actors import DeviceCore, SeededFaults
from hicache.messages import HostSlotState
from hicache.runtime import HiCache, Insufficient, WritePolicy
from hicache.runtime._kv_checks import LiveSlots
from hicache.runtime.testing._scheduler import FakeModel, ReferenceScheduler, SchedulerConfig, ServeRequest
from hicache.runtime.testing.explore import synthetic_workload

from conftest import make_runtime, small_config


def _serve(runtime_kind: str, seed: int, policy: WritePolicy, **changes: Any) -> dict[str, Any]:
    cfg = small_config(page_size=4, device_pages=32, host_pages=400, write_policy=policy, load_back_min_tokens=4,
                       **changes)
    runtime = make_runtime(runtime_kind, seed=seed)
    with HiCache(cfg, runtime=runtime) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(
            max_running=8, prefill_tokens_per_tick=24, chunk_tokens=8, abort_rate=0.03, seed=seed, lookahead_slots=2,
            device_budget_ratio=4.0,  # over-admit on purpose: decode runs out and retracts
        ))
        sched.submit(synthetic_workload(seed, 40, cfg.page_size, blocks=6, blocks_per_prompt=4, tail_pages=3,
                                        outputs_max=6))
        caches = 0
        original = hc.cache_unfinished

        def counting(handles: Any) -> Any:
            nonlocal caches
            caches += 1
            return original(handles)

        hc.cache_unfinished = counting  # type: ignore[method-assign]
        sched.run(on_tick=lambda s: hc.check_invariants())
        hc.check_invariants()
        stats = hc.statistics()
        outcomes = list(sched.outcomes.values())
        return {"stats": stats, "outcomes": outcomes, "caches": caches, "cfg": cfg,
                "verified": sched.model.verified_tokens, "written": sched.model.written_tokens}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK])
def test_a_randomised_workload_keeps_every_invariant_and_ends_with_nothing_held(
    runtime_kind: str, seed: int, policy: WritePolicy
) -> None:
    _check_served(_serve(runtime_kind, seed, policy))


@pytest.mark.parametrize("seed", [2, 4])
def test_with_pages_held_ahead_too(runtime_kind: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same workload with three pages ahead of each decode step (`ahead_slots=12`): memory
    runs short, so the pages held ahead are given back (trimmed) on the way, and still every
    invariant holds, every cached prefix reads back right and nothing is held at the end."""
    trims: list[int] = []
    real = DeviceCore.trim

    def counted(core: DeviceCore, rids: Any) -> int:
        trims.append(real(core, rids))
        return trims[-1]

    monkeypatch.setattr(DeviceCore, "trim", counted)
    _check_served(_serve(runtime_kind, seed, WritePolicy.WRITE_THROUGH, ahead_slots=12))
    assert sum(trims) > 0, "no page held ahead was given back"


@pytest.mark.parametrize("ahead_slots", [0, 12])
def test_with_kv_writes_checked_every_write_is_into_the_writer_s_own_slots(
    runtime_kind: str, ahead_slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check_kv_writes` on: the fake model's every write (chunked prefills, decode steps, after
    retractions, load-backs and pages held ahead given back) is checked and none is refused."""
    checked: list[int] = []
    real = LiveSlots.writable

    def counted(self: LiveSlots, slots: torch.Tensor) -> int:
        checked.append(len(slots))
        return real(self, slots)

    monkeypatch.setattr(LiveSlots, "writable", counted)
    r = _serve(runtime_kind, 1, WritePolicy.WRITE_THROUGH, check_kv_writes=True, ahead_slots=ahead_slots)
    _check_served(r)
    assert sum(checked) == r["written"] > 0


@pytest.mark.parametrize("ahead_slots", [0, 12])
def test_with_kv_reads_checked_every_cached_prefix_read_is_of_live_and_landed_slots(
    runtime_kind: str, ahead_slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check_kv_reads` on (and `check_kv_writes`): the fake model reads every cached prefix it
    checks through `gather`, layer by layer after each wait (load-backs still landing among
    them), and none is refused."""
    read: list[int] = []
    loading: list[int] = []
    real = LiveSlots.readable

    def counted(self: LiveSlots, slots: torch.Tensor) -> tuple[int, tuple[int, ...]]:
        got = real(self, slots)
        read.append(len(slots))
        loading.append(len(got[1]))
        return got

    monkeypatch.setattr(LiveSlots, "readable", counted)
    r = _serve(runtime_kind, 1, WritePolicy.WRITE_THROUGH, check_kv_writes=True, check_kv_reads=True,
               ahead_slots=ahead_slots)
    _check_served(r)
    assert sum(read) >= r["verified"] > 0
    if runtime_kind == "deterministic":  # on threads a load-back may land before the pass indexes its slots
        assert sum(loading) > 0, "no read was of a prefix still loading back"


def _check_served(r: dict[str, Any]) -> None:
    s, cfg, outcomes = r["stats"], r["cfg"], r["outcomes"]
    # everything ended, one way or the other
    assert all(o.finished or o.aborted for o in outcomes)
    assert any(o.aborted for o in outcomes) and any(o.finished for o in outcomes)
    # the workload exercised what it is meant to
    assert sum(o.retractions for o in outcomes) > 0, "no retraction happened"
    assert r["caches"] > 0, "no chunked prefill was cached"
    assert s.tree.evicted_device_tokens > 0, "no device eviction happened"
    assert s.tree.host_hit_tokens > 0, "no load-back happened"
    assert s.tree.device_hit_tokens > 0 and r["verified"] > 0
    # quiescence: no lock, nothing in flight, slots conserved
    assert s.tree.live_handles == 0 and s.tree.protected_tokens == 0
    assert s.tree.writes_in_flight == 0 and s.tree.loads_in_flight == 0
    assert s.device.request_slots == 0 and s.device.loading_slots == 0 and s.device.live_requests == 0
    assert s.device.free_slots + s.device.tree_slots == cfg.device_slots
    assert s.device.tree_slots == s.tree.device_tokens
    held = cfg.host_slots - s.host.slots_in(HostSlotState.FREE)
    assert held == s.tree.host_tokens
    busy = (HostSlotState.RESERVED, HostSlotState.WRITING, HostSlotState.LOADING, HostSlotState.PREFETCHING)
    assert all(s.host.slots_in(st) == 0 for st in busy)


def test_the_same_seed_serves_the_same_way_on_the_deterministic_runtime() -> None:
    a = _serve("deterministic", 5, WritePolicy.WRITE_THROUGH)
    b = _serve("deterministic", 5, WritePolicy.WRITE_THROUGH)
    assert a["stats"] == b["stats"]
    assert [(o.device_hit, o.host_hit, o.retractions, o.aborted) for o in a["outcomes"]] == \
        [(o.device_hit, o.host_hit, o.retractions, o.aborted) for o in b["outcomes"]]


@pytest.mark.parametrize("seed", [3, 15, 31])
def test_a_failed_load_retracts_the_requests_admitted_with_it_that_had_no_step(seed: int) -> None:
    """A request admitted with a load-back but left without a step (the tick's prefill budget
    went to older requests) holds a prefix from the batch too: when the batch fails it is
    retracted with the others, or it would later read slots the failed load never filled.
    These seeds hit that case (a load fails while such a request waits for budget)."""
    cfg = small_config(page_size=4, device_pages=24, host_pages=64, load_back_min_tokens=4)
    runtime = make_runtime("deterministic", seed=seed,
                           faults=SeededFaults(seed, transfer_fail_rate=0.3, host_exhausted_rate=0.0))
    with HiCache(cfg, runtime=runtime) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, prefill_tokens_per_tick=16, chunk_tokens=8,
                                                       seed=seed, device_budget_ratio=2.0))
        sched.submit(synthetic_workload(seed, 24, cfg.page_size, blocks=6, blocks_per_prompt=4, tail_pages=2))
        sched.run(on_tick=lambda s: hc.check_invariants())  # the oracle checks every cached prefix read
        assert sched.load_failures > 0
        assert all(o.finished for o in sched.outcomes.values())


def test_a_fake_model_without_kv_serves_the_same_hits_and_writes_no_kv() -> None:
    """The demo's comparison runs serve with `kv=False`: the same decisions, no KV written or checked."""
    def serve(kv: bool) -> tuple[list[Any], FakeModel, bool]:
        cfg = small_config(page_size=4, device_pages=32, host_pages=400, load_back_min_tokens=4)
        with HiCache(cfg, runtime=make_runtime("deterministic", seed=3)) as hc:
            model = FakeModel(hc, kv=kv)
            sched = ReferenceScheduler(hc, SchedulerConfig(max_running=4, prefill_tokens_per_tick=24, chunk_tokens=8,
                                                           seed=3), model=model)
            sched.submit(synthetic_workload(3, 30, cfg.page_size, blocks=6, blocks_per_prompt=4, tail_pages=3,
                                            outputs_max=4))
            sched.run(on_tick=lambda s: hc.check_invariants())
            written = bool(hc.device_kv.tensor.any())
            return [(o.device_hit, o.host_hit, o.computed_prompt_tokens) for o in sched.outcomes.values()], model, written

    with_kv, model_kv, written_kv = serve(True)
    without, model, written = serve(False)
    assert without == with_kv and any(hit for hit, _, _ in with_kv)
    assert model_kv.verified_tokens > 0 and written_kv
    assert model.verified_tokens == model.written_tokens == 0 and not written


@pytest.mark.parametrize("pending", [True, False], ids=["writes-in-flight", "nothing-in-flight"])
def test_a_lone_step_short_of_memory_waits_for_writes_in_flight_and_fails_only_without_them(pending: bool) -> None:
    """With several ranks an eviction answers without waiting for write-backs; memory they will
    free on a later tick is worth waiting for, a pool that cannot hold the step is an error."""
    cfg = small_config(page_size=4, device_pages=32, host_pages=400)
    with HiCache(cfg, runtime=make_runtime("deterministic", seed=1)) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=1, prefill_tokens_per_tick=24, chunk_tokens=8))
        sched.submit(synthetic_workload(1, 1, cfg.page_size, blocks=2, blocks_per_prompt=2, tail_pages=1,
                                        outputs_max=2))
        real_allocate, real_statistics = hc.allocate, hc.statistics
        refusals = [2]  # the first two allocations find the pool short

        def allocate(demands: Any, *, commit: Any = None) -> Any:
            if refusals[0]:
                refusals[0] -= 1
                real_allocate({}, commit=commit)  # the commit holds, as in a refused allocation
                return Insufficient(requested_slots=sum(demands.values()), free_slots=0)
            return real_allocate(demands, commit=commit)

        def statistics() -> Any:
            s = real_statistics()
            return replace(s, tree=replace(s.tree, writes_in_flight=1)) if pending else s

        hc.allocate, hc.statistics = allocate, statistics  # type: ignore[method-assign]
        if not pending:
            with pytest.raises(RuntimeError, match="cannot hold one step"):
                sched.run()
            return
        sched.run(on_tick=lambda s: hc.check_invariants())
        [outcome] = sched.outcomes.values()
        assert outcome.finished and outcome.retractions == 0 and refusals == [0]


@pytest.mark.parametrize("lookahead", [0, 3])
def test_a_request_that_fills_the_device_at_its_last_step_is_served_and_one_token_more_is_refused(
        lookahead: int) -> None:
    """A request's last step holds its prompt, all but its last output and the slots ahead: one
    that needs every device slot then is served; one that needs a slot more is refused at
    `submit`, with the rest of its batch, instead of being admitted and retracted forever."""
    cfg = small_config(page_size=4, device_pages=8, host_pages=64)
    outputs = 4
    longest = cfg.device_slots - outputs + 1 - lookahead
    with HiCache(cfg) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=2, prefill_tokens_per_tick=8, chunk_tokens=8,
                                                       lookahead_slots=lookahead))
        too_long = ServeRequest("too-long", torch.arange(1, longest + 2), outputs)
        with pytest.raises(ValueError, match=r"'too-long' needs 33 device slots .* device_slots is 32: raise"):
            sched.submit([ServeRequest("short", torch.arange(1, 5), 1), too_long])
        assert not sched.waiting and not sched.outcomes
        sched.submit([ServeRequest("fits", torch.arange(1, longest + 1), outputs)])
        sched.run(on_tick=lambda s: hc.check_invariants())
        [outcome] = sched.outcomes.values()
        assert outcome.finished and outcome.retractions == 0 and len(outcome.output_tokens) == outputs


def test_a_lone_request_the_pool_cannot_hold_fails_though_others_wait() -> None:
    """Retracting the only running request frees nothing it could use: it would be admitted
    again, alone, at the next tick. With others waiting behind it, that is still an error,
    not a loop."""
    cfg = small_config(page_size=4, device_pages=32, host_pages=400)
    with HiCache(cfg) as hc:
        sched = ReferenceScheduler(hc, SchedulerConfig(max_running=1, prefill_tokens_per_tick=24, chunk_tokens=8))
        sched.submit(synthetic_workload(1, 3, cfg.page_size, blocks=2, blocks_per_prompt=2, tail_pages=1,
                                        outputs_max=2))
        real_allocate = hc.allocate

        def allocate(demands: Any, *, commit: Any = None) -> Any:  # the pool is always short
            real_allocate({}, commit=commit)
            return Insufficient(requested_slots=sum(demands.values()), free_slots=0)

        hc.allocate = allocate  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="cannot hold one step"):
            sched.run(max_ticks=200)
        assert len(sched.waiting) == 2
