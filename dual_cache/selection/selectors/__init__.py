"""Selectors: one class per policy for choosing each decode step's entries, one file each (docs/design.md §3).

Every module of this package that defines a `Selector` subclass with a `name` registers it: adding a selector
means adding one file here. `SELECTORS` maps `DualDecoderConfig.selector` values to classes.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import HostClaim, Selector


def _discover() -> dict[str, type[Selector]]:
    found: dict[str, type[Selector]] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")
    pending = list(Selector.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.name:
            if cls.name in found and found[cls.name] is not cls:
                raise RuntimeError(f"Two selectors are named {cls.name!r}: {found[cls.name]} and {cls}.")
            found[cls.name] = cls
    return dict(sorted(found.items()))


SELECTORS: dict[str, type[Selector]] = _discover()

__all__ = ["SELECTORS", "HostClaim", "Selector"]
