"""The one registry mechanism (datasets, encoders, methods)."""

import pytest

from ushash.core.registry import Registry, UnknownName


def test_add_lookup_aliases_and_errors():
    r = Registry("widget", "somewhere")
    f = r.register("Alpha", aliases=("a1",))(lambda: 1)
    assert r.lookup("Alpha") is f and r.lookup("a1") is f and r.lookup("alpha") is f and "Alpha" in r
    with pytest.raises(ValueError, match="already registered"):
        r.add("Alpha", lambda: 2)
    with pytest.raises(ValueError, match="already registered"):
        r.add("Beta", lambda: 3, aliases=("a1",))
    with pytest.raises(UnknownName, match=r"unknown widget 'nope'; known widgets: \['Alpha'\]"):
        r.lookup("nope")
    assert isinstance(r.unknown("x"), KeyError) and isinstance(r.unknown("x"), ValueError)


def test_the_three_registries_are_one_kind():
    from ushash.data.datasets import DATASETS
    from ushash.encoders import ENCODERS
    from ushash.hashing.methods import METHODS
    for reg, name in ((DATASETS, "tuxpaint"), (ENCODERS, "tiny"), (METHODS, "ushash")):
        assert isinstance(reg, Registry) and name in reg
