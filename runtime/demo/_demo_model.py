"""`hicache demo --model tiny|PATH`: a real transformer through L1, L2 and L3, its TTFT measured per tier.

Conversations share a system prompt; each turn adds user tokens and the model answers
greedily (`ModelRunner`), the conversations' turns interleaved. A first instance (a
small L1, L2 eight times larger, L3 in a temporary directory) serves the first turns:
the first turn of each conversation finds only the system prompt (in L1), later turns
find their history in L1 or, once it was evicted, in L2. A second instance on the same
storage, its L1 and L2 empty, serves one more turn of every conversation: the history
comes from L3 (prefetched into L2, then loaded back).

Each request is put in the tier that served its prefix (the lowest one that
contributed), and for each tier the demo prints the measured time to first token
(prefetch wait, admission, load-back and prefill of the uncached tokens), the time
to first token of the same prompts recomputed without a cache (a plain full forward),
and the modelled one: `CostModel` with the prefill rate measured on the recomputed
prompts and this model's KV bytes per token. It also prints how far the cached first
logits are from the uncached ones.

`tiny` is the small random Llama of the tests, on CPU; a PATH is a local transformers
model directory (weights read from disk, nothing downloaded), on CUDA when there is
one; token ids are drawn at random from its vocabulary.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from hicache.messages.config import Config

from ._demo import CostModel
from .._facade import HiCache, Request
from ._model_runner import Generation, ModelRunner
from ._tiny_model import tiny_llama
from .._usage import UsageError

TIERS = ("none", "L1", "L2", "L3")


@dataclass(frozen=True, slots=True)
class Workload:
    system_tokens: int = 256
    user_tokens: int = 128
    answer_tokens: int = 16
    conversations: int = 8
    first_turns: int = 4
    """Turns the first instance serves; the second serves one more."""
    device_tokens: int = 2048
    """L1 holds about two conversations at their longest: the others are evicted to L2."""
    page_size: int = 16


@dataclass(frozen=True, slots=True)
class _Served:
    tier: str
    prompt: int
    cached: int
    host: int
    storage: int
    ttft_s: float
    recompute_s: float
    logit_gap: float
    same_first_token: bool


def run_model_demo(model_arg: str, as_json: bool = False, cost: CostModel | None = None,
                   work: Workload = Workload()) -> int:
    model, name = _load(model_arg)
    device = next(model.parameters()).device
    with tempfile.TemporaryDirectory(prefix="hicache-demo-model-l3-") as tmp:
        cfg = _config(model, device, tmp, work, TINY_MODEL_ID if model_arg == "tiny" else None)
        _warm_up(model, cfg, work)
        history: dict[int, list[int]] = {}
        with HiCache(cfg) as hc:
            served = _serve(ModelRunner(model, hc), history, range(work.first_turns), work)
            hc.quiesce()
        with HiCache(cfg) as hc:
            served += _serve(ModelRunner(model, hc), history, range(work.first_turns, work.first_turns + 1), work)
    rate = sum(s.prompt for s in served) / sum(s.recompute_s for s in served)
    base = cost or CostModel()
    cost = CostModel(prefill_tokens_per_s=rate, l2_gbps=base.l2_gbps, l3_gbps=base.l3_gbps,
                     kv_bytes_per_token=cfg.bytes_per_slot)
    figures = _figures(name, str(device), cfg, served, cost)
    if as_json:
        print(json.dumps(figures))
    else:
        _table(figures)
    return 0 if figures["first_tokens_equal"] == figures["requests"] else 1


TINY_MODEL_ID = "hicache-demo-tiny-llama"
"""The model id of `tiny` (a Llama built in code names no model): what its storage keys name.
A local directory's model is named by its path (`Config.for_model`)."""


def _load(arg: str) -> tuple[Any, str]:
    if arg == "tiny":
        return tiny_llama(seed=0), "tiny (random Llama, float32)"
    path = Path(arg)
    if not (path / "config.json").is_file():
        raise UsageError(f"--model takes 'tiny' or a local transformers model directory (with a config.json); "
                         f"{arg!r} is neither")
    from transformers import AutoModelForCausalLM

    on_gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto" if on_gpu else torch.float32)
    return model.to("cuda" if on_gpu else "cpu").eval(), str(path)


def _config(model: Any, device: torch.device, storage_dir: str, work: Workload, model_id: str | None) -> Config:
    dtype = next(model.parameters()).dtype
    fields: dict[str, Any] = {"page_size": work.page_size, "dtype": dtype, "device": device.type, "storage": "file",
                              "storage_dir": storage_dir, "prefetch_policy": "wait_complete",
                              "prefetch_threshold_pages": 1}
    if model_id is not None:  # else the model config's name
        fields["model_id"] = model_id
    per_slot = Config.for_model(model.config, device_bytes=1 << 30, host_ratio=2, check=False, **fields).bytes_per_slot
    return Config.for_model(model.config, device_bytes=work.device_tokens * per_slot, host_ratio=8, **fields)


