"""python -m ushash.cachesim export=exports/<name> [split=test] [stream.n_requests=20000] [stream.zipf_s=1.0]

The semantic-cache workload evaluation (docs/cache.md, "Semantic cache evaluation" protocol):

1. Equivalence classes: one per item (feature-store `group`) of the split. Its members are the item's
   rows in every modality (an image, its captions, its sound), plus variants:
   - pre-extracted features (default): `variants.perturb` copies of every row with Gaussian noise of
     relative norm `variants.noise` added in feature space, a stand-in for re-encoded / cropped images
     and re-recorded / noised sounds when the raw media are not used (named "feature-space perturbation"
     in the report);
   - `raw_media=true`: the dataset's media are loaded (ushash.data.datasets) and really transformed, then
     encoded with the export's frozen encoder: images JPEG re-encoded at `jpeg_quality` and centre-
     cropped to `crop_frac`; sounds with white noise at `snr_db` and a -6 dB gain; captions also with
     their case and punctuation changed.
2. A stream of `n_requests`: a class drawn from a Zipf law of skew `zipf_s` over a random ranking of
   classes, then one of its members uniformly. The stream has a clock (`seconds_per_request`), so TTLs
   act, and the head's revision changes at `revision_change_at` of the stream.
3. Replay: each request looks up the cache; a hit is correct when the entry's class is the request's,
   a false hit otherwise (its wrong answer is served); a miss computes the answer (the class) and stores
   it. Reported: hit rate, false-hit rate per request and per hit, oracle hit rate (requests whose class
   was requested before: the best any cache can do), misses whose nearest cached entry had the right
   class, stale hits (served from an entry of an older revision or past its expiry), lookup latency
   p50/p99 (codes precomputed: cache work only), bytes used.
4. Methods on the same stream: an exact-key cache (sha256 of the normalised input), a float-embedding
   cosine-threshold cache like GPTCache / RedisVL (the head's float z, faiss IndexFlatIP, cosine >=
   threshold), LSH codes of the same z (random hyperplanes, same bits) and US-HASH codes, each with and
   without the payload check. A sweep over the radius (thresholds for the float cache, and the payload
   threshold at the configured radius) is plotted as hit rate against false-hit rate.

Writes results.json, results.md and sweep.png to experiments/cachesim/<name>/ (or `out`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, to_dict

TENANT = "sim"


# ---------------------------------------------------------------------------------------------- pool
@dataclass
class Pool:
    """Every request the stream can make: its modality, features, class and the exact-cache key."""

    modality: list[str] = field(default_factory=list)
    features: list[np.ndarray] = field(default_factory=list)
    cls: list[int] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)     # "original", "paired", "perturbed", "jpeg+crop", ...
    key: list[bytes] = field(default_factory=list)    # exact-key cache key (sha256 of the normalised input)
    variant_note: str = ""

    def add(self, modality, feats, cls, kind, key):
        self.modality.append(modality)
        self.features.append(np.asarray(feats, np.float32))
        self.cls.append(int(cls))
        self.kind.append(kind)
        self.key.append(key)

    def __len__(self):
        return len(self.cls)


def _feature_key(modality: str, x: np.ndarray) -> bytes:
    """Exact key of a feature vector: modality + the L2-normalised vector rounded to 1e-4."""
    n = np.linalg.norm(x)
    v = np.round(x / (n if n > 0 else 1.0), 4).astype(np.float32)
    return hashlib.sha256(modality.encode() + b"\0" + v.tobytes()).digest()


def _text_key(s: str) -> bytes:
    """Exact key of a caption: lower-cased, whitespace collapsed, trailing punctuation dropped."""
    t = " ".join(s.lower().split()).rstrip(".!?")
    return hashlib.sha256(b"text\0" + t.encode()).digest()


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
            pool.add(m, x[i], c, "original", _feature_key(m, x[i]))
            for _ in range(perturb):
                e = rng.normal(size=x.shape[1]).astype(np.float32)
                xp = x[i] + noise * np.linalg.norm(x[i]) * e / np.linalg.norm(e)
                pool.add(m, xp, c, "perturbed", _feature_key(m, xp))
    return pool


def pool_from_media(rows, encoder, n_variants: int = 1, jpeg_quality: int = 40, crop_frac: float = 0.8,
                    snr_db: float = 20.0, seed: int = 0, batch: int = 32) -> Pool:
    """Classes = groups of dataset rows; members = the decoded media and real transformations of them,
    all encoded with `encoder` (the export's frozen encoder)."""
    from PIL import Image

    from ushash.data import media

    rng = np.random.default_rng(seed)
    gid = {g: i for i, g in enumerate(sorted({r.group for r in rows}))}
    pool = Pool(variant_note=f"raw media through the encoder: images JPEG q={jpeg_quality} re-encoded and "
                             f"centre-cropped to {crop_frac:.0%}; sounds with white noise at {snr_db} dB SNR and "
                             f"-6 dB gain; captions re-cased without final punctuation; {n_variants} of each")
    items: list[tuple[str, object, int, str, bytes]] = []
    for r in rows:
        try:
            raw = media.load(r.modality, r.source, sample_rate=encoder.sample_rate, seconds=encoder.audio_seconds)
        except media.MediaError:
            continue
        c = gid[r.group]
        if r.modality == "text":
            items.append(("text", raw, c, "original", _text_key(raw)))
            for k in range(n_variants):
                v = raw.rstrip(".!?").upper() if k % 2 else raw.rstrip(".!?").lower()
                items.append(("text", v, c, "recased", _text_key(v)))
        elif r.modality == "image":
            buf = io.BytesIO()
            raw.save(buf, format="PNG")
            items.append(("image", raw, c, "original", hashlib.sha256(buf.getvalue()).digest()))
            for _ in range(n_variants):
                w, h = raw.size
                cw, ch = max(1, int(w * crop_frac)), max(1, int(h * crop_frac))
                ox, oy = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
                img = raw.crop((ox, oy, ox + cw, oy + ch)).resize((w, h), Image.BILINEAR)
                jb = io.BytesIO()
                img.save(jb, format="JPEG", quality=int(jpeg_quality))
                img = Image.open(io.BytesIO(jb.getvalue())).convert("RGB")
                items.append(("image", img, c, "jpeg+crop", hashlib.sha256(jb.getvalue()).digest()))
        else:
            items.append(("audio", raw, c, "original", hashlib.sha256(raw.tobytes()).digest()))
            for _ in range(n_variants):
                p = float(np.mean(raw ** 2)) or 1e-8
                noisy = 0.5 * raw + rng.normal(scale=math.sqrt(p / 10 ** (snr_db / 10)), size=raw.shape).astype(np.float32)
                items.append(("audio", noisy.astype(np.float32), c, "noised",
                              hashlib.sha256(noisy.astype(np.float32).tobytes()).digest()))
    for m in ("image", "text", "audio"):
        sel = [it for it in items if it[0] == m]
        if m not in encoder.modalities:
            continue
        for s in range(0, len(sel), batch):
            chunk = sel[s:s + batch]
            xb = encoder.collate(m, [encoder.preprocess(m, it[1]) for it in chunk])
            f = encoder.encode(m, xb).float().cpu().numpy()
            for it, fx in zip(chunk, f):
                pool.add(m, fx, it[2], it[3], it[4])
    return pool


def make_stream(pool: Pool, n_requests: int, zipf_s: float = 1.0, seed: int = 0) -> np.ndarray:
    """Pool indices of the requests: class ~ Zipf(zipf_s) over a random ranking, member uniform."""
    rng = np.random.default_rng(seed)
    cls = np.asarray(pool.cls)
    classes = np.unique(cls)
    members = {c: np.flatnonzero(cls == c) for c in classes}
    ranking = rng.permutation(classes)
    p = 1.0 / np.arange(1, len(ranking) + 1) ** float(zipf_s)
    p /= p.sum()
    picks = ranking[rng.choice(len(ranking), size=int(n_requests), p=p)]
    return np.array([members[c][rng.integers(len(members[c]))] for c in picks], np.int64)


# ---------------------------------------------------------------------------------------------- methods
class RevisedHead:
    """The same head under another revision id (simulates deploying a new model mid-stream)."""

    def __init__(self, head, revision: str):
        self._head, self.revision = head, revision

    def __getattr__(self, name):
        return getattr(self._head, name)


class SimClock:
    def __init__(self, t: float = 1.7e9):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class Outcome:
    hit: bool
    value: int | None = None
    stale: bool = False


class HashMethod:
    """A SemanticCache over precomputed Queries (US-HASH export, or LSH codes of its z)."""

    def __init__(self, name: str, head, pool: Pool, cache_cfg: dict, clock: SimClock):
        from ushash.serving.cache import Query, SemanticCache

        self.name, self.head, self.cache_cfg, self.clock = name, head, dict(cache_cfg), clock
        self.SemanticCache = SemanticCache
        self.queries: list = [None] * len(pool)
        mods = np.asarray(pool.modality)
        for m in sorted(set(pool.modality)):
            idx = np.flatnonzero(mods == m)
            codes, z = head.encode(m, np.stack([pool.features[i] for i in idx]))
            z = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-30)
            for i, c, zz in zip(idx, codes, z):
                self.queries[i] = Query(m, c.tobytes(), np.ascontiguousarray(zz, np.float32))
        self.bits = int(head.bits)

    def reset(self, **overrides):
        import random

        cfg = {**self.cache_cfg, **overrides}
        # seeded: TTL jitter and XFetch draws are part of the replay, which must be reproducible
        self.cache = self.SemanticCache(self.head, cfg, clock=self.clock, rng=random.Random(0))
        self.n_rev = 0

    def new_revision(self):
        self.n_rev += 1
        self.cache.reload(RevisedHead(self.head, f"{self.head.revision}+sim{self.n_rev}"))

    def lookup(self, i: int) -> Outcome:
        hit = self.cache.lookup(self.queries[i], TENANT)
        if hit is None:
            return Outcome(False)
        stale = hit.revision != self.cache.revision or hit.expires <= self.clock()
        return Outcome(True, int(hit.value), stale)

    def store(self, i: int, value: int) -> None:
        self.cache.store(self.queries[i], value, TENANT)

    def nearest_value(self, i: int):
        t = self.cache.table
        live = t.live_slots()
        if not len(live):
            return None
        from ushash.core.codes import hamming
        d = hamming(np.frombuffer(self.queries[i].code, np.uint8)[None], t.code[live])[0]
        return int(decode(t.kind[live[int(np.argmin(d))]], t.value[live[int(np.argmin(d))]]))

    def bytes_used(self) -> int:
        return int(self.cache.policy.used_bytes)


