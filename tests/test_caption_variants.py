"""Caption variants of the cache simulator's raw-media pools (ushash.sim.augment.caption_variant)."""

import numpy as np
import pytest

from ushash.sim.augment import CAPTION_VARIANTS, caption_variant
from ushash.sim.pool import media_members, text_key


def test_every_kind_changes_the_text_and_is_seeded():
    cap = "A big red frog on the house."
    for kind in CAPTION_VARIANTS:
        a = caption_variant(cap, kind, 0, np.random.default_rng(0))
        b = caption_variant(cap, kind, 0, np.random.default_rng(0))
        assert a == b and a != cap, kind
    assert sorted(caption_variant(cap, "reordered", 0, np.random.default_rng(0)).split()) == sorted(cap.rstrip(".").split())
    assert caption_variant(cap, "synonym", 0, np.random.default_rng(0)) == "one large crimson frog on this home"
    t = caption_variant(cap, "typo", 0, np.random.default_rng(1))
    assert len(t) == len(cap.rstrip(".")) and sorted(t) == sorted(cap.rstrip("."))
    assert caption_variant(cap, "template", 0, np.random.default_rng(0)) == "a picture of a big red frog on the house"
    with pytest.raises(ValueError, match="one of"):
        caption_variant(cap, "shouted", 0, np.random.default_rng(0))


def test_pool_members_carry_their_kind_and_exact_keys():
    rng = np.random.default_rng(0)
    out = media_members("text", "A frog.", 7, 2, rng, 40, 0.8, 20.0, captions=("recased", "typo", "template"))
    kinds = [m[3] for m in out]
    assert kinds == ["original"] + ["recased"] * 2 + ["typo"] * 2 + ["template"] * 2
    assert all(m[2] == 7 for m in out)
    # re-casing keeps the exact key (it normalises case and final punctuation); a template does not
    assert out[1][4] == text_key("A frog.") and out[-1][4] != text_key("A frog.")


@pytest.mark.parametrize("cap", ["A moon wrasse.", "A book", "Three green apples.", "A ball", "Committee meeting"])
def test_a_typo_always_changes_the_exact_key(cap):
    """Swapping two equal letters ("moon", "book") made no typo: 9.5 % of Tux Paint's typo variants were the
    caption itself less its stop, an exact-key hit sent as a variant that changes the encoding."""
    for seed in range(40):
        t = caption_variant(cap, "typo", seed, np.random.default_rng(seed))
        assert text_key(t) != text_key(cap), (seed, t)
        if cap != "A book":   # no two different letters to swap inside its words: its last letter doubled
            assert sorted(t) == sorted(cap.rstrip(".!?")), (seed, t)
