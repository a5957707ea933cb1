"""A small random-initialised Llama: the model of the tests and of `hicache demo --model tiny`.

Nothing is downloaded: the weights come from a seeded generator, in float32, with
grouped-query attention (two query heads per KV head). The initialiser's spread is
wider than transformers' default so that attention depends on which keys it reads
(with the default, every position weighs nearly the same, and misplaced KV would
hardly show in the logits).

`python -m hicache.runtime.demo._tiny_model` measures how far transformers' own
incremental decode (its `DynamicCache`) drifts from its full forward on this model:
the figure that the model tests' logit tolerance rests on (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import torch

TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 8192,
    "initializer_range": 0.15,
}
"""The tiny model's transformers `LlamaConfig` fields."""


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **changes: Any) -> Any:
    """A `LlamaForCausalLM` of `TINY_SHAPE` (with `changes`), weights drawn from `seed`, in eval mode.
    The global torch generator is left as it was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_SHAPE, **changes}, dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def incremental_drift(model: Any, tokens: Sequence[int], prefill: int) -> float:
    """Largest |logit| difference between transformers' full forward of `tokens` and its own
    incremental decode (prefill of `tokens[:prefill]`, then one token per step, `DynamicCache`)."""
    from transformers import DynamicCache

    ids = torch.tensor([list(tokens)], device=model.device)
    with torch.inference_mode():
        full = model(ids).logits[0, prefill - 1 :]
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :prefill], cache=cache, use_cache=True).logits[0, -1:]]
        for i in range(prefill, len(tokens)):
            steps.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits[0, -1:])
    return float((torch.cat(steps)[: len(full)] - full).abs().max())


def measure_drift(seeds: int = 20, length: int = 96, prefill: int = 48) -> dict[str, float]:
    """`incremental_drift` over `seeds` tiny models and random sequences; the maximum and the logit scale."""
    worst = scale = 0.0
    for seed in range(seeds):
        model = tiny_llama(seed)
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, TINY_SHAPE["vocab_size"], (length,), generator=gen).tolist()
        worst = max(worst, incremental_drift(model, tokens, prefill))
        with torch.inference_mode():
            scale = max(scale, float(model(torch.tensor([tokens])).logits.abs().max()))
    return {"seeds": seeds, "length": length, "prefill": prefill, "max_abs_logit_drift": worst,
            "max_abs_logit": scale}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="transformers' incremental decode vs its full forward, tiny model")
    p.add_argument("--seeds", type=int, default=20)
    args = p.parse_args(argv)
    print(json.dumps(measure_drift(args.seeds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
