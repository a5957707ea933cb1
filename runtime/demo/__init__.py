"""The demo, a small model served over the cache, and the cache simulator: what
`hicache demo` and `hicache simulate` run.

The model names below need the `model` extra (transformers); each is imported from its
module on first use (PEP 562), so `hicache demo` and `hicache simulate` run without it.
"""

import importlib as _importlib

_EXPORTS: dict[str, tuple[str, ...]] = {
    "_model_runner": ("Generation", "KVObserver", "ModelRunner", "ModelRunnerError", "PoolCache"),
    "_tiny_model": ("tiny_llama",),
}
"""Each private module, and the public names it defines."""

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
