"""Clotho and AudioCaps recipes on tiny CSV + wav fixtures, the DCASE mAP@10 definition, end to end."""

import csv

import numpy as np
import pytest
import soundfile as sf

from ushash.data import media
from ushash.core import metrics
from ushash.config import compose
from ushash.data.datasets import load_rows
from ushash.evaluation.evaluate import run_eval
from ushash.data.extract import run_extract
from ushash.hashing.training import run_train

N_CLIPS = 13  # per split: retrieval.evaluate needs a database of at least k=10 items


def tone(path, i, sr=16000, seconds=0.5, channels=1, fmt=None):
    t = np.arange(int(sr * seconds)) / sr
    wave = 0.3 * np.sin(2 * np.pi * (220 + 40 * i) * t).astype(np.float32)
    data = np.stack([wave, 0.5 * wave], 1) if channels == 2 else wave
    sf.write(str(path), data, sr, format=fmt)


def clip_variants(folder, names, bad=True):
    """Clips at several rates, channel counts and lengths; with `bad`, also a corrupt, an empty, a missing one."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        p = folder / name
        if bad and i == 1:
            p.write_bytes(b"RIFF....WAVEfmt garbage")              # corrupt
        elif bad and i == 2:
            sf.write(str(p), np.zeros((0,), np.float32), 16000)   # a valid header with no samples
        elif bad and i == 3:
            continue                                                # missing
        else:
            sr, ch, sec = [(16000, 1, 0.5), (44100, 2, 2.5), (8000, 1, 0.2), (22050, 2, 1.0)][i % 4]
            tone(p, i, sr, sec, ch)


# --------------------------------------------------------------------------------------------- Clotho
PARTS = {"train": "development", "val": "validation", "test": "evaluation"}


def make_clotho(root):
    for split, part in PARTS.items():
        names = [f"{part}_clip {i:02d}.wav" for i in range(N_CLIPS)]
        clip_variants(root / part, names, bad=split == "test")
        with open(root / f"clotho_captions_{part}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["file_name"] + [f"caption_{j}" for j in range(1, 6)])
            for i, n in enumerate(names):
                caps = [f"a tone number {i}, take {j}" for j in range(1, 6)]
                if split == "test" and i == 4:
                    caps[2] = ""
                w.writerow([n] + caps)
    return root


@pytest.fixture(scope="module")
def clotho(tmp_path_factory):
    return make_clotho(tmp_path_factory.mktemp("clotho") / "clotho")


def test_clotho_rows(clotho, tmp_path):
    test = load_rows("clotho", "test", root=str(clotho))
    audio = [r for r in test if r.modality == "audio"]
    text = [r for r in test if r.modality == "text"]
    assert len(audio) == N_CLIPS and len(text) == 5 * N_CLIPS
    assert audio[0].id == audio[0].group == "evaluation_clip 00.wav"
    assert audio[0].source == str(clotho / "evaluation" / "evaluation_clip 00.wav")
    assert text[7].id == "evaluation_clip 01.wav#3" and text[7].group == "evaluation_clip 01.wav"
    with pytest.raises(FileNotFoundError, match=r"no clotho_captions_development.csv under .*expected layout"):
        load_rows("clotho", "train", root=str(tmp_path))
    (tmp_path / "development").mkdir()
    (tmp_path / "clotho_captions_development.csv").write_text("file_name,caption_1\na.wav,x\na.wav,y\n")
    with pytest.raises(ValueError, match=r"clip 'a.wav' is listed twice \(lines 2 and 3\)"):
        load_rows("clotho", "train", root=str(tmp_path))
    (tmp_path / "clotho_captions_development.csv").write_text("file_name,caption_1\na.wav,x\nb.wav,y\n")
    with pytest.raises(FileNotFoundError, match="none of the first 2 audio files exists"):
        load_rows("clotho", "train", root=str(tmp_path))


def test_dcase_map_at_10_is_reciprocal_rank_within_10():
    # DCASE language-based audio retrieval: one relevant clip per caption; AP@10 = 1/rank if rank <= 10 else 0.
    n_db, ranks = 30, [1, 2, 3, 7, 10, 11, 25]
    db_groups = np.arange(n_db)
    q_groups = np.arange(len(ranks))
    I = np.zeros((len(ranks), 10), np.int64)
    for q, r in enumerate(ranks):
        others = [d for d in range(n_db) if d != q]
        order = others[: r - 1] + [q] + others[r - 1:]
        I[q] = order[:10]
    rel, n_rel = metrics.relevance(I, q_groups, db_groups, "paired")
    assert (n_rel == 1).all()
    ap = metrics.average_precision_at_k(rel, n_rel, 10, denominator="min")
    np.testing.assert_allclose(ap, [1 / r if r <= 10 else 0.0 for r in ranks])
    rep = metrics.retrieval_report(I, q_groups, db_groups, "paired", k=10)
    assert rep["map@10"] == pytest.approx(np.mean([1 / r if r <= 10 else 0.0 for r in ranks]))


def run_all(tmp_path, data, *overrides):
    cfg = compose("config", [f"paths.root={tmp_path}", f"data={data}", "encoder=tiny", "encoder.modalities=[text,audio]",
                             "extract.num_workers=0", "extract.progress=false", "trainer.accelerator=cpu",
                             "trainer.max_epochs=2", "bits=16", "model.dim=16", "model.hidden=32",
                             "model.batch_size=8", "trainer.enable_progress_bar=false", *overrides])
    splits = run_extract(cfg)
    out = run_train(cfg, splits={"train": splits["train"], "val": splits["val"]})
    res = run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['last']}"]))
    return splits, res


def test_clotho_extract_train_eval(clotho, tmp_path):
    splits, res = run_all(tmp_path, "clotho", f"data.root={clotho}")
    test = splits["test"]
    rep = test.report
    assert rep["modalities"]["audio"] == {"rows": 13, "ok": 10, "failed": 3}
    assert rep["modalities"]["text"] == {"rows": 65, "ok": 64, "failed": 1}
    why = {f["id"]: f["reason"] for f in rep["failed"]}
    assert "cannot decode audio" in why["evaluation_clip 01.wav"]
    assert "empty audio" in why["evaluation_clip 02.wav"] or "empty file" in why["evaluation_clip 02.wav"]
    assert "file not found" in why["evaluation_clip 03.wav"] and "empty caption" in why["evaluation_clip 04.wav#3"]
    # any rate / channel count / length becomes the encoder's mono 16 kHz, 1 s input
    for name in ("evaluation_clip 05.wav", "evaluation_clip 06.wav"):  # 44.1 kHz stereo 2.5 s, 8 kHz 0.2 s
        wave = media.load_audio(clotho / "evaluation" / name, 16000, 1.0)
        assert wave.shape == (16000,) and wave.dtype == np.float32
    # DCASE: text->audio with one relevant clip per caption, denominator min
    t2a = next(r for r in res["rows"] if r["direction"] == "T→A" and r["kind"] == "codes")
    assert t2a["protocol"] == "paired" and t2a["denominator"] == "min"
    assert t2a["n_queries"] == 64 and t2a["n_no_relevant"] == 15  # the captions of the three bad clips
    a = test.tables["audio"]
    assert len(set(a.groups)) == len(a)  # one clip per group: n_rel is 1 for every answerable caption


@pytest.mark.parametrize("body, match", [
    ("file_name,caption_1,caption_2\nb.wav,an unquoted, comma caption,c2\n",
     r"clotho_captions_development\.csv:2: 4 fields where the header has 3"),
    ('file_name,caption_1,caption_2\nb.wav,"an unclosed quote,c2\nc.wav,x,y"\nd.wav,x,y\n',
     r"clotho_captions_development\.csv:\d: a value runs over several lines"),
    ('file_name,caption_1,caption_2\nb.wav,"an unclosed quote,c2\nc.wav,x,y\nd.wav,x,y\n',
     r"clotho_captions_development\.csv: unreadable CSV after line \d .*starts with a double quote"),
    ("file_name,caption_1,caption_2\nb.wav,a caption\n", r"csv:2: 2 fields where the header has 3"),
    ("file_name,caption_1\nb.wav,caf\xe9\n".encode("latin-1"),
     r"clotho_captions_development\.csv:2: not UTF-8 text .*save the file as UTF-8"),
])
def test_a_clotho_csv_read_otherwise_than_written_is_refused(tmp_path, body, match):
    """An unquoted comma shifted every caption of the clip one column on and dropped the last; an unclosed quote
    swallowed the next clips into one caption; a Latin-1 file raised a bare UnicodeDecodeError."""
    (tmp_path / "development").mkdir()
    f = tmp_path / "clotho_captions_development.csv"
    f.write_bytes(body) if isinstance(body, bytes) else f.write_text(body)
    with pytest.raises(ValueError, match=match):
        load_rows("clotho", "train", root=str(tmp_path))


# ------------------------------------------------------------------------------------------ AudioCaps
def make_audiocaps(root):
    per_clip = {"train": 1, "val": 2, "test": 5}
    n = 0
    for split, k in per_clip.items():
        folder = root / "audio" / split
        folder.mkdir(parents=True)
        with open(root / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["audiocap_id", "youtube_id", "start_time", "caption"])
            for i in range(N_CLIPS):
                yt = f"yt{split[:2]}{i:03d}-_x"
                if not (split == "test" and i == 0):  # never downloaded
                    tone(folder / f"{yt}_{30 * i}.{'flac' if i % 2 else 'wav'}", i, [16000, 32000][i % 2],
                         channels=1 + i % 2, fmt="FLAC" if i % 2 else None)
                for j in range(k):
                    n += 1
                    w.writerow([n, yt, 30 * i, f"sound {i} described {j}"])
    return root


def test_audiocaps_rows_and_end_to_end(tmp_path):
    root = make_audiocaps(tmp_path / "audiocaps")
    test = load_rows("audiocaps", "test", root=str(root))
    audio = [r for r in test if r.modality == "audio"]
    assert len(audio) == 13 and audio[1].id == "ytte001-_x_30" and audio[1].source.endswith("ytte001-_x_30.flac")
    text = [r for r in test if r.modality == "text"]
    assert len(text) == 65 and {r.group for r in text[:5]} == {"ytte000-_x_0"}
    assert len([r for r in load_rows("audiocaps", "train", root=str(root)) if r.modality == "text"]) == 13
    with pytest.raises(FileNotFoundError, match=r"no train.csv under .*expected layout"):
        load_rows("audiocaps", "train", root=str(tmp_path))
    splits, res = run_all(tmp_path, "audiocaps", f"data.root={root}")
    rep = splits["test"].report
    assert rep["modalities"]["audio"] == {"rows": 13, "ok": 12, "failed": 1}
    assert "file not found" in rep["failed"][0]["reason"] and rep["failed"][0]["id"] == "ytte000-_x_0"
    t2a = next(r for r in res["rows"] if r["direction"] == "T→A" and r["kind"] == "codes")
    assert t2a["n_queries"] == 65 and t2a["n_no_relevant"] == 5


def test_an_audiocaps_caption_with_an_unquoted_comma_is_refused(tmp_path):
    """"A man speaks, then a dog barks" unquoted was stored as "A man speaks" (the rest dropped unseen)."""
    (tmp_path / "audio" / "train").mkdir(parents=True)
    (tmp_path / "train.csv").write_text("audiocap_id,youtube_id,start_time,caption\n1,abc,30,A man speaks, then a "
                                        "dog barks\n")
    with pytest.raises(ValueError, match=r"train\.csv:2: 5 fields where the header has 4 .*quote values that hold a "
                                         r"comma"):
        load_rows("audiocaps", "train", root=str(tmp_path))