def _warm_up(model: Any, cfg: Config, work: Workload) -> None:
    """A request through a throwaway cache (its own storage) first, so that the first measured
    one does not pay for first calls: allocations, the storage backend's first files."""
    with tempfile.TemporaryDirectory(prefix="hicache-demo-model-warm-up-") as tmp, \
            HiCache(cfg.replace(storage_dir=tmp)) as hc:
        ModelRunner(model, hc).generate(Request("warm-up", _tokens(model, -1, work.system_tokens)), 2)


def _tokens(model: Any, key: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(key % 2**63)
    return torch.randint(0, model.config.get_text_config().vocab_size, (n,), generator=gen).tolist()


def _serve(runner: ModelRunner, history: dict[int, list[int]], turns: range, work: Workload) -> list[_Served]:
    out = []
    for turn in turns:
        for c in range(work.conversations):
            user = _tokens(runner.model, 1 + 100 * c + turn, work.user_tokens)
            prompt = history.get(c, _tokens(runner.model, 0, work.system_tokens)) + user
            g = runner.generate(Request(f"c{c}-t{turn}", prompt), work.answer_tokens)
            out.append(_measure(runner, prompt, g))
            history[c] = prompt + list(g.tokens)
    return out


def _measure(runner: ModelRunner, prompt: list[int], g: Generation) -> _Served:
    """The request's figures, and the same prompt recomputed without a cache."""
    ids = torch.tensor([prompt], device=runner.device)
    with torch.inference_mode():
        _sync(runner.device)
        began = time.perf_counter()
        logits = runner.model(ids, logits_to_keep=1).logits[0, -1].float().cpu()
        _sync(runner.device)
        recompute = time.perf_counter() - began
    a = g.admitted
    tier = "L3" if a.storage_hit else "L2" if a.host_hit else "L1" if a.device_hit else "none"
    return _Served(tier, len(prompt), a.cached_tokens, a.host_hit, a.storage_hit, g.ttft_s, recompute,
                   float((logits - g.logits[0]).abs().max()), int(logits.argmax()) == g.tokens[0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _figures(name: str, device: str, cfg: Config, served: list[_Served], cost: CostModel) -> dict[str, Any]:
    tiers = {}
    for tier in TIERS:
        group = [s for s in served if s.tier == tier]
        if not group:
            continue
        modelled = [cost.ttft_s(s.prompt - s.cached, s.host, s.storage) for s in group]
        tiers[tier] = {
            "requests": len(group),
            "prompt_tokens_mean": round(statistics.fmean(s.prompt for s in group), 1),
            "cached_tokens_mean": round(statistics.fmean(s.cached for s in group), 1),
            "ttft_p50_s": round(statistics.median(s.ttft_s for s in group), 5),
            "recompute_ttft_p50_s": round(statistics.median(s.recompute_s for s in group), 5),
            "modelled_ttft_p50_s": round(statistics.median(modelled), 5),
        }
    return {
        "model": name, "device": device, "layers": cfg.layers, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "dtype": cfg.dtype, "device_slots": cfg.device_slots, "host_slots": cfg.host_slots,
        "requests": len(served), "tiers": tiers,
        "max_first_logit_gap": max(s.logit_gap for s in served),
        "first_tokens_equal": sum(s.same_first_token for s in served),
        "cost_model": asdict(cost),
    }


def _table(f: dict[str, Any]) -> None:
    t = Table(title=f"hicache demo --model: {f['model']} on {f['device']} through L1, L2 and L3 (TTFT p50)")
    for col in ("prefix from", "requests", "prompt", "cached", "measured", "recomputed", "modelled"):
        t.add_column(col, justify="left" if col == "prefix from" else "right")
    for tier, x in f["tiers"].items():
        t.add_row(tier, str(x["requests"]), f"{x['prompt_tokens_mean']:,.0f}", f"{x['cached_tokens_mean']:,.0f}",
                  f"{x['ttft_p50_s'] * 1e3:.1f} ms", f"{x['recompute_ttft_p50_s'] * 1e3:.1f} ms",
                  f"{x['modelled_ttft_p50_s'] * 1e3:.1f} ms")
    console = Console()
    console.print(t)
    c = f["cost_model"]
    console.print(
        f"Prefix from: the lowest tier that supplied a request's cached prefix (none: nothing cached). "
        f"Prompt, cached: mean tokens. Measured: from the call to the first token (prefetch wait, admission, load-back, prefill of the uncached "
        f"tokens). Recomputed: the same prompt through the model without a cache. Modelled: recomputed tokens at "
        f"{c['prefill_tokens_per_s']:,.0f} tokens/s (measured here) + L2 hits at {c['l2_gbps']} GB/s + L3 hits at "
        f"{c['l3_gbps']} GB/s then as L2, x {c['kv_bytes_per_token']:,} B/token. First tokens equal to the "
        f"uncached forward's: {f['first_tokens_equal']} of {f['requests']}; largest first-logit gap "
        f"{f['max_first_logit_gap']:.2e}. L1 {f['device_slots']:,} slots, L2 {f['host_slots']:,} slots."
    )