def decode(kind, data):
    from ushash.serving.cache import decode_value
    return decode_value(kind, data)


class CosineMethod:
    """GPTCache / RedisVL-like: float embeddings, flat inner-product index, one global threshold, TTL;
    entries are not tied to a model revision (those caches do not track one)."""

    def __init__(self, head, pool: Pool, clock: SimClock, ttl_s: float | None):
        self.name, self.clock, self.ttl_s = "float z cosine", clock, ttl_s
        z = np.zeros((len(pool), head.dim), np.float32)
        mods = np.asarray(pool.modality)
        for m in sorted(set(pool.modality)):
            idx = np.flatnonzero(mods == m)
            z[idx] = head.embed(m, np.stack([pool.features[i] for i in idx]))
        z /= np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
        self.z = z
        self.threshold = 0.8

    def reset(self, threshold: float = 0.8):
        import faiss
        self.threshold = float(threshold)
        self.index = faiss.IndexFlatIP(self.z.shape[1])
        self.values, self.expires, self.rev = [], [], []
        self.n_rev = 0

    def new_revision(self):
        self.n_rev += 1  # GPTCache-like caches keep serving entries of the old model

    def lookup(self, i: int) -> Outcome:
        if self.index.ntotal == 0:
            return Outcome(False)
        k = min(8, self.index.ntotal)
        S, I = self.index.search(self.z[i:i + 1], k)
        now = self.clock()
        for s, j in zip(S[0], I[0]):
            if j < 0 or s < self.threshold:
                break
            if self.expires[j] > now:
                return Outcome(True, self.values[j], self.rev[j] != self.n_rev)
        return Outcome(False)

    def store(self, i: int, value: int) -> None:
        self.index.add(self.z[i:i + 1])
        self.values.append(value)
        self.expires.append(self.clock() + self.ttl_s if self.ttl_s else math.inf)
        self.rev.append(self.n_rev)

    def nearest_value(self, i: int):
        if self.index.ntotal == 0:
            return None
        _, I = self.index.search(self.z[i:i + 1], 1)
        return self.values[int(I[0, 0])]

    def bytes_used(self) -> int:
        now = self.clock()
        live = sum(1 for e in self.expires if e > now)
        return live * (4 * self.z.shape[1] + 8)


