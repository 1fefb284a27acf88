"""The cache workload evaluation: stream construction, replay accounting, the comparison methods and the
report, on a synthetic feature store (fast, untrained head) and on raw media through an encoder."""

import json

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from ushash.data import synthetic
from ushash.serving.artifact import load_export
from ushash.sim.adapters import ExactKeyCache, Outcome
from ushash.sim.pool import Pool, pool_from_split
from ushash.sim.replay import replay, run_cachesim
from ushash.sim.stream import SimClock, make_stream
from ushash.config import compose
from ushash.encoders import build_encoder
from ushash.serving.export import write_export
from ushash.hashing.heads import USHash

DIMS = {"image": 24, "text": 24}


def _export(tmp_path, in_dims, encoder, name="export", bits=64):
    import torch

    torch.manual_seed(0)
    model = USHash(in_dims, bits=bits, dim=32, hidden=32).eval()
    return load_export(write_export(model, tmp_path / name, encoder, source={"dataset": "synthetic"}))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    splits = synthetic.write_synthetic(root / "features", sizes={"train": 20, "val": 20, "test": 120},
                                       n_classes=8, dims=DIMS, aligned=True)
    return root, splits


def test_pool_and_zipf_stream(store):
    _, splits = store
    pool = pool_from_split(splits["test"], perturb=2, noise=0.1, seed=0)
    assert len(pool) == 120 * 2 * 3 and len(set(pool.cls)) == 120
    assert pool.kind.count("perturbed") == 480 and "feature-space perturbation" in pool.variant_note
    s = make_stream(pool, 20000, zipf_s=1.2, seed=0)
    counts = np.bincount(np.asarray(pool.cls)[s], minlength=120)
    top = np.sort(counts)[::-1]
    assert top[0] / 20000 > 0.15 and top[0] > 10 * top[60]  # Zipf: a few classes dominate
    flat = np.bincount(np.asarray(pool.cls)[make_stream(pool, 20000, zipf_s=0.0, seed=0)], minlength=120)
    assert flat.max() < 3 * flat.mean()


def test_the_pool_is_made_of_features_of_the_precision_the_export_was_trained_on(store, tmp_path):
    """An export whose source features were computed under fp16 autocast looks for an fp16 store: with only
    the fp32 store here it is refused, naming the fp32 one, instead of replaying fp32 features."""
    from ushash.data.store import FeatureStoreError
    from ushash.sim.pool import build_pool

    root, splits = store
    enc = {"name": "synthetic", "fingerprint": synthetic.ENCODER["fingerprint"]}
    cfg = compose("cachesim", [f"paths.root={tmp_path}", f"features_dir={root / 'features'}", "progress=false"])
    fp32 = load_export(write_export(USHash(DIMS, bits=64, dim=32, hidden=32).eval(), tmp_path / "a", enc,
                                    source={"dataset": "synthetic", "encoder": enc}))
    pool, _ = build_pool(cfg, fp32)
    assert len(pool) == len(pool_from_split(splits["test"], perturb=int(cfg.variants.perturb)))
    fp16 = load_export(write_export(USHash(DIMS, bits=64, dim=32, hidden=32).eval(), tmp_path / "b", enc,
                                    source={"dataset": "synthetic", "encoder": {**enc, "precision": "fp16-autocast"}}))
    with pytest.raises(FeatureStoreError, match="fp32 store.s. of that encoder at .* not used"):
        build_pool(cfg, fp16)


class _ServesTheLastAnswer:
    """A cache under test that serves the last stored answer to any request (once something is stored)."""
    name, nbytes = "last", 0

    def reset(self, **settings):
        self.last = None

    def new_revision(self):
        pass

    def lookup(self, i):
        return Outcome(self.last is not None, self.last)

    def store(self, i, value):
        self.last = value

    def nearest_value(self, i):
        return self.last


def test_replay_accounting_on_a_hand_made_stream():
    pool = Pool()
    for cls, key in [(0, b"a"), (0, b"b"), (1, b"c"), (1, b"a")]:  # key b"a" in two classes: one input, two items
        pool.add("text", np.zeros(2), cls, "original", key)
    clock = SimClock()
    m = ExactKeyCache(pool, clock, ttl_s=None)
    m.reset()
    res = replay(m, np.array([0, 1, 0, 3, 2, 2]), pool, clock)
    # 0 miss (store a), 1 miss (b), 0 hit, 3 hit a: another class but the same input, so correct; 2 miss, 2 hit
    assert res["hit_rate"] == 3 / 6 and res["false_hit_rate"] == 0 and res["correct_hit_rate"] == 3 / 6
    # the oracle hits what has an equivalent earlier request: 1 (class 0), 0, 3 (input a), 2 (class 1), 2
    assert res["oracle_hit_rate"] == 5 / 6 and res["stale_hits"] == 0
    m.reset()
    res = replay(m, np.array([0, 0, 0, 0]), pool, clock, revision_change_at=0.5)
    assert res["stale_hits"] == 2  # an exact-key cache keeps serving answers of the old model
    last = _ServesTheLastAnswer()
    last.reset()
    res = replay(last, np.array([0, 1, 2, 3, 0]), pool, clock)
    # 0 miss; 1 served 0's answer (class 0): correct; 2 served it: false; 3 served it: input a, correct; 0 correct
    assert res["hit_rate"] == 4 / 5 and res["false_hit_rate"] == 1 / 5 and res["false_per_hit"] == 1 / 4
    assert res["misses_nn_correct"] == 0 and res["correct_hit_rate"] == 3 / 5


