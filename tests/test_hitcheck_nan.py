"""A payload whose cosine is NaN (a corrupt record read from the shared tier) is refused, never served: the
checks read "cosine >= threshold", which NaN fails, not "not cosine < threshold", which it passes."""

import numpy as np

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.entries import Candidates
from ushash.serving.cache.lsh import LSHHead


def _nan_record(c, z):
    rec = c.payload_codec.encode("image", z)[0].copy()
    for at in range(len(rec) - 1):          # the record's fp16 scale, wherever the format keeps it
        bad = rec.copy()
        bad[at:at + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
        if np.isnan(c.payload_codec.decode("image", bad[None])).any():
            return bad.tobytes()
    raise AssertionError("no fp16 NaN makes this record decode to NaN")


def test_a_nan_cosine_is_a_refusal_on_both_selection_paths():
    c = SemanticCache(LSHHead({"image": 8}, bits=64, dim=8, seed=0), {"bloom": False})
    q = c.query("image", features=np.random.default_rng(0).standard_normal(8).astype(np.float32))
    good = c.payload_codec.encode("image", q.z)[0].tobytes()
    bad = _nan_record(c, q.z)
    cands = Candidates(ids=["a"], dists=[0], modalities=["image"], payloads=[bad], revisions=[c.revision],
                       expires=[float("inf")])
    assert c.hit_check.choose(q, cands, c.revision, 0.0, trusted=False) is None
    assert c.hit_check.rank(q, cands, c.revision, 0.0, trusted=False, k=3) == []
    # the same candidate with its own record is served, and a NaN one beside it does not displace it
    both = Candidates(ids=["a", "b"], dists=[0, 1], modalities=["image"] * 2, payloads=[bad, good],
                      revisions=[c.revision] * 2, expires=[float("inf")] * 2)
    assert c.hit_check.choose(q, both, c.revision, 0.0, trusted=False)[0] == 1
    assert [j for j, _, _ in c.hit_check.rank(q, both, c.revision, 0.0, trusted=False, k=3)] == [1]