class ExactMethod:
    """An exact-key cache: sha256 of the normalised input (what a plain HTTP/LLM response cache does)."""

    def __init__(self, pool: Pool, clock: SimClock, ttl_s: float | None):
        self.name, self.keys, self.clock, self.ttl_s = "exact key", pool.key, clock, ttl_s

    def reset(self):
        self.d: dict[bytes, tuple[int, float, int]] = {}
        self.n_rev = 0

    def new_revision(self):
        self.n_rev += 1

    def lookup(self, i: int) -> Outcome:
        e = self.d.get(self.keys[i])
        if e is None or e[1] <= self.clock():
            return Outcome(False)
        return Outcome(True, e[0], e[2] != self.n_rev)

    def store(self, i: int, value: int) -> None:
        self.d[self.keys[i]] = (value, self.clock() + self.ttl_s if self.ttl_s else math.inf, self.n_rev)

    def nearest_value(self, i: int):
        return None

    def bytes_used(self) -> int:
        now = self.clock()
        return sum(1 for e in self.d.values() if e[1] > now) * (32 + 8)


# ---------------------------------------------------------------------------------------------- replay
def replay(method, stream: np.ndarray, pool: Pool, clock: SimClock, seconds_per_request: float = 1.0,
           revision_change_at: float = 0.0) -> dict:
    cls = pool.cls
    n = len(stream)
    change = int(revision_change_at * n) if revision_change_at and 0 < revision_change_at < 1 else -1
    t0 = clock.t
    hits = correct = false = stale = valid = miss_nn_right = misses_with_entries = 0
    oracle = 0
    seen: set[int] = set()
    lat = np.zeros(n)
    peak = 0
    for t, i in enumerate(stream.tolist()):
        clock.t = t0 + t * seconds_per_request
        if t == change:
            method.new_revision()
            seen = set()  # after a model change nothing valid is cached: the oracle starts over
        c = cls[i]
        oracle += c in seen
        seen.add(c)
        s = time.perf_counter()
        out = method.lookup(i)
        lat[t] = time.perf_counter() - s
        if out.hit:
            hits += 1
            correct += out.value == c
            false += out.value != c
            stale += out.stale
            valid += out.value == c and not out.stale
        else:
            nv = method.nearest_value(i)
            if nv is not None:
                misses_with_entries += 1
                miss_nn_right += nv == c
            method.store(i, c)
        if t % 256 == 0:
            peak = max(peak, method.bytes_used())
    clock.t = t0
    peak = max(peak, method.bytes_used())
    return {"requests": n, "hit_rate": hits / n, "false_hit_rate": false / n,
            "false_per_hit": false / hits if hits else 0.0, "correct_hit_rate": correct / n,
            "valid_hit_rate": valid / n,
            "oracle_hit_rate": oracle / n, "stale_hits": int(stale),
            "misses_nn_correct": miss_nn_right / max(1, n - hits),
            "misses_nn_correct_of_nonempty": miss_nn_right / max(1, misses_with_entries),
            "lookup_p50_us": float(np.percentile(lat, 50) * 1e6), "lookup_p99_us": float(np.percentile(lat, 99) * 1e6),
            "peak_bytes": int(peak)}


