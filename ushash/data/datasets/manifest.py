"""A generic manifest: bring your own image/text/audio data as one JSONL or CSV file.

Columns (JSONL keys or a CSV/TSV header row; other columns are ignored):
    image   path to an image file        } at least one of these three columns must exist;
    text    the caption itself           } any of them may be missing or empty in a given record
    audio   path to an audio file        }
    labels  class names: a JSON list in JSONL (["cat", "animal"]); "cat|animal" in CSV
    group   the pairing key; records sharing a group are each other's pairs (default: see below)
    id      optional stable record id, unique in the file (default: the record's line number)
    split   optional "train" / "val" / "test" ("validation", "valid" and "dev" mean "val")

Column names are lower case (a "Split" or "Image" column is refused, not read as another or left out).
Each record yields one row per modality it has, all with the record's id, group and labels. Relative
paths are taken from the manifest file's folder. When the same (group, source) occurs in several
records of a split (an image listed once per caption, COCO style), it becomes one row, with the first
record's id and the labels of all of them. Records without a group that share an image or audio file are
one group, named by the first such record's id: an image listed once per caption is one item, its captions
each other's pairs, without a group column; a group column value that is also the id of such a record is
refused (the two items would be one). A file is the file its path names with symbolic links resolved (one
file under two names is one file). Records with an empty split value, and all records when the manifest has no split column,
are split by a hash of their group (`val_frac`, `test_frac`, `seed`), so a group never straddles
splits; an ungrouped item named by a line number is hashed by its smallest file path (relative to the
manifest's folder), or its caption when it has no file, so adding or reordering lines moves no item to
another split. A group given explicit splits that disagree is an error, and so is one image or audio file
in two groups (two items of one file: each irrelevant to the other's pairs, or in two splits, a test item
in training). Paths are not checked here: a file
that is missing or fails to decode is dropped (and counted) at extraction, like any bad row. So is an
empty caption: a `text` that is only whitespace, or `""` in JSONL, is a text row that extraction
reports as "empty caption" (in CSV an empty cell means the record has no caption).

CSV/TSV values that hold the separator or start with a double quote must be quoted ("...", quotes inside
doubled): a record with more or fewer fields than the header, a value that runs over several lines (a quote
opened and read on through the next records) and a column named twice are refused with their line, since
the csv reader would otherwise cut the caption, shift values into other columns, swallow records or keep one
of the two columns (ushash/data/textfiles.py).

Give an `id` column if the file will be edited: line-number ids move when lines are inserted, and
ids key resumable feature extraction (a store of other ids is extracted again, not reused).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ushash import MODALITIES
from ushash.data.datasets import SPLITS, check_fracs, hash_split, register, resolve_path
from ushash.data.rows import Row
from ushash.data.textfiles import not_utf8, read_csv

SPLIT_ALIASES = {"validation": "val", "valid": "val", "dev": "val"}
FILE_MODALITIES = ("image", "audio")
FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv"}


def read_records(path: Path) -> tuple[list[tuple[int, dict]], list[str]]:
    """(line number, record) pairs and the column names of a JSONL or CSV/TSV manifest."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"manifest {path}: unknown format {path.suffix!r}; use one of {sorted(FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"manifest {path} not found")
    records: list[tuple[int, dict]] = []
    if fmt == "jsonl":
        columns: dict[str, None] = {}
        with open(path, encoding="utf-8-sig") as f:
            try:
                for ln, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"manifest {path}:{ln}: invalid JSON ({e.msg})") from e
                    except RecursionError:  # nesting deeper than the parser's stack: no manifest needs it
                        raise ValueError(f"manifest {path}:{ln}: JSON nested too deeply; a record is a flat object "
                                         f"of strings (and a list of labels)") from None
                    except ValueError as e:   # an integer past Python's digit limit
                        raise ValueError(f"manifest {path}:{ln}: invalid JSON ({e}); write ids as strings") from None
                    if not isinstance(rec, dict):
                        raise ValueError(f"manifest {path}:{ln}: expected a JSON object, got {type(rec).__name__}")
                    columns.update(dict.fromkeys(rec))
                    records.append((ln, rec))
            except UnicodeDecodeError as e:
                raise not_utf8(path, e, "manifest") from None
        return records, list(columns)
    header, records = read_csv(path, "\t" if fmt == "tsv" else ",", what="manifest", hint=", or use JSONL")
    return records, header


