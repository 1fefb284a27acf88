"""Reading the text files data sets come as (CSV/TSV tables, JSON), with errors that name the file, the line and
the fix instead of a bare decoder error or a caption silently cut.

    header, records = read_csv(path)            # [(line number, {column: value})], every record checked
    data = read_json(path)                      # json.loads of the file, UTF-8 (a BOM allowed)

The csv module reads a malformed table without complaint: an unquoted separator inside a value shifts the
fields after it (and a record's last fields are dropped), a record with fewer fields than the header leaves
the last columns empty, a value that starts with a double quote is read on through the next records to the
next quote, and of a column named twice only the last is kept. `read_csv` refuses each with its line.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

QUOTING = "quote values that hold {sep} (\"...\", quotes inside doubled)"


def not_utf8(path: Path, e: UnicodeDecodeError, what: str = "") -> ValueError:
    """The error for a file that is not UTF-8, naming its first line that is not (the decoder fails on a block
    of the file, not a line). `what` names the file in the message ("manifest")."""
    name, kind = (f"{what} {path}", what) if what else (str(path), "file")
    with open(path, "rb") as f:
        for ln, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                return ValueError(f"{name}:{ln}: not UTF-8 text ({bad.reason} at byte {bad.start + 1} of the line); "
                                  f"save the {kind} as UTF-8")
    return ValueError(f"{name}: not UTF-8 text ({e.reason}); save the {kind} as UTF-8")


def read_json(path: Path, what: str = ""):
    """The JSON value of a UTF-8 file (a byte-order mark allowed); not UTF-8: ValueError naming the line. Invalid
    JSON raises json.JSONDecodeError as json.loads does (the caller says what the file should have been)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise not_utf8(Path(path), e, what) from None
    return json.loads(text)


def read_csv(path: Path, delimiter: str = ",", what: str = "", hint: str = "") -> tuple[list[str], list[tuple[int, dict]]]:
    """(header, [(line number, record)]) of a CSV (or, with delimiter "\\t", TSV) file with a header row: column
    names stripped, records with no value in any column left out, values as read (None for none). Refused
    with the line (ValueError): a column named twice, a record with more or fewer fields than the header, a
    value running over several lines, a file that is not UTF-8 or the csv module cannot read. `what` names the
    file in messages ("manifest"), `hint` is added to the advice on quoting (", or use JSONL")."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    tab = delimiter == "\t"
    kind = "TSV" if tab else "CSV"
    quoting = QUOTING.format(sep="a tab" if tab else "a comma") + hint
    records: list[tuple[int, dict]] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter, strict=True)
        try:
            header = [c.strip() for c in (reader.fieldnames or [])]
            twice = sorted({c for c in header if header.count(c) > 1})
            if twice:   # DictReader keeps the last of two columns of one name: the other would be lost unseen
                raise ValueError(f"{name}:1: column {twice[0]!r} appears more than once in the header; give each "
                                 f"column its own name")
            reader.fieldnames = header
            for rec in reader:
                ln = reader.line_num
                extra = [v for v in rec.get(None) or () if v.strip()]
                rec = {k: v for k, v in rec.items() if k is not None}
                if extra:   # an unquoted separator inside a value: DictReader would drop what follows it
                    raise ValueError(f"{name}:{ln}: {len(header) + len(extra)} fields where the header has "
                                     f"{len(header)} (extra {extra[0]!r:.40}): {quoting}")
                if any("\n" in v or "\r" in v for v in rec.values() if v):
                    # a value opened with a quote is read on, through the next records, to the next quote
                    raise ValueError(f"{name}:{ln}: a value runs over several lines (one that starts with a double "
                                     f"quote is read as quoted up to the next one): {quoting}")
                if all(v in (None, "") for v in rec.values()):
                    continue
                given = sum(v is not None for v in rec.values())
                if given < len(header):   # DictReader leaves the last columns None: values land one column early
                    raise ValueError(f"{name}:{ln}: {given} fields where the header has {len(header)} (no value for "
                                     f"{[k for k, v in rec.items() if v is None][0]!r}): write an empty field for a "
                                     f"missing value ({'tabs' if tab else 'commas'} up to the last "
                                     f"column), and {quoting}")
                records.append((ln, rec))
        except UnicodeDecodeError as e:
            raise not_utf8(path, e, what) from None
        except csv.Error as e:  # a field over csv.field_size_limit(), a NUL byte in older Pythons ...
            raise ValueError(f"{name}: unreadable {kind} after line {reader.line_num} ({e}; a value that starts "
                             f"with a double quote is read as quoted: {quoting})") from None
    return header, records