# ---------------------------------------------------------------------------------------------- run
def _load_head(cfg: DictConfig):
    from ushash.serving.artifact import load_export

    if cfg.get("export"):
        p = Path(str(cfg.export))
        return load_export(p if p.is_absolute() else Path(cfg.paths.root) / p)
    if cfg.get("ckpt"):
        import tempfile

        from ushash.serving.export import write_export
        from ushash.hashing.module import load_checkpoint
        module = load_checkpoint(cfg.ckpt)
        prov = module.hparams.provenance or {}
        tmp = Path(tempfile.mkdtemp(prefix="ushash-cachesim-")) / "export"
        write_export(module.model.eval(), tmp, prov.get("encoder") or {}, source={"dataset": prov.get("dataset")})
        head = load_export(tmp)
        head.manifest.setdefault("source", {})["features_dir"] = prov.get("features_dir")
        return head
    raise ValueError("cachesim needs export=<export dir> (python -m ushash.export) or ckpt=<checkpoint>")


def build_pool(cfg: DictConfig, head) -> tuple[Pool, str]:
    src = head.manifest.get("source") or {}
    dataset = cfg.get("dataset") or src.get("dataset")
    if not dataset:
        raise ValueError("the export does not name its dataset; pass dataset=<name>")
    v = cfg.variants
    if cfg.raw_media:
        from ushash.data.datasets import load_rows
        from ushash.serving.cache.request import QueryEncoder
        data = cfg.get("data")
        rows = load_rows(dataset, str(cfg.split), **(to_dict(data) if data is not None else {}))
        encoder = QueryEncoder(head).encoder()
        return pool_from_media(rows, encoder, n_variants=int(v.perturb), jpeg_quality=int(v.jpeg_quality),
                               crop_frac=float(v.crop_frac), snr_db=float(v.snr_db), seed=int(cfg.stream.seed)), dataset
    from ushash.data.store import open_split, store_path
    fdir = cfg.get("features_dir") or src.get("features_dir") or cfg.paths.features_dir
    split = open_split(store_path(fdir, dataset, str(cfg.split), head.encoder.name, head.encoder.fingerprint))
    return pool_from_split(split, perturb=int(v.perturb), noise=float(v.noise), seed=int(cfg.stream.seed)), dataset


