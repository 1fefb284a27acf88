"""Train one set's search choice on another set, over seeds 0-2: is what val chose on one set better on the
other set's val too (the rule a default changes by, docs/baselines.md)? And on other splits of either set?

    python scripts/search_cross.py --to tuxpaint                              # emoji's choice, on Tux Paint
    python scripts/search_cross.py --from emoji --to emoji --data-seed 1      # emoji's choice, another split

Reads the US-HASH search report of the choosing set (the other set unless --from; experiments/search/
<experiment>-ushash-64b-s0-*/search.json, made by `python -m ushash.search`) and runs `python -m ushash.sweep -m
experiment=sweep_<to>64 method=ushash seed=0,1,2 [data.seed=N] <its chosen settings>`; the sweep aggregates into
the experiment's variants/ folder.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SETS = {"tuxpaint": ("sweep_tuxpaint64", "tuxpaint-offline-64b"), "emoji": ("sweep_emoji64", "emoji-offline-64b")}


def search_report(pattern: str, keep=lambda report: True, root: Path = ROOT) -> dict | None:
    """The search report (experiments/search/`pattern`) that `keep` accepts, None when there is none. Two are
    refused: a file's time does not say which is current (a clone dates every file alike), and a report made
    with other settings sits in a folder of its own beside the one it replaced."""
    found = sorted((root / "experiments" / "search").glob(pattern))
    kept = [(f, r) for f, r in ((f, json.loads(f.read_text())) for f in found) if keep(r)]
    if len(kept) > 1:
        raise SystemExit(f"{len(kept)} search reports match experiments/search/{pattern}: "
                         f"{', '.join(f.parent.name for f, _ in kept)}; move away all but the one to publish")
    return kept[0][1] if kept else None


def set_search(dataset: str, method: str = "ushash") -> dict | None:
    return search_report(f"{SETS[dataset][1]}-{method}-64b-s0-*/search.json")


def cross_overrides(to: str, choice: str | None = None, data_seed: int = 0) -> tuple[str, list[str]] | None:
    """(the set whose choice it is, the sweep's overrides) for training the choice of `choice` (default: the
    other set) on `to`, on its split `data_seed` (0: the published one); None without a report of that set."""
    other = choice or next(d for d in SETS if d != to)
    rep = set_search(other)
    if rep is None:
        return None
    from ushash.evaluation.search import override_value   # as the search's own report writes the command

    return other, ["method=ushash", "seed=0,1,2", *([f"data.seed={data_seed}"] if data_seed else []),
                   *(f"{k}={override_value(v, exact=True)}" for k, v in rep["chosen"]["params"].items())]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--to", choices=sorted(SETS), required=True, help="the set it is trained on")
    ap.add_argument("--from", dest="choice", choices=sorted(SETS), default=None,
                    help="the set whose choice it is (default: the other one)")
    ap.add_argument("--data-seed", type=int, default=0, help="the split of --to (data.seed; 0: the published one)")
    args = ap.parse_args(argv)
    got = cross_overrides(args.to, args.choice, args.data_seed)
    if got is None:
        raise SystemExit(f"no US-HASH search report of {args.choice or 'the other set'}: run python -m ushash.search "
                         "first")
    other, overrides = got
    cmd = [sys.executable, "-m", "ushash.sweep", "-m", f"experiment={SETS[args.to][0]}", *overrides]
    print(f"{other}'s choice on {args.to} (split {args.data_seed}): python -m ushash.sweep -m experiment={SETS[args.to][0]} {' '.join(overrides)}",
          flush=True)
    raise SystemExit(subprocess.call(cmd, cwd=ROOT))


if __name__ == "__main__":
    main()
