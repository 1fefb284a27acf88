"""benchmarks/heads.py: one run measures both loops, and the published table's medians and ranges are the runs'."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import heads  # noqa: E402


def test_one_small_run_measures_both_loops_and_both_encoders():
    r = heads.measure(n=300, batch=32, steps=2, repeats=1)
    assert set(r) == {"module", "bare", "encode", "packbits"} and all(v > 0 for v in r.values())


def test_the_table_gives_each_run_and_the_median_ratio_with_its_range():
    runs = [{"module": 80.0, "bare": 100.0, "encode": 3.0, "packbits": 4.0},
            {"module": 100.0, "bare": 100.0, "encode": 1.0, "packbits": 4.0},
            {"module": 45.0, "bare": 50.0, "encode": 2.0, "packbits": 4.0}]
    text = heads.table(runs, "2026-01-01 00:00", "00:05")
    assert text.count("\n| ") == 4   # the header and 3 runs
    assert "| 2 | 100.0 | 100.0 | 1.00x | 1 | 4 | 0.25x |" in text
    assert "median ratio **0.90x** (range 0.80-1.00x)" in text and "median ratio 0.50x (range 0.25-0.75x)" in text