def run_cachesim(cfg: DictConfig, head=None, pool: Pool | None = None) -> dict:
    """Build the stream, replay it through every method and sweep point; write the report."""
    from ushash.serving.cache.lsh import LSHHead

    head = head if head is not None else _load_head(cfg)
    dataset = cfg.get("dataset") or (head.manifest.get("source") or {}).get("dataset") or "given"
    if pool is None:
        pool, dataset = build_pool(cfg, head)
    st = cfg.stream
    stream = make_stream(pool, int(st.n_requests), float(st.zipf_s), int(st.seed))
    clock = SimClock()
    cache_cfg = {**to_dict(cfg.cache), "l2": None}
    ttl = cache_cfg.get("ttl_s")
    rp = dict(seconds_per_request=float(st.seconds_per_request), revision_change_at=float(st.revision_change_at))
    radius, thr = int(cache_cfg["radius"]), float(cfg.cosine_threshold)
    radii = [int(r) for r in cfg.sweep.radii]
    methods = list(cfg.methods)
    rows, sweep = [], {}

    def hash_runs(name, method, payload_check):
        pts = []
        for r in sorted(set(radii + [radius])):
            method.reset(radius=r, observe_radius=r, payload_check=payload_check)
            res = {"method": name, "param": f"radius {r}", "radius": r, **replay(method, stream, pool, clock, **rp)}
            pts.append(res)
            if r == radius:
                rows.append(res)
        sweep[name] = pts

    t0 = time.perf_counter()
    if "exact" in methods:
        m = ExactMethod(pool, clock, ttl)
        m.reset()
        rows.append({"method": "exact key (sha256 of normalised input)", "param": "-", **replay(m, stream, pool, clock, **rp)})
    if "cosine" in methods:
        m = CosineMethod(head, pool, clock, ttl)
        pts = []
        for th in sorted(set([float(x) for x in cfg.sweep.thresholds] + [thr]), reverse=True):
            m.reset(th)
            res = {"method": f"float z cosine (GPTCache-like, {head.dim}-d fp32)", "param": f"cos >= {th:g}",
                   "threshold": th, **replay(m, stream, pool, clock, **rp)}
            pts.append(res)
            if th == thr:
                rows.append(res)
        sweep["float z cosine"] = pts
    if "lsh" in methods or "lsh_codes_only" in methods:
        lm = HashMethod("lsh", LSHHead.over(head, seed=int(st.seed)), pool, cache_cfg, clock)
        if "lsh" in methods:
            hash_runs(f"LSH {head.bits}-bit codes of z + payload check", lm, True)
        if "lsh_codes_only" in methods:
            hash_runs(f"LSH {head.bits}-bit codes of z only", lm, False)
    if "ushash" in methods:
        hm = HashMethod("ushash", head, pool, cache_cfg, clock)
        hash_runs(f"US-HASH {head.bits}-bit codes + payload check", hm, True)
        if "ushash_codes_only" in methods:
            hash_runs(f"US-HASH {head.bits}-bit codes only", hm, False)
        if cfg.sweep.get("payload_thresholds"):
            # the other knob: the payload cosine threshold at the configured radius
            pts = []
            for th in sorted(float(x) for x in cfg.sweep.payload_thresholds):
                hm.reset(payload_check=True, payload_threshold=th)
                pts.append({"method": f"US-HASH radius {radius} + payload cos >= t", "param": f"payload cos >= {th:g}",
                            "threshold": th, **replay(hm, stream, pool, clock, **rp)})
            sweep[f"US-HASH radius {radius}, payload threshold t"] = pts
    seconds = time.perf_counter() - t0
    kinds = {k: int(sum(1 for x in pool.kind if x == k)) for k in sorted(set(pool.kind))}
    info = {"dataset": dataset, "split": str(cfg.split), "revision": head.revision, "bits": int(head.bits),
            "encoder": {"name": head.encoder.name, "fingerprint": head.encoder.fingerprint},
            "classes": int(len(set(pool.cls))), "pool": len(pool), "pool_kinds": kinds,
            "modalities": {m: int(sum(1 for x in pool.modality if x == m)) for m in sorted(set(pool.modality))},
            "variants": pool.variant_note, "stream": to_dict(st), "cache": cache_cfg,
            "cosine_threshold": thr, "replay_seconds": round(seconds, 1)}
    out = Path(cfg.out) if cfg.get("out") else Path(cfg.paths.experiments_dir) / "cachesim" / f"{dataset}-{head.revision}"
    if not out.is_absolute():
        out = Path(cfg.paths.root) / out
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(info, rows)
    (out / "results.json").write_text(json.dumps({"info": info, "rows": rows, "sweep": sweep}, indent=1) + "\n")
    (out / "results.md").write_text(table + "\n")
    plot_sweep(sweep, rows, out / "sweep.png", title=f"{dataset}/{cfg.split}, {head.bits} bits, Zipf s={st.zipf_s}")
    print(table)
    print(f"[cachesim] wrote {out}/results.json, results.md, sweep.png")
    return {"out": str(out), "info": info, "rows": rows, "sweep": sweep, "table": table}