def _text(value, path: Path, ln: int, col: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"manifest {path}:{ln}: column {col!r} must be a string, got {value!r:.80}")
    if col not in MODALITIES:   # an id, group or split is written to the store's JSON and hashed as UTF-8; a
        try:                    # caption is not (one that is not text is a failed row, counted and reported)
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"manifest {path}:{ln}: column {col!r} holds a lone surrogate ({value[e.start]!r}: "
                             f"half of a character such as an emoji); fix that value") from None
    return value.strip() or None


def parse_labels(value, path: Path, ln: int) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        items = value.split("|")
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
            raise ValueError(f"manifest {path}:{ln}: labels must be strings, got {value!r:.80}")
        items = [str(v) for v in value]
    else:
        raise ValueError(f"manifest {path}:{ln}: labels must be a list (JSONL) or 'a|b' (CSV), got {value!r:.80}")
    return tuple(dict.fromkeys(s.strip() for s in items if s.strip()))


def rows(path: str | os.PathLike, split: str, split_col: str | None = "split", val_frac: float = 0.1,
         test_frac: float = 0.1, seed: int = 0) -> list[Row]:
    """Rows of one split of the manifest at `path` (absolute, or relative to the working directory)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    check_fracs(val_frac, test_frac)
    path = Path(path)
    records, columns = read_records(path)
    known = {*MODALITIES, "labels", "group", "id", split_col or "split"}
    cased = [c for c in columns if c not in known and c.strip().lower() in known]
    if cased:   # read as another column's name, or not at all (a "Split" column would leave the hash split)
        raise ValueError(f"manifest {path}: column(s) {cased} are read only in lower case; rename them to "
                         f"{[c.strip().lower() for c in cased]}")
    if not any(m in columns for m in MODALITIES):
        raise ValueError(
            f"manifest {path}: no modality column; need at least one of {list(MODALITIES)}, found {columns}"
        )
    if split_col and split_col not in columns and split_col != "split":
        raise ValueError(f"manifest {path}: split column {split_col!r} not found; columns are {columns}")
    use_split_col = bool(split_col) and split_col in columns
    base = path.absolute().parent

    ids: dict[str, int] = {}
    dups: list[str] = []
    group_split: dict[str, tuple[str, int]] = {}
    seen: dict[tuple[str, str, str], int] = {}   # a row's key -> its position in out
    out: list[Row] = []
    keyed = []
    given_ids: set[str] = set()
    for ln, rec in records:
        rid = _text(str(rec["id"]) if isinstance(rec.get("id"), int) else rec.get("id"), path, ln, "id")
        explicit = rid is not None
        rid = rid or str(ln)
        if rid in ids:
            dups.append(f"{rid!r} (lines {ids[rid]} and {ln})")
        ids.setdefault(rid, ln)
        group = _text(str(rec["group"]) if isinstance(rec.get("group"), int) else rec.get("group"), path, ln, "group")
        values = {m: _text(rec.get(m), path, ln, m) for m in MODALITIES}  # validated in every split
        paths = {m: os.path.normpath(base / Path(values[m]).expanduser()) for m in FILE_MODALITIES if values[m]}
        keyed.append((ln, rec, rid, group, values, paths))
        if explicit:
            given_ids.add(rid)
    named = {rid: ln for ln, _, rid, group, _, _ in keyed if group is None}
    clash = next(((ln, g) for ln, _, _, g, _, _ in keyed if g is not None and g in named), None)
    if clash:   # an ungrouped record's group is named by its id (or its file's first record's): one namespace
        raise ValueError(f"manifest {path}:{clash[0]}: group {clash[1]!r} is also the id of the record on line "
                         f"{named[clash[1]]}, which has no group and so names its own: the two would be one "
                         f"item; give that record a group, or use group names that are not record ids")
    real = _real_paths()
    file_group = _groups_by_file([(rid, [real(p) for p in paths.values()]) for _, _, rid, group, _, paths in keyed
                                  if group is None])
    # an ungrouped item named by a line number is split by a hash of its smallest file path (relative to the
    # manifest's folder) or its caption: a line number moves when lines are added or reordered, and with it the
    # item's split (a test item of one version of the manifest in training in the next)
    home = os.path.realpath(base)
    by_files: dict[str, str] = {}
    for f, g in file_group.items():
        by_files[g] = min(by_files.get(g, f"file:{os.path.relpath(f, home)}"), f"file:{os.path.relpath(f, home)}")
    file_owner: dict[str, tuple[str, int]] = {}
    for ln, rec, rid, group, values, paths in keyed:
        files = [real(p) for p in paths.values()]   # a file linked under two names is one file
        split_key = group
        if group is None:
            group = file_group[files[0]] if files else rid
            split_key = group if group in given_ids else by_files.get(group, f"text:{values['text'] or ''}")
        for f in files:
            owner = file_owner.setdefault(f, (group, ln))
            if owner[0] != group:
                raise ValueError(
                    f"manifest {path}:{ln}: file {f!r} is in group {group!r} here but {owner[0]!r} on line {owner[1]}; "
                    "one file is one item (as two, each would count as irrelevant to the other's pairs, or sit in "
                    "two splits): give its records one group, or none (records sharing a file are one item)"
                )
        labels = parse_labels(rec.get("labels"), path, ln)

        s = _text(rec.get(split_col), path, ln, split_col) if use_split_col else None
        if s is None:
            s = hash_split(split_key, seed, val_frac, test_frac)
        else:
            s = SPLIT_ALIASES.get(s.lower(), s.lower())
            if s not in SPLITS:
                raise ValueError(
                    f"manifest {path}:{ln}: unknown split {rec.get(split_col)!r}; expected one of {SPLITS}"
                )
        prev = group_split.setdefault(group, (s, ln))
        if prev[0] != s:
            raise ValueError(
                f"manifest {path}:{ln}: group {group!r} is in split {s!r} here but {prev[0]!r} on line {prev[1]}; "
                "a group's pairs must share a split"
            )
        if s != split:
            continue
        raw_text = rec.get("text")
        if values["text"] is None and isinstance(raw_text, str) and (raw_text or FORMATS[path.suffix.lower()] == "jsonl"):
            values["text"] = ""  # an empty caption: a row, so extraction counts and reports it
        for m, v in values.items():
            if v is None:
                continue
            source = paths[m] if m in FILE_MODALITIES else v
            key = (m, group, real(source) if m in FILE_MODALITIES else source)
            if key in seen:   # the same file or caption of the item on another record: one row, every label
                i = seen[key]
                if not set(labels) <= set(out[i].labels):
                    out[i] = dataclasses.replace(out[i], labels=tuple(dict.fromkeys(out[i].labels + labels)))
                continue
            seen[key] = len(out)
            try:
                out.append(Row(m, rid, group, source, labels))
            except ValueError as e:  # a NUL character in an id, group or value
                raise ValueError(f"manifest {path}:{ln}: {e}") from None
    if dups:
        raise ValueError(f"manifest {path}: {len(dups)} duplicate ids, e.g. {', '.join(dups[:5])}")
    return out


def _real_paths():
    """path -> the file it names with symbolic links resolved (so one file listed under two names, through a link,
    is one file), its folder's resolution cached: one lstat per file, not one per path component."""
    folders: dict[str, str] = {}
    files: dict[str, str] = {}

    def real(p: str) -> str:
        if p not in files:
            d, name = os.path.split(p)
            if d not in folders:
                folders[d] = os.path.realpath(d)
            full = os.path.join(folders[d], name)
            files[p] = os.path.realpath(full) if os.path.islink(full) else full
        return files[p]

    return real


