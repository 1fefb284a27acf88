"""The batcher's pairing (GroupBatches) and the one group vocabulary it is built on."""

import numpy as np
import pytest

from ushash.core.groups import vocabulary
from ushash.data.store import FeatureSplit, Table
from ushash.hashing.datamodule import GroupBatches


def _split():
    # images: one per group a, b, c; texts: two captions for a, one for c, none for b; audio: b only
    mk = lambda m, groups, d: Table(m, np.arange(len(groups) * d, dtype=np.float32).reshape(len(groups), d) + 0.5,
                                    [f"{m}{i}" for i in range(len(groups))], np.array(groups, dtype=object),
                                    [()] * len(groups))
    tables = {"image": mk("image", ["a", "b", "c"], 2), "text": mk("text", ["c", "a", "a"], 3),
              "audio": mk("audio", ["b"], 1)}
    return FeatureSplit(None, {"split": "train"}, tables)


def test_vocabulary_is_sorted_and_indexes_every_row():
    names, index = vocabulary({"x": np.array(["b", "a"]), "y": np.array(["c", "b", "b"])})
    assert names.tolist() == ["a", "b", "c"]
    assert index["x"].tolist() == [1, 0] and index["y"].tolist() == [2, 1, 1]
    assert vocabulary({})[0].tolist() == []


@pytest.mark.parametrize("seed", range(5))
def test_batches_pair_rows_of_the_same_group_only(seed):
    split = _split()
    gb = GroupBatches(split, ("image", "text", "audio"), seed=seed)
    assert gb.groups == ["a", "b", "c"] and len(gb) == 3
    batch = gb.collate([2, 0, 1, 0])
    for m, (x, gid, present) in batch.items():
        t = split.tables[m]
        assert gid.tolist() == [2, 0, 1, 0]
        for i, g in enumerate(gid.tolist()):
            rows = [r for r in range(len(t)) if t.groups[r] == gb.groups[g]]
            assert bool(present[i]) == bool(rows), (m, g)
            if rows:  # x is one of the group's own rows, never another group's
                assert any(np.array_equal(x[i].numpy(), t.x[r]) for r in rows), (m, g)
    # group b has no caption, group a two: both captions get drawn over seeds
    drawn = {tuple(gb.collate([0])["text"][0][0].numpy()) for _ in range(40)}
    assert len(drawn) == 2


def test_batcher_needs_two_modalities():
    split = _split()
    with pytest.raises(ValueError, match="two modalities"):
        GroupBatches(FeatureSplit("p", {}, {"image": split.tables["image"]}), ("image",))