def test_run_cachesim_writes_a_report_and_hash_caches_are_never_stale(store, tmp_path):
    root, splits = store
    head = _export(tmp_path, DIMS, {"name": "synthetic", "fingerprint": synthetic.ENCODER["fingerprint"]})
    cfg = compose("cachesim", [f"paths.root={tmp_path}", f"features_dir={root / 'features'}", "stream.n_requests=1500",
                               "sweep.radii=[0,3,8]", "sweep.thresholds=[0.9,0.8]",
                               "sweep.payload_thresholds=[0.8,0.95]", f"out={tmp_path / 'out'}",
                               "cache.ttl_s=600", "progress=false"])
    res = run_cachesim(cfg, head=head)
    out = tmp_path / "out"
    assert (out / "sweep.png").stat().st_size > 10_000
    assert (out / "results.md").read_text().startswith("Stream: 1500 requests over 120 classes")
    data = json.loads((out / "results.json").read_text())
    assert set(data["sweep"]) == {"float z cosine", "LSH 64-bit codes of z + payload check", "LSH 64-bit codes of z only",
                                  "US-HASH 64-bit codes + payload check", "US-HASH 64-bit codes only",
                                  "US-HASH radius 3, payload threshold t"}
    rows = {r["method"]: r for r in res["rows"]}
    assert len(rows) == 6
    for name, r in rows.items():
        assert 0 <= r["false_hit_rate"] <= r["hit_rate"] <= 1
        assert r["lookup_p99_us"] >= r["lookup_p50_us"] > 0 or name.startswith("exact")
        if "codes" in name:
            assert r["stale_hits"] == 0, name                     # revision watermark + TTL
            assert r["valid_hit_rate"] <= r["oracle_hit_rate"] + 1e-9, name
            assert r["peak_bytes"] > 0
    assert rows["exact key (sha256 of normalised input)"]["false_hit_rate"] == 0
    assert rows["exact key (sha256 of normalised input)"]["stale_hits"] > 0  # not revision-aware
    # the payload check removes false hits (not exactly monotone per point: a different hit or miss
    # changes what gets stored later in the replay)
    us = data["sweep"]["US-HASH 64-bit codes + payload check"]
    codes_only = data["sweep"]["US-HASH 64-bit codes only"]
    assert sum(p["false_hit_rate"] for p in us) <= sum(p["false_hit_rate"] for p in codes_only) + 1e-9
    # a wider radius never loses hits with codes only
    assert codes_only[-1]["hit_rate"] >= codes_only[0]["hit_rate"]


def _media_manifest(tmp_path):
    rows = []
    colors = [(220, 20, 20), (20, 200, 20), (20, 20, 220), (200, 200, 20), (20, 200, 200), (200, 20, 200)]
    for i, col in enumerate(colors):
        img = Image.new("RGB", (48, 48), col)
        for k in range(0, 48, 6):
            img.putpixel((k, (k * (i + 1)) % 48), (255, 255, 255))
        img.save(tmp_path / f"{i}.png")
        t = np.arange(16000) / 16000
        sf.write(tmp_path / f"{i}.wav", (0.4 * np.sin(2 * np.pi * (220 + 110 * i) * t)).astype(np.float32), 16000)
        rows.append({"id": f"s{i}", "group": f"g{i}", "image": f"{i}.png", "audio": f"{i}.wav",
                     "text": f"A stamp of colour number {i}.", "split": "test"})
    path = tmp_path / "manifest.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_raw_media_variants_go_through_the_encoder(tmp_path):
    enc_cfg = {"name": "tiny", "dim": 16, "seed": 0}
    enc = build_encoder({**enc_cfg, "device": "cpu"})
    head = _export(tmp_path, dict(enc.dims), {"name": "tiny", "fingerprint": enc.fingerprint, "config": enc_cfg})
    manifest = _media_manifest(tmp_path)
    # the documented form, as written: data=<recipe> data.<key>=... (no "+")
    cfg = compose("cachesim", [f"paths.root={tmp_path}", "raw_media=true", "data=manifest",
                               f"data.path={manifest}", "stream.n_requests=300", "methods=[exact,ushash]",
                               "sweep.radii=[2]", f"out={tmp_path / 'out'}", "variants.perturb=1", "progress=false"])
    res = run_cachesim(cfg, head=head)
    info = res["info"]
    assert info["pool_kinds"] == {"jpeg+crop": 6, "noised": 6, "original": 18, "recased": 6}
    assert "JPEG q=40" in info["variants"] and info["classes"] == 6
    rows = {r["method"]: r for r in res["rows"]}
    # recased captions share the exact key (normalised text), re-encoded media do not
    assert rows["exact key (sha256 of normalised input)"]["hit_rate"] > 0