def _groups_by_file(records: list[tuple[str, list[str]]]) -> dict[str, str]:
    """The group of each file of records that name no group: records sharing a file, directly or through
    others, are one group, named by the id of its first record (union-find over the files)."""
    parent: dict[str, str] = {}

    def root(f: str) -> str:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    first: dict[str, tuple[int, str]] = {}  # a set's root -> (position, id) of its first record
    for i, (rid, files) in enumerate(records):
        for f in files:
            if f not in parent:
                parent[f] = f
                first[f] = (i, rid)
        for f in files[1:]:
            a, b = root(files[0]), root(f)
            if a != b:
                a, b = (a, b) if first[a] < first[b] else (b, a)
                parent[b] = a
    return {f: first[root(f)][1] for f in parent}


@register("manifest")
def load(split: str, *, path: str | None = None, split_col: str | None = "split", val_frac: float = 0.1,
         test_frac: float = 0.1, seed: int = 0) -> list[Row]:
    """Recipe for `load_rows("manifest", split, path=...)`; a relative `path` is taken from the repo root."""
    if path in (None, "", "???"):
        raise ValueError("dataset 'manifest' needs a path: set data.path=/path/to/manifest.jsonl (or .csv)")
    return rows(resolve_path(path), split, split_col=split_col, val_frac=val_frac, test_frac=test_frac, seed=seed)
