"""`hicache demo --model`: a real transformer through L1, L2 and L3, TTFT measured per tier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache.runtime.cli import main
from hicache.runtime.demo import tiny_llama
from hicache.runtime.demo._demo_model import Workload, run_model_demo
from hicache.runtime.testing import capture_logs

SMALL = Workload(system_tokens=32, user_tokens=16, answer_tokens=4, conversations=4, first_turns=3,
                 device_tokens=128, page_size=4)
"""Four conversations of up to 112 tokens against an L1 of 128: some histories are evicted to L2."""


def _figures(model: str, capsys: Any) -> dict[str, Any]:
    assert run_model_demo(model, as_json=True, work=SMALL) == 0
    return json.loads(capsys.readouterr().out)


def test_the_tiny_model_is_served_from_every_tier_with_measured_and_modelled_ttft(capsys: Any) -> None:
    with capture_logs() as logs:
        f = _figures("tiny", capsys)
    # the demo names its model: no warning that its storage keys name none, once per instance
    assert not [e for e in logs if e["event"].startswith("storage keys name no model")], logs
    tiers = f["tiers"]
    assert set(tiers) == {"none", "L1", "L2", "L3"}
    assert sum(t["requests"] for t in tiers.values()) == f["requests"] == 4 * 4
    assert tiers["L3"]["requests"] == 4, "the second instance's turns did not come from storage"
    assert f["first_tokens_equal"] == f["requests"] and f["max_first_logit_gap"] < 1e-4
    for t in tiers.values():
        assert t["ttft_p50_s"] > 0 and t["recompute_ttft_p50_s"] > 0 and t["modelled_ttft_p50_s"] > 0
    assert tiers["none"]["cached_tokens_mean"] == 0 and tiers["L3"]["cached_tokens_mean"] > 0
    assert f["cost_model"]["kv_bytes_per_token"] == 2 * 3 * 2 * 16 * 4  # K/V x layers x KV heads x head_dim x fp32


def test_a_local_model_directory_is_served_like_the_tiny_model(tmp_path: Path, capsys: Any) -> None:
    tiny_llama(seed=0).save_pretrained(tmp_path)
    f = _figures(str(tmp_path), capsys)
    assert f["model"] == str(tmp_path) and f["device"] in ("cpu", "cuda:0")
    assert "L3" in f["tiers"] and f["first_tokens_equal"] == f["requests"]