@pytest.mark.slow
def test_trained_head_beats_exact_keys_without_false_hits(tmp_path):
    """A head trained for seconds on synthetic features: semantic hits on paraphrases and perturbed
    copies that an exact-key cache misses, with no false hits at the default radius."""
    from ushash.serving.export import run_export
    from ushash.hashing.training import run_train

    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 600, "val": 100, "test": 200},
                                       n_classes=200, dims=DIMS, aligned=True, noise=0.5)
    cfg = compose("config", [f"paths.root={tmp_path}", "trainer.accelerator=cpu", "trainer.max_epochs=6",
                             "model.batch_size=128", "bits=64", "trainer.enable_progress_bar=false", "data.name=synthetic"])
    best = run_train(cfg, splits=splits)["best"]
    run_export(compose("export", [f"paths.root={tmp_path}", f"ckpt={best}", f"out={tmp_path / 'export'}"]))
    scfg = compose("cachesim", [f"paths.root={tmp_path}", f"export={tmp_path / 'export'}",
                                f"features_dir={tmp_path / 'features'}", "stream.n_requests=3000",
                                "methods=[exact,ushash]", "sweep.radii=[3]", f"out={tmp_path / 'out'}", "progress=false"])
    rows = {r["method"]: r for r in run_cachesim(scfg)["rows"]}
    us, exact = rows["US-HASH 64-bit codes + payload check"], rows["exact key (sha256 of normalised input)"]
    assert us["valid_hit_rate"] > exact["valid_hit_rate"] + 0.02
    assert us["false_hit_rate"] < 0.005 and us["stale_hits"] == 0


def test_variants_of_a_run_never_share_a_folder_and_their_plots_say_which_run(store, tmp_path):
    """The default output folder is named by every setting that defines the run (a readable name plus a
    digest of them): raw media, the revision change, the stream or the cache settings each give another
    folder, while the paths and the progress bar do not; the plot title names the run."""
    from ushash.sim.report import run_name, run_settings, run_title

    root, _ = store
    head = _export(tmp_path, DIMS, {"name": "synthetic", "fingerprint": synthetic.ENCODER["fingerprint"]})
    base = [f"paths.root={tmp_path}", f"features_dir={root / 'features'}", "stream.n_requests=200",
            "methods=[exact]", "progress=false"]
    names = {}
    for label, extra in {"default": [], "raw": ["raw_media=true"], "norev": ["stream.revision_change_at=0"],
                         "zipf": ["stream.zipf_s=1.2"], "radius": ["cache.radius=4"]}.items():
        names[label] = run_name(compose("cachesim", base + extra), "synthetic", head.revision)
    assert len(set(names.values())) == len(names)
    assert names["default"].startswith(f"synthetic-{head.revision}-") and "-raw-" in names["raw"]
    assert "-norev-" in names["norev"] and "-raw" not in names["default"] and "norev" not in names["default"]
    # where things are and how the run is shown do not define it
    same = compose("cachesim", base[:1] + [f"features_dir={tmp_path / 'elsewhere'}"] + base[2:-1] + ["progress=true"])
    assert run_name(same, "synthetic", head.revision) == names["default"]
    assert "paths" not in run_settings(same, "synthetic", head.revision)
    # two real runs: two folders, each with the settings that define it and a plot titled by its name
    outs = []
    for extra in ([], ["stream.revision_change_at=0"]):
        res = run_cachesim(compose("cachesim", base + extra), head=head)
        outs.append(res["out"])
        saved = json.loads((tmp_path / res["out"] / "results.json").read_text())
        assert saved["settings"]["stream"]["revision_change_at"] == (0.5 if not extra else 0.0)
        title = run_title(res["info"], res["out"].rsplit("/", 1)[-1])
        assert res["out"].rsplit("/", 1)[-1] in title
        assert ("no revision change" in title) == bool(extra) and "feature perturbations" in title
    assert len(set(outs)) == 2 and all("experiments/cachesim/synthetic-" in o for o in outs)
    # the same settings over other features (another store of the data set: features_dir only points to it)
    # replay another pool: another folder, never the first run's overwritten
    from ushash.sim.pool import build_pool

    cfg = compose("cachesim", base)
    pool, _ = build_pool(cfg, head)
    assert run_cachesim(cfg, head=head, pool=pool)["out"] == outs[0]
    pool.features[0] = pool.features[0] * 0.5
    assert run_cachesim(cfg, head=head, pool=pool)["out"] not in outs
