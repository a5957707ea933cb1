"""`Config.for_model`: the model shape from a transformers config, sizes from byte budgets."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache.actors import DeviceCore, HostCore
from hicache.runtime import Config, ConfigError, DeviceKind, StorageKind

MIB = 1 << 20


def _llama_like(**changes: Any) -> SimpleNamespace:
    """The attributes a transformers LlamaConfig has: 8 layers, 32 heads of 128, 8 KV heads, bf16."""
    attrs: dict[str, Any] = {"num_hidden_layers": 8, "hidden_size": 4096, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": torch.bfloat16}
    attrs.update(changes)
    return SimpleNamespace(**{k: v for k, v in attrs.items() if v is not ...})


def test_the_model_shape_comes_from_the_model_config_and_bytes_become_whole_pages() -> None:
    page_bytes = 2 * 8 * 8 * 128 * 2 * 16  # K and V x layers x KV heads x head_dim x bf16 x page_size
    c = Config.for_model(_llama_like(), device_bytes=10 * page_bytes + 1, host_bytes=30 * page_bytes - 1)
    assert (c.layers, c.kv_heads, c.head_dim, c.dtype) == (8, 8, 128, "bfloat16")
    assert c.bytes_per_slot * c.page_size == page_bytes
    assert (c.device_slots, c.host_slots) == (10 * 16, 29 * 16)


def test_host_ratio_sizes_the_host_tier_from_the_device_budget() -> None:
    c = Config.for_model(_llama_like(), device_bytes=64 * MIB, host_ratio=2.5, page_size=64)
    page_bytes = c.bytes_per_slot * 64
    assert c.device_slots == 64 * MIB // page_bytes * 64
    assert c.host_slots == int(64 * MIB * 2.5) // page_bytes * 64


def test_other_fields_are_given_by_keyword_and_parsed_like_any_other() -> None:
    c = Config.for_model(_llama_like(), device_bytes=16 * MIB, host_ratio="2", page_size="32", device="cpu",
                         storage="file", storage_dir="/tmp/pages", write_policy=" WRITE_BACK ")
    assert c.page_size == 32 and c.device is DeviceKind.CPU and c.storage is StorageKind.FILE
    assert c.write_policy.value == "write_back"


def test_missing_head_dim_is_hidden_size_over_heads_and_missing_kv_heads_is_the_head_count() -> None:
    c = Config.for_model(_llama_like(head_dim=..., num_key_value_heads=None), device_bytes=64 * MIB, host_ratio=2)
    assert (c.kv_heads, c.head_dim) == (32, 4096 // 32)


def test_a_hidden_size_that_does_not_split_into_heads_needs_head_dim() -> None:
    with pytest.raises(ConfigError, match=r"^model_config has no head_dim and hidden_size=4100 is not a multiple "
                                          r"of num_attention_heads=32: set head_dim on the model config$"):
        Config.for_model(_llama_like(head_dim=None, hidden_size=4100), device_bytes=64 * MIB, host_ratio=2)


@pytest.mark.parametrize(("model_dtype", "given", "expected"), [
    (torch.bfloat16, None, "bfloat16"),
    ("float16", None, "float16"),
    (" torch.float32 ", None, "float32"),
    (torch.float64, "bfloat16", "bfloat16"),
    (None, torch.float8_e4m3fn, "float8_e4m3fn"),
    (..., "float16", "float16"),
])
def test_the_dtype_is_the_given_one_else_the_models(model_dtype: Any, given: Any, expected: str) -> None:
    fields = {} if given is None else {"dtype": given}
    c = Config.for_model(_llama_like(torch_dtype=model_dtype), device_bytes=64 * MIB, host_ratio=2, **fields)
    assert c.dtype == expected


def test_transformers_current_dtype_attribute_is_read_before_torch_dtype() -> None:
    model = _llama_like(dtype=torch.float32, torch_dtype=torch.bfloat16)
    assert Config.for_model(model, device_bytes=64 * MIB, host_ratio=2).dtype == "float32"


def test_a_model_without_a_dtype_needs_one_given() -> None:
    with pytest.raises(ConfigError, match=r"^model_config has no dtype \(nor torch_dtype\): pass dtype=, "):
        Config.for_model(_llama_like(torch_dtype=None), device_bytes=64 * MIB, host_ratio=2)


def test_a_model_dtype_the_cache_cannot_hold_says_to_pass_one() -> None:
    with pytest.raises(ConfigError, match=r"^model_config.torch_dtype=torch.float64 must be one of float16, .*; or "
                                          r"pass dtype= to choose the KV cache's element type$"):
        Config.for_model(_llama_like(torch_dtype=torch.float64), device_bytes=64 * MIB, host_ratio=2)


@pytest.mark.parametrize(("kv_heads", "tp_size", "per_rank"), [(8, 1, 8), (8, 2, 4), (8, 8, 1), (8, 16, 1), (2, 8, 1)])
def test_each_rank_keeps_its_share_of_the_kv_heads(kv_heads: int, tp_size: int, per_rank: int) -> None:
    c = Config.for_model(_llama_like(num_key_value_heads=kv_heads), device_bytes=64 * MIB, host_ratio=2,
                         tp_size=tp_size, tp_rank=tp_size - 1)
    assert c.kv_heads == per_rank and c.tp_size == tp_size


def test_a_tp_size_that_does_not_split_the_kv_heads_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^tp_size=3 does not split num_key_value_heads=8: use a tp_size that "
                                          r"divides 8 or is a multiple of it$"):
        Config.for_model(_llama_like(), device_bytes=64 * MIB, host_ratio=2, tp_size=3)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_hidden_layers": ...}, r"^model_config has no num_hidden_layers: give a transformers config"),
    ({"num_hidden_layers": 0}, r"^model_config.num_hidden_layers=0 must be a positive integer$"),
    ({"num_attention_heads": "32"}, r"^model_config.num_attention_heads='32' must be a positive integer$"),
    ({"head_dim": 64.0}, r"^model_config.head_dim=64.0 must be a positive integer$"),
    ({"num_key_value_heads": True}, r"^model_config.num_key_value_heads=True must be a positive integer$"),
    ({"num_key_value_heads": 64}, r"^model_config has num_key_value_heads=64 above num_attention_heads=32"),
    ({"kv_lora_rank": 512, "qk_rope_head_dim": 64},  # DeepSeek-V2/V3: sized as 8 x 128 per-head K and V before
     r"^model_config is a multi-head latent attention model \(kv_lora_rank=512\): .*it cannot size or serve"),
])
def test_a_model_config_with_a_bad_attribute_is_one_config_error(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.for_model(_llama_like(**change), device_bytes=64 * MIB, host_ratio=2)


@pytest.mark.parametrize("field", ["layers", "kv_heads", "head_dim", "device_slots", "host_slots"])
def test_fields_that_come_from_the_model_or_the_budgets_cannot_also_be_given(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^for_model sets {field} from the model and the byte budgets: leave it out$"):
        Config.for_model(_llama_like(), device_bytes=64 * MIB, host_ratio=2, **{field: 64})


@pytest.mark.parametrize(("budgets", "message"), [
    ({"device_bytes": 64 * MIB}, r"^give host_bytes \(bytes of KV in host memory\) or host_ratio"),
    ({"device_bytes": 64 * MIB, "host_bytes": 1 << 30, "host_ratio": 2},
     r"^give host_bytes .* one of them \(with host_tier=False, neither\)$"),
    ({"device_bytes": 1000, "host_ratio": 2}, r"^device_bytes=1000 holds no page: one page \(page_size=16 tokens x "
                                              r"32768 bytes of K and V\) takes 524288 bytes; give at least that$"),
    ({"device_bytes": "lots", "host_ratio": 2}, r"^device_bytes='lots' must be an integer in 1\.\."),
    ({"device_bytes": 64 * MIB, "host_ratio": 1.0}, r"^host_bytes=67108864 holds 128 pages of 524288 bytes, no more "
                                                   r"than the device's 128: give the host tier more bytes"),
    ({"device_bytes": 64 * MIB, "host_ratio": 0}, r"^host_ratio=0 must be a number > 0"),
])
def test_bad_budgets_are_one_config_error(budgets: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.for_model(_llama_like(), **budgets)


def test_an_l1_only_cache_needs_no_host_budget() -> None:
    c = Config.for_model(_llama_like(), device_bytes=64 * MIB, host_tier=False)
    assert not c.host_tier and c.device_slots == 64 * MIB // (c.bytes_per_slot * 16) * 16
    assert c.host_slots == c.page_size                  # one page, as an L1-only Config allocates
    given = Config.for_model(_llama_like(), device_bytes=64 * MIB, host_ratio=2, host_tier=False)
    assert given.host_slots == 2 * c.device_slots       # a budget given is still taken as given


def test_budgets_this_machine_cannot_hold_are_refused_unless_the_check_is_off() -> None:
    with pytest.raises(ConfigError, match=r"^the cache needs .* of host memory but .* is free: "):
        Config.for_model(_llama_like(), device_bytes=1 << 48, host_ratio=2)
    c = Config.for_model(_llama_like(), device_bytes=1 << 48, host_ratio=2, check=False)
    assert c.device_slots * c.bytes_per_slot == 1 << 48


def test_a_cuda_config_is_refused_where_torch_has_no_cuda_unless_the_check_is_off() -> None:
    if torch.cuda.is_available():
        assert Config.for_model(_llama_like(), device_bytes=64 * MIB, host_ratio=2, device="cuda").device_slots
    else:
        with pytest.raises(ConfigError, match=r"^device='cuda' but torch "):
            Config.for_model(_llama_like(), device_bytes=64 * MIB, host_ratio=2, device="cuda")
    assert Config.for_model(_llama_like(), device_bytes=64 * MIB, host_ratio=2, device="cuda",
                            check=False).device is DeviceKind.CUDA


def test_the_buffers_a_for_model_config_allocates_stay_within_the_budgets() -> None:
    model = _llama_like(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, torch_dtype=torch.float32)
    device_bytes, host_bytes = 1 * MIB + 12_345, 3 * MIB
    c = Config.for_model(model, device_bytes=device_bytes, host_bytes=host_bytes)
    device, host = DeviceCore(c), HostCore(c)
    page_bytes = c.bytes_per_slot * c.page_size
    assert device_bytes - page_bytes < device.kv.tensor.nbytes <= device_bytes
    assert host_bytes - page_bytes < host.kv.tensor.nbytes <= host_bytes


def test_a_dict_of_a_config_json_is_read_like_a_config() -> None:
    """A dict was read by attribute: 'model_config has no num_hidden_layers', though it had."""
    raw = {"num_hidden_layers": 8, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "torch_dtype": "bfloat16"}
    c = Config.for_model(raw, device_bytes=64 * MIB, host_ratio=2)
    assert (c.layers, c.kv_heads, c.head_dim, c.dtype) == (8, 8, 128, "bfloat16")
    nested = {"text_config": raw, "architectures": ["LlavaForConditionalGeneration"]}
    assert Config.for_model(nested, device_bytes=64 * MIB, host_ratio=2) == c


def test_a_text_config_that_fails_and_a_check_that_is_not_a_bool_are_one_config_error() -> None:
    def broken() -> Any:
        raise KeyError("vision_config")

    with pytest.raises(ConfigError, match=r"^model_config.get_text_config\(\) failed \(KeyError: 'vision_config'\)"):
        Config.for_model(SimpleNamespace(get_text_config=broken), device_bytes=64 * MIB, host_ratio=2)
    with pytest.raises(ConfigError, match=r"^check='no' must be True or False$"):
        Config.for_model(_llama_like(), device_bytes=64 * MIB, host_ratio=2, check="no")


def test_a_multimodal_config_is_read_through_its_text_config() -> None:
    text = _llama_like(num_hidden_layers=3)
    outer = SimpleNamespace(get_text_config=lambda: text, torch_dtype=torch.float16)
    c = Config.for_model(outer, device_bytes=64 * MIB, host_ratio=2)
    assert (c.layers, c.dtype) == (3, "bfloat16")


def test_a_real_transformers_llama_config() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers (the optional model extra) is absent")
    model = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=256, num_attention_heads=8,
                                     num_key_value_heads=2, dtype="bfloat16")
    c = Config.for_model(model, device_bytes=4 * MIB, host_bytes=16 * MIB, tp_size=2, tp_rank=1)
    assert (c.layers, c.kv_heads, c.head_dim, c.dtype) == (3, 1, 32, "bfloat16")
    assert c.device_slots == 4 * MIB // (2 * 3 * 1 * 32 * 2 * 16) * 16
    no_dtype = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    assert Config.for_model(no_dtype, device_bytes=MIB, host_ratio=2, dtype="float32").kv_heads == 4


def test_the_model_id_is_the_models_name_and_hub_revision_unless_one_is_given() -> None:
    """Storage keys are derived from `model_id`: two models sharing a storage must not read
    each other's pages, so for_model names the model it was given."""
    raw = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "torch_dtype": "bfloat16"}
    sized = {"device_bytes": MIB, "host_ratio": 2}
    assert Config.for_model(raw, **sized).model_id == ""
    named = {**raw, "_name_or_path": "Qwen/Qwen2.5-7B-Instruct"}
    assert Config.for_model(named, **sized).model_id == "Qwen/Qwen2.5-7B-Instruct"
    pinned = {**named, "_commit_hash": "a09a354"}
    assert Config.for_model(pinned, **sized).model_id == "Qwen/Qwen2.5-7B-Instruct@a09a354"
    assert Config.for_model(_llama_like(_name_or_path="/models/llama"), **sized).model_id == "/models/llama"
    assert Config.for_model(pinned, model_id="my-finetune", **sized).model_id == "my-finetune"
    assert Config.for_model(pinned, model_id="", **sized).model_id == ""
    with pytest.raises(ConfigError, match=r"^model_id='a\\nb' must be printable text"):
        Config.for_model({**raw, "_name_or_path": "a\nb"}, **sized)


def test_a_transformers_config_loaded_from_a_directory_names_that_directory(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers (the optional model extra) is absent")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                             dtype="float32").save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert Config.for_model(loaded, device_bytes=MIB, host_ratio=2).model_id == str(tmp_path)
