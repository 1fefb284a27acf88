"""L1 Hamming backends against a naive popcount reference, through adds, removals and rebuilds."""

import numpy as np
import pytest

from ushash.serving.cache.search import FaissBackend, make_backend
from ushash.core.codes import hamming

BACKENDS = [
    pytest.param("flat", "cpu", id="faiss-flat"),
    pytest.param("mih", "cpu", id="faiss-mih"),
    pytest.param("auto", "cpu", id="faiss-auto"),
    pytest.param("torch", "cpu", id="torch-cpu"),
    pytest.param("torch", "cuda", id="torch-cuda", marks=pytest.mark.gpu),
]


def _reference(live: dict, q: np.ndarray, radius: int):
    if not live:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    slots = np.array(sorted(live), np.int64)
    codes = np.stack([live[s] for s in slots])
    d = hamming(q[None], codes)[0]
    keep = d <= radius
    order = np.lexsort((slots[keep], d[keep]))
    return slots[keep][order], d[keep][order]


@pytest.mark.parametrize("kind,device", BACKENDS)
@pytest.mark.parametrize("bits", [32, 64, 128])
def test_backend_matches_reference_under_churn(kind, device, bits):
    rng = np.random.default_rng(bits)
    nb = bits // 8
    b = make_backend(kind, bits, device=device, mih_min_entries=300)
    centres = rng.integers(0, 256, size=(20, nb), dtype=np.uint8)
    live: dict[int, np.ndarray] = {}
    next_slot = 0
    for step in range(6):
        # clustered codes: centres with a few flipped bits, so radius queries find many, ties included
        n = 400
        codes = centres[rng.integers(0, 20, n)].copy()
        flips = rng.integers(0, bits, size=(n, 3))
        for j in range(3):
            codes[np.arange(n), flips[:, j] // 8] ^= (1 << (flips[:, j] % 8)).astype(np.uint8)
        slots = np.arange(next_slot, next_slot + n)
        next_slot += n
        b.add_many(slots, codes)
        live.update({int(s): c for s, c in zip(slots, codes)})
        for s in rng.choice(sorted(live), size=len(live) // 3, replace=False):  # removals force rebuilds
            b.remove(int(s))
            del live[int(s)]
        assert len(b) == len(live)
        for radius in (0, 2, 5, 9):
            for q in codes[:5]:
                got_s, got_d = b.search(q, radius)
                ref_s, ref_d = _reference(live, q, radius)
                np.testing.assert_array_equal(got_s, ref_s)
                np.testing.assert_array_equal(got_d, ref_d)


def test_auto_switches_to_multi_index_hashing_and_slot_reuse():
    b = FaissBackend(64, kind="auto", mih_min_entries=100)
    codes = np.random.default_rng(0).integers(0, 256, size=(150, 8), dtype=np.uint8)
    b.add_many(np.arange(99), codes[:99])
    assert not b.uses_mih
    b.add_many(np.arange(99, 150), codes[99:])
    assert b.uses_mih
    b.add(7, codes[120])  # re-adding a slot replaces its code
    s, d = b.search(codes[120], 0)
    assert set(s.tolist()) == {7, 120} and (d == 0).all()
    s, _ = b.search(codes[7], 0)
    assert 7 not in s.tolist()


def test_backend_rejects_bad_codes_and_kinds():
    b = make_backend("flat", 64)
    with pytest.raises(ValueError, match=r"uint8 \[8\]"):
        b.search(np.zeros(4, np.uint8), 1)
    with pytest.raises(ValueError, match="unknown search backend"):
        make_backend("annoy", 64)
    with pytest.raises(ValueError, match="torch"):
        make_backend("mih", 64, device="cuda")


@pytest.mark.parametrize("kind,device", BACKENDS)
def test_search_many_equals_single_searches(kind, device):
    """One call for a batch gives each query exactly what its own search gives, ties included."""
    rng = np.random.default_rng(7)
    b = make_backend(kind, 64, device=device, mih_min_entries=100)
    centres = rng.integers(0, 256, size=(5, 8), dtype=np.uint8)
    codes = centres[rng.integers(0, 5, 600)].copy()
    flips = rng.integers(0, 64, size=(600, 2))
    for j in range(2):
        codes[np.arange(600), flips[:, j] // 8] ^= (1 << (flips[:, j] % 8)).astype(np.uint8)
    b.add_many(np.arange(600), codes)
    for s in range(0, 600, 3):
        b.remove(s)
    queries = np.concatenate([codes[:40], rng.integers(0, 256, size=(10, 8), dtype=np.uint8)])
    for radius in (0, 3, 6):
        lims, slots, dists = b.search_many(queries, radius)
        assert len(lims) == len(queries) + 1
        for i, q in enumerate(queries):
            s1, d1 = b.search(q, radius)
            np.testing.assert_array_equal(slots[lims[i]:lims[i + 1]], s1)
            np.testing.assert_array_equal(dists[lims[i]:lims[i + 1]], d1)
