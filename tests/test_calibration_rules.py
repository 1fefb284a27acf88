"""scripts/calibration_rules.py's report: its comparison line against a hand count of the rows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from calibration_rules import markdown  # noqa: E402


def _row(half, rule, hits, false):
    return {"half": half, "rule": rule, "calibration_requests": 100, "requests": 200, "hits": hits,
            "false_hits": false, "upper": 0.01, "correct_hit_rate": (hits - false) / 200, "exact_hit_rate": 0.5,
            "oracle_hit_rate": 0.9, "headroom_captured": 0.5, "points": {"text>text": [3, 0.99]}}


def test_the_report_counts_correct_hits_gained_and_false_hits_added_per_half():
    results = [{"dataset": "d", "revision": "r", "rows": [_row(0, "tight", 150, 0), _row(0, "loose", 160, 4),
                                                           _row(1, "tight", 170, 1), _row(1, "loose", 168, 1)]}]
    md = markdown(results, {"date": "2026-12-07", "machine": "m", "budget": 0.01, "rules": ["tight", "loose"],
                            "command": "c"})
    # half 1: (160 - 4) - (150 - 0) = +6 correct, +4 false; half 2: (168 - 1) - (170 - 1) = -2, +0
    assert "- d, `loose`: half 1: +6 (+4); half 2: -2 (+0)" in md
    assert "| d | half 1 (100 requests) | loose | text>text (3, 0.99) | 160 | 4 | 0.0250 (0.0100) | 0.7800 | 0.500 |" in md
