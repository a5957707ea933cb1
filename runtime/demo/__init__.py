"""The demo, a small model served over the cache, and the cache simulator: what
`hicache demo` and `hicache simulate` run.

The model names below need the `model` extra (transformers); each is imported from its
module on first use (PEP 562), so `hicache demo` and `hicache simulate` run without it.
"""

from hicache.runtime._lazy import lazy_exports as _lazy_exports

_EXPORTS: dict[str, tuple[str, ...]] = {
    "_model_runner": ("Generation", "KVObserver", "ModelRunner", "ModelRunnerError", "PoolCache"),
    "_tiny_model": ("tiny_llama",),
}
"""Each private module, and the public names it defines."""

__all__, __getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
