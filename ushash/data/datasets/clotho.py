"""Clotho (v2.1) audio captioning data: five captions per clip, for language-based audio retrieval.

Layout (the Zenodo archives, unpacked; see docs/datasets.md):

    <root>/clotho_captions_development.csv   file_name,caption_1,...,caption_5
    <root>/clotho_captions_validation.csv
    <root>/clotho_captions_evaluation.csv
    <root>/development/<file_name>.wav       the clips (15-30 s, 44.1 kHz mono)
    <root>/validation/...  <root>/evaluation/...

Splits: "train" = development (3,839 clips), "val" = validation (1,045), "test" = evaluation (1,045).
One audio row per clip (id and group = its file name) and one text row per non-missing caption cell
(id "<file name>#<j>", j = 1..5), no labels. Relevance is "paired": a caption's only relevant clip is
its own, so text->audio mAP@10 with Z = min(10, 1) is the DCASE language-based audio retrieval metric
(1/rank of the clip if it is in the top 10, else 0). Audio is decoded by ushash.data.media: mixed down to
mono and resampled to the encoder's rate, then cropped/padded to its clip length.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ushash.data.datasets import SPLITS, listing, probe_files, register, resolve_path
from ushash.data.rows import Row
from ushash.data.textfiles import read_csv

PARTS = {"train": "development", "val": "validation", "test": "evaluation"}
CAPTION_COL = re.compile(r"caption_(\d+)$")
LAYOUT = ("expected layout: {root}/clotho_captions_{{development,validation,evaluation}}.csv and the clips in "
          "{root}/{{development,validation,evaluation}}/ (see docs/datasets.md, section Clotho)")


def rows(root: str | os.PathLike, split: str, captions_csv: str = "clotho_captions_{part}.csv",
         audio_dir: str = "{part}", captions_per_clip: int = 5) -> list[Row]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    root = Path(root).absolute()
    part = PARTS[split]
    layout = LAYOUT.format(root=root)
    csv_path = root / captions_csv.format(part=part, split=split)
    if not csv_path.is_file():
        raise FileNotFoundError(f"no {csv_path.name} under {root}; {layout}. {listing(root)}")
    audio = root / audio_dir.format(part=part, split=split)
    if not audio.is_dir():
        raise FileNotFoundError(f"no audio folder {audio}; {layout}. {listing(root)}")
    cols, records = read_csv(csv_path)
    caps = sorted((c for c in cols if CAPTION_COL.match(c)), key=lambda c: int(CAPTION_COL.match(c).group(1)))
    if "file_name" not in cols or not caps:
        raise ValueError(f"{csv_path}: expected columns file_name, caption_1 ... caption_5; found {cols}")
    out: list[Row] = []
    seen: dict[str, int] = {}
    paths: list[str] = []
    for ln, rec in records:
        name = (rec.get("file_name") or "").strip()
        if not name:
            raise ValueError(f"{csv_path}:{ln}: empty file_name")
        if name in seen:
            raise ValueError(f"{csv_path}: clip {name!r} is listed twice (lines {seen[name]} and {ln}); ids must be "
                             f"unique")
        seen[name] = ln
        path = str(audio / name)
        paths.append(path)
        out.append(Row("audio", name, name, path))
        for c in caps[: captions_per_clip or None]:
            text = rec.get(c)
            if text is not None:  # an empty cell stays: extraction names it as an empty caption
                out.append(Row("text", f"{name}#{CAPTION_COL.match(c).group(1)}", name, text))
    probe_files(paths, f"clotho/{split}", layout, "audio files", "audio folder")
    return out


@register("clotho")
def load(split: str, *, root: str = "data/clotho", captions_csv: str = "clotho_captions_{part}.csv",
         audio_dir: str = "{part}", captions_per_clip: int = 5) -> list[Row]:
    """Recipe for `load_rows("clotho", split, root=...)`; {part} is development / validation / evaluation."""
    return rows(resolve_path(root), split, captions_csv=captions_csv, audio_dir=audio_dir,
                captions_per_clip=captions_per_clip)
