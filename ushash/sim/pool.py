"""The request pool: every request the stream can make, grouped in equivalence classes.

A class is one item (a feature-store or dataset `group`); its members are the item's rows in every
modality plus their variants (ushash/sim/augment.py). Each member carries its features (what the
semantic caches see) and its exact-cache key (sha256 of the normalised input).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field

import numpy as np

from ushash.config import to_dict
from ushash.sim.augment import CAPTION_VARIANTS, add_noise, caption_variant, jpeg_crop, perturb_features


@dataclass
class Pool:
    """Every request the stream can make: its modality, features, class and the exact-cache key."""

    modality: list[str] = field(default_factory=list)
    features: list[np.ndarray] = field(default_factory=list)
    cls: list[int] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)     # "original", "perturbed", "jpeg+crop", "noised", "recased"
    key: list[bytes] = field(default_factory=list)    # exact-key cache key (sha256 of the normalised input)
    source: list[bytes] = field(default_factory=list)  # exact key of the input a member is a variant of (its own for an original)
    variant_note: str = ""

    def add(self, modality, feats, cls, kind, key, source=None):
        self.modality.append(modality)
        self.features.append(np.asarray(feats, np.float32))
        self.cls.append(int(cls))
        self.kind.append(kind)
        self.key.append(key)
        self.source.append(key if source is None else source)

    def source_ids(self) -> np.ndarray:
        """An int per member naming its source input: members of one source are variants of one input.

        A served entry is equivalent to the request (a correct hit) when their classes are equal *or* their
        sources are: the same input under two items (e.g. one caption shared by two stamps) gets the same
        answer from any deterministic model, so serving one item's answer to the other's identical input
        (or a variant of it) is not a false hit. Without this every cache, an exact-key cache included, is
        charged for the data set's duplicate inputs."""
        ids: dict[bytes, int] = {}
        return np.array([ids.setdefault(k, len(ids)) for k in self.source], np.int64)

    def __len__(self):
        return len(self.cls)

    def digest(self) -> str:
        """16 hex digits over every member (modality, features, class, kind, exact key, source): what a replay of
        this pool is computed from, whichever feature store or media it was built from."""
        h = hashlib.blake2b(digest_size=8)
        for m, x, c, k, key, src in zip(self.modality, self.features, self.cls, self.kind, self.key, self.source):
            for part in (m.encode(), np.ascontiguousarray(x, np.float32).tobytes(), str(c).encode(), k.encode(), key, src):
                h.update(len(part).to_bytes(8, "little"))
                h.update(part)
        return h.hexdigest()

    def counts(self, attr: str) -> dict[str, int]:
        """How many members have each value of `attr` ("kind" or "modality"), in sorted order."""
        values = getattr(self, attr)
        return {k: int(sum(1 for x in values if x == k)) for k in sorted(set(values))}


def feature_key(modality: str, x: np.ndarray) -> bytes:
    """Exact key of a feature vector: modality + the L2-normalised vector rounded to 1e-4."""
    n = np.linalg.norm(x)
    v = np.round(x / (n if n > 0 else 1.0), 4).astype(np.float32)
    return hashlib.sha256(modality.encode() + b"\0" + v.tobytes()).digest()


def text_key(s: str) -> bytes:
    """Exact key of a caption: lower-cased, whitespace collapsed, trailing punctuation dropped."""
    t = " ".join(s.lower().split()).rstrip(".!?")
    return hashlib.sha256(b"text\0" + t.encode()).digest()


def bytes_key(data: bytes) -> bytes:
    """Exact key of a medium: sha256 of its encoded bytes."""
    return hashlib.sha256(data).digest()


def pool_from_split(split, perturb: int = 2, noise: float = 0.1, seed: int = 0) -> Pool:
    """Classes = groups of a feature-store split; members = rows + feature-space perturbations."""
    rng = np.random.default_rng(seed)
    groups = sorted(set().union(*(set(t.groups) for t in split.tables.values())))
    gid = {g: i for i, g in enumerate(groups)}
    pool = Pool(variant_note=f"feature-space perturbation: {perturb} copies of every row with Gaussian noise "
                             f"of norm {noise} x the row's norm (simulates re-encoded/cropped images and "
                             f"re-recorded/noised sounds; raw media not used)")
    for m, t in split.tables.items():
        x = np.asarray(t.x, np.float32)
        for i in range(len(x)):
            c = gid[t.groups[i]]
            src = feature_key(m, x[i])
            pool.add(m, x[i], c, "original", src)
            for _ in range(perturb):
                xp = perturb_features(x[i], rng, noise)
                pool.add(m, xp, c, "perturbed", feature_key(m, xp), src)
    return pool


def media_members(modality: str, raw, cls: int, n_variants: int, rng: np.random.Generator, jpeg_quality: int,
                  crop_frac: float, snr_db: float, captions=("recased",)) -> list[tuple[str, object, int, str, bytes, bytes]]:
    """A decoded medium and its `n_variants` transformations: (modality, medium, class, kind, exact key,
    the original's exact key). A caption gets `n_variants` of each kind in `captions`
    (ushash.sim.augment.CAPTION_VARIANTS)."""
    out = _media_members(modality, raw, cls, n_variants, rng, jpeg_quality, crop_frac, snr_db, captions)
    return [(*m, out[0][4]) for m in out]


