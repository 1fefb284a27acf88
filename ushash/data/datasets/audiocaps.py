"""AudioCaps: YouTube (AudioSet) clips with human captions, one per training clip, five per test clip.

Layout (the official CSVs from github.com/cdjkim/audiocaps, the audio fetched by you; see
docs/datasets.md):

    <root>/train.csv  val.csv  test.csv       audiocap_id,youtube_id,start_time,caption
    <root>/audio/train/<youtube_id>_<start_time>.wav   (or .flac / .ogg / .mp3; aac-datasets' naming)
    <root>/audio/val/...   <root>/audio/test/...

One audio row per clip: id and group = "<youtube_id>_<start_time>" (several CSV lines, i.e. captions,
share it); one text row per CSV line, id = audiocap_id. No labels; "paired" relevance. Clips that were
never downloaded (YouTube videos disappear: typically 5-10% of them) are bad rows at extraction: counted,
named in the report and skipped, while their captions stay (a text query without its clip scores 0 and
`n_no_relevant` says how many there were). Audio is mixed to mono and resampled to the encoder's rate.
"""

from __future__ import annotations

import os
from pathlib import Path

from ushash.data.datasets import SPLITS, listing, probe_files, register, resolve_path
from ushash.data.rows import Row
from ushash.data.textfiles import read_csv

AUDIO_EXTS = (".wav", ".flac", ".ogg", ".mp3")
COLUMNS = ("audiocap_id", "youtube_id", "start_time", "caption")
LAYOUT = ("expected layout: {root}/{{train,val,test}}.csv (audiocap_id,youtube_id,start_time,caption) and the "
          "clips in {root}/audio/{{train,val,test}}/<youtube_id>_<start_time>.wav (see docs/datasets.md, "
          "section AudioCaps)")


def _stems(folder: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    with os.scandir(folder) as it:
        for e in it:
            stem, ext = os.path.splitext(e.name)
            if ext.lower() in AUDIO_EXTS and (stem not in out or AUDIO_EXTS.index(ext.lower()) <
                                              AUDIO_EXTS.index(os.path.splitext(out[stem])[1].lower())):
                out[stem] = e.path
    return out


def rows(root: str | os.PathLike, split: str, csv_name: str = "{split}.csv", audio_dir: str = "audio/{split}",
         audio_name: str = "{youtube_id}_{start_time}") -> list[Row]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    root = Path(root).absolute()
    layout = LAYOUT.format(root=root)
    csv_path = root / csv_name.format(split=split)
    if not csv_path.is_file():
        raise FileNotFoundError(f"no {csv_path.name} under {csv_path.parent}; {layout}. {listing(root)}")
    audio = root / audio_dir.format(split=split)
    if not audio.is_dir():
        raise FileNotFoundError(f"no audio folder {audio}; {layout}. {listing(root)}")
    stems = _stems(audio)
    out: list[Row] = []
    clips: dict[str, int] = {}
    caps: dict[str, int] = {}
    paths: list[str] = []
    cols, records = read_csv(csv_path)
    if not set(COLUMNS) <= set(cols):
        raise ValueError(f"{csv_path}: expected columns {list(COLUMNS)}; found {cols}")
    for ln, rec in records:
        rec = {k: (v or "").strip() if k != "caption" else (v or "") for k, v in rec.items()}
        cid = rec["audiocap_id"]
        if cid in caps:
            raise ValueError(f"{csv_path}: audiocap_id {cid!r} is listed twice (lines {caps[cid]} and {ln}); ids "
                             f"must be unique")
        caps[cid] = ln
        clip = f"{rec['youtube_id']}_{rec['start_time']}"
        if clip not in clips:
            clips[clip] = ln
            stem = audio_name.format(**rec)
            path = stems.get(stem, str(audio / (stem + ".wav")))
            paths.append(path)
            out.append(Row("audio", clip, clip, path))
        out.append(Row("text", cid, clip, rec["caption"]))
    probe_files(paths, f"audiocaps/{split}", layout, "audio files", "audio folder")
    return out


@register("audiocaps")
def load(split: str, *, root: str = "data/audiocaps", csv_name: str = "{split}.csv",
         audio_dir: str = "audio/{split}", audio_name: str = "{youtube_id}_{start_time}") -> list[Row]:
    """Recipe for `load_rows("audiocaps", split, root=...)`; templates take CSV columns / {split}."""
    return rows(resolve_path(root), split, csv_name=csv_name, audio_dir=audio_dir, audio_name=audio_name)
