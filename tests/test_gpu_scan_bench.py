"""benchmarks/gpu_scan.py, the prepared run for a machine with CUDA, run here on the CPU at small sizes: its
bare reference scan against a naive popcount (signs, all-ones and ties at the radius included), and the
whole run, whose every backend result it checks against that scan before timing."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_scan  # noqa: E402


def _naive(a: int, b: int) -> int:
    return bin((a ^ b) & ((1 << 64) - 1)).count("1")


def test_popcount_and_bare_scan_against_a_naive_count():
    rng = np.random.default_rng(0)
    w = rng.integers(-(1 << 63), (1 << 63) - 1, size=500, dtype=np.int64)
    w[:4] = [0, -1, np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    got = gpu_scan.popcount64(torch.from_numpy(w)).tolist()
    assert got == [_naive(int(v), 0) for v in w]
    q = int(w[7])
    near = [q ^ -(1 << 63) ^ 1, q ^ 0b111, q ^ 0b1111]   # distances 2 (the sign bit too), 3 (the radius), 4
    words = torch.from_numpy(np.concatenate([w, np.array(near, np.int64)]))
    pos, d = gpu_scan.bare_scan(words, q, 3)
    want = [(i, _naive(int(v), q)) for i, v in enumerate(words.tolist()) if _naive(int(v), q) <= 3]
    assert list(zip(pos.tolist(), d.tolist())) == want
    assert (500, 2) in want and (501, 3) in want and all(i != 502 for i, _ in want)


def test_the_prepared_run_runs_on_the_cpu(capsys):
    rows = gpu_scan.main(["--device", "cpu", "--sizes", "3000", "20000", "--queries", "20", "--batch", "40",
                          "--repeats", "1"])
    out = capsys.readouterr().out
    assert [r["n"] for r in rows] == [3000, 20000]
    for r in rows:
        assert r["cache"][2] > 0 and r["bare"][2] > 0 and r["batch_rate"] > 0 and r["copy_bw"] > 0
        assert r["faiss"] == "not run on the CPU"
        assert r["copy_bw"] > r["code_bytes"]         # bytes per second of copying the codes, not elements
    assert "| 20,000 |" in out and "checked against the bare scan" in out