def _media_members(modality, raw, cls, n_variants, rng, jpeg_quality, crop_frac, snr_db, captions):
    if modality == "text":
        return [("text", raw, cls, "original", text_key(raw))] + [
            ("text", v, cls, kind, text_key(v)) for kind in captions
            for v in (caption_variant(raw, kind, k, rng) for k in range(n_variants))]
    if modality == "image":
        buf = io.BytesIO()
        raw.save(buf, format="PNG")
        out = [("image", raw, cls, "original", bytes_key(buf.getvalue()))]
        for _ in range(n_variants):
            img, jpeg = jpeg_crop(raw, rng, crop_frac, jpeg_quality)
            out.append(("image", img, cls, "jpeg+crop", bytes_key(jpeg)))
        return out
    out = [("audio", raw, cls, "original", bytes_key(raw.tobytes()))]
    for _ in range(n_variants):
        noisy = add_noise(raw, rng, snr_db)
        out.append(("audio", noisy, cls, "noised", bytes_key(noisy.tobytes())))
    return out


def pool_from_media(rows, encoder, n_variants: int = 1, jpeg_quality: int = 40, crop_frac: float = 0.8,
                    snr_db: float = 20.0, seed: int = 0, batch: int = 32, captions=("recased",),
                    name: str = "the rows") -> Pool:
    """Classes = groups of dataset rows; members = the decoded media and real transformations of them,
    all encoded with `encoder` (the export's frozen encoder). Rows whose media do not decode are skipped;
    none left is a ValueError naming `name` (e.g. "tuxpaint split test") and why."""
    from ushash.data import media

    rng = np.random.default_rng(seed)
    gid = {g: i for i, g in enumerate(sorted({r.group for r in rows}))}
    pool = Pool(variant_note=f"raw media through the encoder: images JPEG q={jpeg_quality} re-encoded and "
                             f"cropped at a random place to {crop_frac:.0%} of each side; sounds at -6 dB gain with "
                             f"white noise {snr_db} dB below the original's power; captions: " + ", ".join(
                                 f"{k} ({CAPTION_VARIANTS[k][1]}; {'changes' if CAPTION_VARIANTS[k][0] else 'keeps'} "
                                 f"the MiniLM encoding)" for k in captions) + f"; {n_variants} of each")
    items: list[tuple[str, object, int, str, bytes]] = []
    failed: list[str] = []
    for r in rows:
        try:
            raw = media.load(r.modality, r.source, sample_rate=encoder.sample_rate, seconds=encoder.audio_seconds)
        except media.MediaError as e:
            failed.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        items += media_members(r.modality, raw, gid[r.group], n_variants, rng, jpeg_quality, crop_frac, snr_db,
                               captions)
    for m in ("image", "text", "audio"):
        sel = [it for it in items if it[0] == m]
        if m not in encoder.modalities:
            continue
        for s in range(0, len(sel), batch):
            chunk = sel[s:s + batch]
            xb = encoder.collate(m, [encoder.preprocess(m, it[1]) for it in chunk])
            f = encoder.encode(m, xb).float().cpu().numpy()
            for it, fx in zip(chunk, f):
                pool.add(m, fx, it[2], it[3], it[4], it[5])
    if not len(pool):
        why = ("it has no rows" if not rows else
               f"every one of its {len(rows)} rows failed to decode (first: {failed[0]})" if len(failed) == len(rows)
               else f"no row that decoded is of a modality the encoder reads ({', '.join(encoder.modalities)})")
        raise ValueError(f"no request can be made from {name}: {why}")
    return pool


def build_pool(cfg, head) -> tuple[Pool, str]:
    """The pool of the configured split (features, or raw media with `raw_media`) and the dataset's name."""
    src = head.manifest.get("source") or {}
    data = to_dict(cfg.get("data")) if cfg.get("data") is not None else {}
    named = data.pop("name", None)  # data=<recipe> names its dataset (configs/data/<recipe>.yaml; data.name=mine)
    if cfg.get("dataset") and named and cfg.dataset != named:
        raise ValueError(f"dataset={cfg.dataset} but data.name={named}: name one dataset")
    dataset = cfg.get("dataset") or named or src.get("dataset")
    recipe = data.pop("recipe", None) or dataset  # a manifest names itself, the recipe that reads it stays
    if not dataset:
        raise ValueError("the export does not name its dataset; pass dataset=<name>")
    v = cfg.variants
    if cfg.raw_media:
        from ushash.data.datasets import load_rows
        from ushash.serving.cache.request import QueryEncoder
        rows = load_rows(recipe, str(cfg.split), **data)
        encoder = QueryEncoder(head).encoder()
        return pool_from_media(rows, encoder, n_variants=int(v.perturb), jpeg_quality=int(v.jpeg_quality),
                               crop_frac=float(v.crop_frac), snr_db=float(v.snr_db), seed=int(cfg.stream.seed),
                               captions=tuple(v.get("captions") or ("recased",)),
                               name=f"{dataset} split {cfg.split}"), dataset
    from ushash.data.extract import resolve_features_dir, stored_split
    from ushash.data.store import encoder_precision
    # the features of the precision the head was trained on (the export's source records it)
    prov = {**src, "dataset": dataset, "encoder": {"name": head.encoder.name, "fingerprint": head.encoder.fingerprint,
                                                   "precision": encoder_precision(src.get("encoder") or {})}}
    if cfg.get("data") is not None:  # data settings given here (data.path=... of a manifest) list the rows
        prov["data"] = {**(src.get("data") or {}), **to_dict(cfg.data)}
    split = stored_split(prov, str(cfg.split), resolve_features_dir(prov, cfg))
    return pool_from_split(split, perturb=int(v.perturb), noise=float(v.noise), seed=int(cfg.stream.seed)), dataset
