"""Dataset recipes: `load_rows(name, split, **cfg) -> list[Row]`, one module per dataset.

A recipe is a function `fn(split, *, key=default, ...) -> list[Row]` registered under a name with
`@register(name)`; its keyword arguments are the dataset's config keys (configs/data/<name>.yaml,
flat, so `data.<key>=...` overrides reach it). Splits are "train", "val" and "test".

Relative paths in a dataset config are resolved against the repository root (`resolve_path`), never
against the working directory.
"""

from __future__ import annotations

import hashlib
import inspect
import os
from pathlib import Path
from typing import Callable

from ushash.config import ROOT
from ushash.core.registry import Registry, import_all
from ushash.data.rows import Row, check_unique

SPLITS = ("train", "val", "test")
REPO_ROOT = ROOT  # paths in dataset configs hang off the repository

Recipe = Callable[..., list[Row]]
DATASETS = Registry("dataset", "ushash/data/datasets")
EXTRA_SPLITS: dict[str, tuple[str, ...]] = {}  # e.g. the hashing protocol's retrieval "database"


def register(name: str, extra_splits: tuple[str, ...] = ()) -> Callable[[Recipe], Recipe]:
    """Decorator: make `fn(split, **cfg)` available as `load_rows(name, split, **cfg)`."""

    def deco(fn: Recipe) -> Recipe:
        DATASETS.add(name, fn)
        EXTRA_SPLITS[name] = tuple(extra_splits)
        return fn

    return deco


def config_keys(name: str) -> tuple[str, ...]:
    """The config keys dataset `name` accepts (its recipe's keyword arguments)."""
    params = inspect.signature(_recipe(name)).parameters
    return tuple(k for k in params if k != "split")


def load_rows(name: str, split: str, **cfg) -> list[Row]:
    """The rows of one split of dataset `name`; raises on unknown names/keys and on empty splits."""
    fn = _recipe(name)
    known = SPLITS + EXTRA_SPLITS.get(name, ())
    if split not in known:
        raise ValueError(f"dataset {name!r}: unknown split {split!r}; expected one of {known}")
    allowed = config_keys(name)
    unknown = sorted(set(cfg) - set(allowed))
    if unknown:
        raise TypeError(f"dataset {name!r}: unknown config keys {unknown}; it accepts {sorted(allowed)}")
    rows = fn(split, **cfg)
    if not rows:
        found = {s: len(fn(s, **cfg)) for s in SPLITS if s != split}
        where = ", ".join(f"{s}: {n} rows" for s, n in found.items())
        others = ",".join(s for s in SPLITS if found.get(s))
        raise ValueError(
            f"dataset {name!r} split {split!r} is empty (other splits: {where}); "
            f"check the data location and split fractions in {cfg}, or, for a data set without that split, "
            f"name the others: extract.splits=[{others}]"
        )
    check_unique(rows, f"dataset {name!r} split {split!r}")
    return rows


def resolve_path(p: str | Path) -> Path:
    """An absolute path: `~` expanded, relative paths taken from the repository root (not the cwd)."""
    q = Path(p).expanduser()
    return q if q.is_absolute() else REPO_ROOT / q


#: Media files checked at load time: none of them existing means a wrong root (or media folder).
PROBE = 20


def listing(root: Path) -> str:
    """What `root` holds (its first 12 names), for error messages."""
    if not root.is_dir():
        return f"{root} does not exist"
    names = sorted(q.name for q in root.iterdir())
    return f"{root} holds {names[:12]}{' ...' if len(names) > 12 else ''}"


def probe_files(paths: list[str], what: str, layout: str, items: str, folder: str) -> None:
    """Raise when none of the first PROBE paths exists: the root (or the `folder` setting) is wrong.
    `items` names the files in the message ("images", "audio files")."""
    sample = paths[:PROBE]
    if sample and not any(os.path.isfile(p) for p in sample):
        raise FileNotFoundError(f"{what}: none of the first {len(sample)} {items} exists, e.g. {sample[0]}; "
                                f"is the root or {folder} wrong? {layout}")


def fetched(folder: Path, root: Path, allow_fetch: bool, fetch: Callable[[Path], object], dataset: str) -> Path:
    """`folder` (under `root`), fetching the dataset into `root` first when it is missing and allowed."""
    if not folder.is_dir():
        if not allow_fetch:
            raise FileNotFoundError(f"{folder} not found and fetch=False; run "
                                    f"ushash.data.datasets.{dataset}.fetch({str(root)!r})")
        fetch(root)
    return folder


def hash_split(key: str, seed: int, val_frac: float, test_frac: float) -> str:
    """Deterministic split of one item from a hash of its key and the seed.

    Each key's split depends on that key alone, so adding or removing items never moves others.
    """
    check_fracs(val_frac, test_frac)
    h = hashlib.sha256(f"{seed}\x00{key}".encode("utf-8")).digest()
    u = int.from_bytes(h[:8], "big") / 2.0**64  # uniform in [0, 1)
    if u < test_frac:
        return "test"
    if u < test_frac + val_frac:
        return "val"
    return "train"


def check_fracs(val_frac: float, test_frac: float) -> None:
    if not (0 <= val_frac < 1 and 0 <= test_frac < 1 and val_frac + test_frac < 1):
        raise ValueError(
            f"val_frac={val_frac} and test_frac={test_frac} must each be in [0, 1) and sum to less than 1"
        )


def _recipe(name: str) -> Recipe:
    if name not in DATASETS:  # dataset names are exact (they name feature-store folders)
        raise DATASETS.unknown(name)
    return DATASETS[name]


# Every module of this package is imported: the ones that register themselves fill the registry.
import_all(__name__, __path__)  # noqa: E402
