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


def test_another_object_under_a_taken_name_is_refused_even_a_dataclass_with_the_same_name():
    """A second MethodSpec named like a registered one, with another build, used to count as 'the same spec made
    again' (compared by name only) and silently replaced it: `lsh` would then have run someone else's method."""
    from ushash.hashing.methods import METHODS, MethodSpec, register
    lsh = METHODS["lsh"]

    class Other:
        pass

    with pytest.raises(ValueError, match="'lsh' is already registered"):
        register(MethodSpec(name="lsh", title="something else", kind="fitted", build=Other))
    assert METHODS["lsh"] is lsh
    again = MethodSpec(name=lsh.name, title=lsh.title, kind=lsh.kind, output=lsh.output, build=lsh.build,
                       aliases=lsh.aliases, reference=lsh.reference)
    assert register(again) is again  # the same spec made again (a module reloaded) is still accepted
    METHODS.add("lsh", lsh)


def test_an_alias_with_capitals_is_found_case_insensitively():
    r = Registry("widget", "somewhere")
    f = r.add("alpha", lambda: 1, aliases=("DeepThing",))
    assert r.lookup("DeepThing") is f and r.lookup("deepthing") is f and r.lookup("DEEPTHING") is f