def markdown(info: dict, rows: list[dict]) -> str:
    st = info["stream"]
    lines = [f"Stream: {st['n_requests']} requests over {info['classes']} classes ({info['dataset']}/{info['split']}), "
             f"Zipf s={st['zipf_s']}, pool {info['pool']} requests {info['pool_kinds']}, "
             f"revision change at {st['revision_change_at']:.0%} of the stream, TTL {info['cache'].get('ttl_s')} s "
             f"at {st['seconds_per_request']} s/request. Variants: {info['variants']}.", "",
             "| method | setting | hit rate | correct, fresh hit rate | false hits / requests | false hits / hits | "
             "oracle hit rate | misses with a correct nearest entry | stale hits | lookup p50 µs | p99 µs | peak bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['param']} | {r['hit_rate']:.3f} | {r['valid_hit_rate']:.3f} | "
                     f"{r['false_hit_rate']:.4f} | "
                     f"{r['false_per_hit']:.4f} | {r['oracle_hit_rate']:.3f} | {r['misses_nn_correct']:.3f} | "
                     f"{r['stale_hits']} | {r['lookup_p50_us']:.0f} | {r['lookup_p99_us']:.0f} | {r['peak_bytes']:,} |")
    return "\n".join(lines)


def plot_sweep(sweep: dict, rows: list[dict], path: Path, title: str = "") -> None:
    """Left: hit rate against false-hit rate for every sweep (labels: radius or threshold); right: the
    same with only correct hits from fresh entries on the y axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), dpi=110, sharex=True)
    for ax, key, ylabel in ((axes[0], "hit_rate", "hit rate (hits / requests)"),
                            (axes[1], "valid_hit_rate", "correct hits from fresh entries / requests")):
        for name, pts in sweep.items():
            x = [p["false_hit_rate"] for p in pts]
            y = [p[key] for p in pts]
            ax.plot(x, y, marker="o", ms=3, label=name)
            for p in pts:
                lab = p.get("radius", p.get("threshold"))
                ax.annotate(f"{lab:g}", (p["false_hit_rate"], p[key]), fontsize=6, xytext=(2, 2),
                            textcoords="offset points")
        for r in rows:
            if r["method"].startswith("exact"):
                ax.plot([r["false_hit_rate"]], [r[key]], "k*", ms=9, label=r["method"])
        if rows:
            ax.axhline(rows[0]["oracle_hit_rate"], color="grey", ls=":", lw=1, label="oracle hit rate")
        ax.set_xlabel("false-hit rate (false hits / requests)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title + "  (point labels: Hamming radius or cosine threshold)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
