"""One registry mechanism for everything ushash looks up by name: datasets, encoders, hashing methods.

    DATASETS = Registry("dataset", "ushash/data/datasets")
    @DATASETS.register("tuxpaint")            # or DATASETS.add("tuxpaint", fn, aliases=(...))
    def rows(split, ...): ...
    DATASETS.lookup("TuxPaint")               # exact name, an alias, or case-insensitive

A registry is a dict (name -> object), filled when its package's modules are imported (each package
ends its __init__ with `import_all(__name__, __path__)`); adding a dataset, an encoder, a hashing method
or an eviction policy is one module that registers itself plus one config file (CONTRIBUTING.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable


def import_all(package: str, path) -> None:
    """Import every module of a package (its `__name__` and `__path__`): what fills the package's registry,
    so that a new dataset, encoder, method or policy is one new module, with no import line to edit."""
    import importlib
    import pkgutil
    for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


class UnknownName(KeyError, ValueError):
    """A name no registry entry has (a KeyError for mapping-style callers, a ValueError for config errors)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _same_object(a: Any, b: Any) -> bool:
    """The same object, or the same source function / class defined again (a module reloaded or run as a script)."""
    if a is b:
        return True
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is not None and cb is not None:
        return (a.__qualname__ == b.__qualname__ and ca.co_filename == cb.co_filename
                and ca.co_firstlineno == cb.co_firstlineno)
    if isinstance(a, type) and isinstance(b, type):
        return a.__qualname__ == b.__qualname__ and a.__module__ == b.__module__
    if type(a) is type(b) and dataclasses.is_dataclass(a):  # e.g. a MethodSpec made again: every field the same
        return all(_same_object(x, y) or _equal(x, y)
                   for x, y in ((getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)))
    return type(a) is type(b) and getattr(a, "name", None) == getattr(b, "name", object())  # e.g. a spec made again


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays: not one truth value
        return False


class Registry(dict):
    def __init__(self, kind: str, where: str):
        super().__init__()
        self.kind, self.where = kind, where
        self.aliases: dict[str, str] = {}

    def add(self, name: str, obj: Any, aliases: Iterable[str] = ()) -> Any:
        for key in (name, *aliases):
            owner = name if key == name and key in self else self.aliases.get(key, key if key in self else None)
            if owner is not None and not _same_object(self.get(owner), obj):
                raise ValueError(f"{self.kind} name {key!r} is already registered (by {_where(self.get(owner))})")
        self[name] = obj
        for key in aliases:
            self.aliases[key] = name
        return obj

    def register(self, name: str, aliases: Iterable[str] = ()) -> Callable[[Any], Any]:
        """Decorator form of `add`."""
        return lambda obj: self.add(name, obj, aliases)

    def canonical(self, name: str) -> str:
        """The registered name for `name` (itself, an alias, or a case-insensitive match)."""
        name = str(name)
        for key in (name, name.lower()):
            if key in self:
                return key
            if key in self.aliases:
                return self.aliases[key]
        lowered = {k.lower(): k for k in self}
        if name.lower() in lowered:
            return lowered[name.lower()]
        lowered_aliases = {k.lower(): v for k, v in self.aliases.items()}  # an alias spelled with capitals
        if name.lower() in lowered_aliases:
            return lowered_aliases[name.lower()]
        raise self.unknown(name)

    def unknown(self, name: str) -> UnknownName:
        return UnknownName(f"unknown {self.kind} {name!r}; known {self.kind}s: {sorted(self)} "
                           f"(registered: one module each in {self.where})")

    def lookup(self, name: str) -> Any:
        return self[self.canonical(name)]


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
