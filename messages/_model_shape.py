"""A model's KV shape, read from a transformers `PretrainedConfig`, any object with its
attributes, or a mapping of them (a `config.json` loaded as a dict).

transformers is never imported here: the reader asks for attributes by name, so
it works with the optional extra absent, with a `PretrainedConfig` of any version,
and with a plain object or dict that carries the same names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ._config_values import ConfigError, DType, refuse

_NO_VALUE = object()


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What one tensor-parallel rank keeps of each token: the `Config` model-shape fields."""

    layers: int
    kv_heads: int
    """KV heads on this rank."""
    head_dim: int
    dtype: Any
    """The element type (a `DTYPES` name, or the caller's raw value), or None when nothing says."""


def model_shape(model_config: Any, tp_size: int, dtype: Any = None) -> ModelShape:
    """The shape of `model_config` (its text part, for a multimodal one) on one of `tp_size` ranks;
    `dtype`, when given, stands for the model's (an engine may keep its KV cache in another type).

    `num_key_value_heads` missing means one KV head per attention head (no grouping);
    `head_dim` missing means `hidden_size // num_attention_heads`; the dtype is
    `dtype` (transformers' current name) or `torch_dtype`, a `torch.dtype` or a string.
    """
    cfg: Any = model_config
    if isinstance(model_config, Mapping):
        cfg = _Attributes(model_config.get("text_config") or model_config)
    else:
        text = getattr(model_config, "get_text_config", None)
        if callable(text):
            try:
                cfg = text()
            except Exception as e:  # noqa: BLE001 - the model's own code: say where it failed
                raise ConfigError(f"model_config.get_text_config() failed ({type(e).__name__}: {e}): give the "
                                  "text model's config") from None
    rank = getattr(cfg, "kv_lora_rank", None)
    if rank:
        raise ConfigError(f"model_config is a multi-head latent attention model (kv_lora_rank={rank!r}): its cache "
                          "holds one compressed latent a token, and hicache holds per-head K and V; it cannot size "
                          "or serve this model's KV")
    layers = _positive(cfg, "num_hidden_layers")
    heads = _positive(cfg, "num_attention_heads")
    kv_heads = _positive(cfg, "num_key_value_heads", default=heads)
    if kv_heads > heads:
        raise ConfigError(f"model_config has num_key_value_heads={kv_heads} above num_attention_heads={heads}: "
                          "each KV head serves one or more attention heads; check the model config")
    head_dim = _positive(cfg, "head_dim", default=None)
    if head_dim is None:
        hidden = _positive(cfg, "hidden_size")
        if hidden % heads:
            raise ConfigError(
                f"model_config has no head_dim and hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={heads}: set head_dim on the model config"
            )
        head_dim = hidden // heads
    return ModelShape(layers, _per_rank(kv_heads, tp_size), head_dim, _dtype(cfg) if dtype is None else dtype)


def model_name(model_config: Any) -> str:
    """The name of the model of `model_config`, for `Config.model_id`: transformers'
    `_name_or_path` (the hub id or the directory it was loaded from), with `@` and the hub
    revision's commit when the config records it (`_commit_hash`, which transformers 5
    no longer keeps); "" when it names none."""
    get = model_config.get if isinstance(model_config, Mapping) else (lambda a: getattr(model_config, a, None))
    name, commit = get("_name_or_path"), get("_commit_hash")
    if not isinstance(name, str) or not name:
        return ""
    return f"{name}@{commit}" if isinstance(commit, str) and commit else name


class _Attributes:
    """A mapping's keys read as attributes (missing ones as absent)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = values

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None


def _positive(cfg: Any, attr: str, default: Any = _NO_VALUE) -> Any:
    value = getattr(cfg, attr, None)
    if value is None:
        if default is _NO_VALUE:
            raise ConfigError(f"model_config has no {attr}: give a transformers config of a decoder-only model "
                              "(or an object with num_hidden_layers, num_attention_heads, hidden_size)")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise refuse(f"model_config.{attr}", value, "a positive integer")
    return value


def _per_rank(kv_heads: int, tp_size: int) -> int:
    """KV heads on one rank: an even share, or one when ranks outnumber heads (each head
    is then replicated on `tp_size // kv_heads` ranks, as engines shard grouped-query attention)."""
    if kv_heads % tp_size == 0:
        return kv_heads // tp_size
    if tp_size % kv_heads == 0:
        return 1
    raise ConfigError(
        f"tp_size={tp_size} does not split num_key_value_heads={kv_heads}: use a tp_size that divides "
        f"{kv_heads} or is a multiple of it"
    )


def _dtype(cfg: Any) -> str | None:
    for attr in ("dtype", "torch_dtype"):
        if hasattr(cfg, attr):
            value = getattr(cfg, attr)
            if value is None:
                return None
            try:
                return DType().parse(f"model_config.{attr}", value)
            except ConfigError as e:
                raise ConfigError(f"{e}; or pass dtype= to choose the KV cache's element type") from None
    return None
