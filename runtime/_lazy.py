"""Lazy exports (PEP 562) for a package's `__init__`: each public name is imported from
its module on first use and then kept in the package, so importing the package loads
none of those modules."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """`__all__`, `__getattr__` and `__dir__` for `package`, whose `exports` map each module
    (relative to the package, or absolute when it starts with "hicache.") to its public names."""
    module_of = {name: module for module, names in exports.items() for name in names}
    names = sorted(module_of)

    def __getattr__(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module if module.startswith("hicache.") else f"{package}.{module}"),
                        name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return names, __getattr__, __dir__
