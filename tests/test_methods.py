"""Baselines: registry, shared input space, fitted methods (LSH, PCA-sign, ITQ, PCA + rotation, float), the
trained baselines' objectives, and the synthetic checks of docs/baselines.md."""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ushash.core import codes
from ushash.hashing import losses, methods
from ushash.evaluation import retrieval
from ushash.data import synthetic
from ushash.config import CONFIG_DIR
from ushash.hashing.methods.space import SharedSpace

FITTED_CODES = ("lsh", "pca_sign", "itq", "pca_rotation")


@pytest.fixture(scope="module")
def unaligned(tmp_path_factory):
    """Three modalities with unrelated raw spaces (like MiniLM / EfficientNet / aiSFX), 20 classes."""
    root = tmp_path_factory.mktemp("unaligned")
    return synthetic.write_synthetic(root, sizes={"train": 1500, "val": 300, "test": 400}, n_classes=20,
                                     dims={"image": 64, "text": 48, "audio": 32}, noise=0.8)


@pytest.fixture(scope="module")
def joint(tmp_path_factory):
    """Two modalities already in one space (like CLIP's towers), 20 classes."""
    root = tmp_path_factory.mktemp("joint")
    return synthetic.write_synthetic(root, sizes={"train": 1500, "val": 300, "test": 400}, n_classes=20,
                                     dims={"image": 48, "text": 48}, aligned=True, noise=0.8)


def label_map(split, method) -> float:
    reps = retrieval.represent(split, method)
    rows = retrieval.evaluate(split, {"m": lambda m, x: reps[m]}, protocols=("label",))
    return retrieval.mean_map(rows, "label")


# ---------------------------------------------------------------------------------------------- registry

def test_registry_has_every_method_and_a_config_for_each():
    expected = {"ushash", "ushash_labels", "pairwise", "csq", "orthohash", "lsh", "pca_sign", "itq", "pca_rotation", "float"}
    assert set(methods.names()) == expected
    assert set(methods.names("fitted")) == {"lsh", "pca_sign", "itq", "pca_rotation", "float"}
    files = {p.stem: yaml.safe_load(p.read_text()) for p in (Path(CONFIG_DIR) / "method").glob("*.yaml")}
    assert set(files) == expected  # one config file per method, and no config without a method
    for stem, cfg in files.items():
        assert cfg["name"] == stem and methods.get(stem).name == stem
    # what earlier notes call "DeepHash" is the pairwise-likelihood method
    assert methods.get("DeepHash").name == "pairwise"
    assert "DCMH/DPSH" in methods.get("deephash").title
    with pytest.raises(KeyError, match="registered: "):
        methods.get("nope")
    with pytest.raises(ValueError, match="trained, not fitted"):
        methods.build("csq", bits=32)


# ---------------------------------------------------------------------------------------------- shared space

def test_align_none_refuses_unaligned_dims(unaligned):
    with pytest.raises(ValueError, match="different dims"):
        methods.build("itq", 32, align="none").fit(unaligned["train"], unaligned["val"])


def test_unaligned_raw_spaces_are_at_chance_and_gcca_aligns_them(tmp_path):
    # equal dims but unrelated maps: fitting "jointly" on raw features runs, and is at chance
    sp = synthetic.write_synthetic(tmp_path, sizes={"train": 1000, "val": 50, "test": 300}, n_classes=10,
                                   dims={"image": 40, "text": 40}, noise=0.5)
    raw = label_map(sp["test"], methods.build("itq", 32, align="none").fit(sp["train"], sp["val"]))
    aligned = label_map(sp["test"], methods.build("itq", 32, align="gcca").fit(sp["train"], sp["val"]))
    labels = np.array([l[0] for l in sp["test"].tables["text"].labels])
    chance = float(np.mean([np.mean(labels == c) for c in labels]))  # share of the database with the query's class
    assert raw < chance + 0.08, (raw, chance)
    assert aligned > chance + 0.4, (aligned, chance)


def test_gcca_with_two_modalities_is_regularised_cca(tmp_path):
    """Naive reference: the top eigenvalues of GCCA are 1 + the singular values of the ridge-whitened
    cross-covariance (canonical correlations)."""
    sp = synthetic.write_synthetic(tmp_path, sizes={"train": 400, "val": 10, "test": 10}, n_classes=5,
                                   dims={"image": 12, "text": 9})
    tr = sp["train"]
    reg = 0.3
    space = SharedSpace(align="gcca", reg=reg, common_dim=9).fit(tr)

    def whiten(x):
        xc = x - x.mean(0)
        lam, v = np.linalg.eigh(xc.T @ xc)
        return xc @ v / np.sqrt(lam + reg * lam.mean())

    # groups are one row per modality, in the same order, in synthetic stores
    a, b = whiten(np.asarray(tr.tables["image"].x, np.float64)), whiten(np.asarray(tr.tables["text"].x, np.float64))
    sv = np.linalg.svd(a.T @ b, compute_uv=False)
    np.testing.assert_allclose(space.eigenvalues[:9], 1 + sv[:9], rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------- fitted methods

@pytest.mark.parametrize("space_name", ["joint", "unaligned"])
def test_itq_beats_lsh(space_name, request):
    """ITQ beats LSH with a margin of 0.1 label mAP@10 at 32 bits, in a joint space (fitted on the raw joint
    features, align=none) and across unaligned modalities (GCCA space), against the best of three LSH seeds.
    Measured: joint ITQ 0.594 / LSH 0.39-0.43; unaligned ITQ 0.793 / LSH 0.51-0.58."""
    sp = request.getfixturevalue(space_name)
    align = "none" if space_name == "joint" else "gcca"
    itq = label_map(sp["test"], methods.build("itq", 32, seed=0, align=align).fit(sp["train"], sp["val"]))
    lsh = [label_map(sp["test"], methods.build("lsh", 32, seed=s, align=align).fit(sp["train"], sp["val"])) for s in range(3)]
    assert itq > max(lsh) + 0.1, (itq, lsh)


@pytest.mark.parametrize("name", FITTED_CODES)
def test_fitted_codes_are_bit_balanced(name, unaligned):
    """Every bit is on for 50% +- 12% of the test codes (all modalities stacked; 1,200 codes). Measured worst
    bit at 32 bits: LSH 0.073, PCA-sign 0.048, ITQ 0.035, PCA + rotation 0.063 off 0.5."""
    m = methods.build(name, 32, seed=1).fit(unaligned["train"], unaligned["val"])
    test = unaligned["test"]
    packed = np.concatenate([m.encode(mod, test.tables[mod].x)[1] for mod in test.modalities])
    bal = codes.bit_balance(packed, 32)
    assert np.abs(bal - 0.5).max() < 0.12, bal


def test_fitted_methods_are_seeded_and_deterministic(unaligned):
    tr, x = unaligned["train"], np.asarray(unaligned["test"].tables["image"].x)
    for name in FITTED_CODES:
        a = methods.build(name, 32, seed=3).fit(tr, unaligned["val"]).encode("image", x)[1]
        b = methods.build(name, 32, seed=3).fit(tr, unaligned["val"]).encode("image", x)[1]
        np.testing.assert_array_equal(a, b)
    lsh = [methods.build("lsh", 32, seed=s).fit(tr, unaligned["val"]).encode("image", x)[1] for s in (3, 4)]
    assert (lsh[0] != lsh[1]).any()  # the seed draws the hyperplanes


def test_fit_is_refused_on_val_or_test(unaligned):
    for split in ("val", "test"):
        with pytest.raises(ValueError, match="training split only"):
            methods.build("itq", 16).fit(unaligned[split])


def test_float_upper_bound_and_bits_beyond_the_space(unaligned):
    f = methods.build("float", 32).fit(unaligned["train"], unaligned["val"])
    kind, y = f.encode("text", unaligned["test"].tables["text"].x)
    assert kind == "float" and np.allclose(np.linalg.norm(y, axis=1), 1, atol=1e-5)
    assert label_map(unaligned["test"], f) > label_map(unaligned["test"], methods.build("itq", 32).fit(unaligned["train"], unaligned["val"]))
    with pytest.raises(ValueError, match="bits=256 > shared space dim"):
        methods.build("pca_sign", 256, common_dim=64, max_rank=64).fit(unaligned["train"], unaligned["val"])


# ---------------------------------------------------------------------------------------------- trained objectives

def test_pairwise_likelihood_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    ha, hb = torch.rand(6, 16, generator=g) * 2 - 1, torch.rand(5, 16, generator=g) * 2 - 1
    ga, gb = torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([1, 0, 7, 3, 9])
    num = den = 0.0
    n_pos = sum(int(a == b) for a in ga for b in gb)
    wpos = (30 - n_pos) / n_pos
    for i in range(6):
        for j in range(5):
            t = 0.5 * float(ha[i] @ hb[j])
            s = float(ga[i] == gb[j])
            w = wpos if s else 1.0
            num += w * (np.log1p(np.exp(t)) - s * t)
            den += w
    got = losses.pairwise_likelihood(ha, hb, ga, gb, scale=0.5, pos_weight="balanced")
    assert abs(float(got) - num / den) < 1e-5
    unweighted = losses.pairwise_likelihood(ha, hb, ga, gb, pos_weight=1.0)
    ref = np.mean([np.log1p(np.exp(0.5 * float(ha[i] @ hb[j]))) - float(ga[i] == gb[j]) * 0.5 * float(ha[i] @ hb[j])
                   for i in range(6) for j in range(5)])
    assert abs(float(unweighted) - ref) < 1e-5


def test_hadamard_centres():
    c = losses.hadamard_centres(64, 32, seed=0)
    assert c.shape == (64, 32) and set(c.unique().tolist()) == {-1.0, 1.0}
    d = (c[:, None, :] != c[None, :, :]).sum(-1)
    off = d[~torch.eye(64, dtype=bool)]
    assert set(off.unique().tolist()) <= {16, 32}  # rows of H and -H: distance bits/2, or bits for a row and its negation
    assert torch.equal(c, losses.hadamard_centres(64, 32, seed=0))
    more = losses.hadamard_centres(100, 32, seed=0)
    assert more.shape == (100, 32) and set(more[64:].unique().tolist()) == {-1.0, 1.0}
    assert losses.hadamard_centres(10, 24, seed=1).shape == (10, 24)  # not a power of two: Bernoulli


def test_centre_and_proxy_losses_prefer_the_right_centre():
    c = losses.hadamard_centres(8, 16, seed=0)
    target = torch.tensor([0, 3])
    near, far = c[target] * 0.9, c[torch.tensor([1, 2])] * 0.9
    assert losses.centre_bce(near, c[target]) < losses.centre_bce(far, c[target])
    assert losses.cosine_margin_ce(near, c, target) < losses.cosine_margin_ce(far, c, target)
    # the margin makes the target's logit smaller: the loss is larger with it
    assert losses.cosine_margin_ce(near, c, target, margin=0.2) > losses.cosine_margin_ce(near, c, target, margin=0.0)


@pytest.mark.parametrize("name", ["ushash", "pairwise", "csq", "orthohash"])
def test_trained_objectives_run_and_backpropagate(name):
    from ushash.hashing.module import USHashModule
    mod = USHashModule(in_dims={"image": 8, "text": 6}, bits=16, dim=16, hidden=16, method=name,
                       method_args={"classes": "groups"} if name in ("csq", "orthohash") else {}, n_train_groups=10)
    g = torch.Generator().manual_seed(0)
    gid = torch.arange(10)
    present = torch.ones(10, dtype=torch.bool)
    h, z, gg, pp = {}, {}, {}, {}
    for m, d in (("image", 8), ("text", 6)):
        z[m], lg = mod.model(m, torch.randn(10, d, generator=g))
        h[m], gg[m], pp[m] = torch.tanh(lg), gid, present
    parts, weights = mod._objective(mod, h, z, gg, pp, mod.hparams.method_args)
    loss = sum(weights[k] * v for k, v in parts.items())
    assert torch.isfinite(loss)
    loss.backward()
    assert mod.model.heads["image"][0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["ushash", "pairwise", "csq", "orthohash"])
@pytest.mark.parametrize("distill_pairs", ["cross", "all"])
def test_a_full_batch_is_read_as_a_view_with_the_gathers_exact_loss_and_gradients(name, distill_pairs, monkeypatch):
    """Every row present (the usual batch): the objectives index by a view, not a boolean gather; the loss and every
    gradient are bit for bit those of the gather (rows forced to return the mask), teacher and a 3rd modality included."""
    from ushash.hashing.methods import csq, pairwise, ushash as us
    from ushash.hashing.module import USHashModule
    dims = {"image": 8, "text": 6, "audio": 5}
    g = torch.Generator().manual_seed(0)
    x = {m: torch.randn(12, d, generator=g) for m, d in dims.items()}
    gid = torch.arange(12)
    results, view = [], us.rows
    assert view(torch.ones(3, dtype=torch.bool)) is us.EVERY_ROW and view(torch.tensor([True, False])) is not us.EVERY_ROW
    for rows in (view, lambda mask, kept=None: mask):
        for module in (us, pairwise, csq):
            monkeypatch.setattr(module, "rows", rows)
        torch.manual_seed(0)
        mod = USHashModule(in_dims=dims, bits=16, dim=16, hidden=16, method=name, distill_pairs=distill_pairs,
                           method_args={"classes": "groups"} if name in ("csq", "orthohash") else {}, n_train_groups=12)
        mod.log = mod.log_dict = lambda *a, **k: None
        batch = {m: (x[m], gid, torch.ones(12, dtype=torch.bool)) for m in dims}
        loss = mod.training_step(batch, 0)
        loss.backward()
        results.append((loss.detach(), {k: p.grad.clone() for k, p in mod.named_parameters() if p.grad is not None}))
    (fast, fast_grads), (gathered, gathered_grads) = results
    assert torch.equal(fast, gathered) and fast_grads.keys() == gathered_grads.keys() and fast_grads
    assert all(torch.equal(fast_grads[k], gathered_grads[k]) for k in fast_grads)


def test_a_fitted_method_cannot_be_trained():
    from ushash.hashing.module import USHashModule
    with pytest.raises(ValueError, match="fitted, not trained"):
        USHashModule(in_dims={"image": 4, "text": 4}, bits=16, method="itq")


# ---------------------------------------------------------------------------------------------- US-HASH vs ITQ

US_VS_ITQ = "the current recipe does not reach that margin there (the failed assertion prints both scores; the " \
            "synthetic sweep's table in docs/baselines.md has them over 3 seeds)"


@pytest.fixture(scope="module")
def synthetic_heads(unaligned, tmp_path_factory):
    """bits -> the US-HASH head trained on the synthetic splits (seed 0), trained once per length."""
    from ushash.config import compose
    from ushash.hashing.module import load_checkpoint
    from ushash.hashing.training import run_train
    heads = {}

    def head(bits: int):
        if bits not in heads:
            root = tmp_path_factory.mktemp(f"heads{bits}")
            cfg = compose("config", [f"paths.root={root}", "trainer.accelerator=cpu", "trainer.max_epochs=12",
                                     "model.batch_size=128", f"bits={bits}", "trainer.enable_progress_bar=false"])
            heads[bits] = load_checkpoint(run_train(cfg, splits=unaligned)["best"])
        return heads[bits]
    return head


def _short_of(margin: float, protocol: str):
    return pytest.mark.xfail(strict=True, reason=f"US-HASH does not beat ITQ by {margin} with {protocol} relevance: " + US_VS_ITQ)


@pytest.mark.slow
@pytest.mark.parametrize("bits,protocol,margin", [
    (16, "label", 0.0),
    (32, "label", 0.0),
    pytest.param(16, "label", 0.1, marks=_short_of(0.1, "label")),
    pytest.param(32, "label", 0.1, marks=_short_of(0.1, "label")),
    pytest.param(16, "paired", 0.1, marks=_short_of(0.1, "paired")),
])
def test_ushash_beats_itq_on_synthetic(bits, protocol, margin, unaligned, synthetic_heads):
    """The issue's check: US-HASH (trained as in configs/experiment/sweep_synthetic.yaml, seed 0) beats ITQ
    (fitted on the training split in the shared space chosen on val) by 0.1 mAP@10. With label relevance it
    beats ITQ, by less than 0.1 (seed 0, 2026-12-07, AMD EPYC: 0.857 against 0.805 at 16 bits, 0.922 against
    0.881 at 32; over 3 seeds in the synthetic sweep's table of docs/baselines.md); with paired relevance it
    does not (0.192 against 0.198 at 16 bits). The 0.1 cases are strict xfails, so the day US-HASH beats ITQ
    there by the margin this test says so. (Against faiss's ITQTransform, whose rotation update is transposed,
    the label margins were 0.29 and 0.19.)"""
    module = synthetic_heads(bits)
    test = unaligned["test"]

    def score(method):
        reps = retrieval.represent(test, method)
        return retrieval.mean_map(retrieval.evaluate(test, {"m": lambda m, x: reps[m]}, protocols=(protocol,)), protocol)

    us, itq = score(module.code_method()), score(methods.build("itq", bits, seed=0).fit(unaligned["train"], unaligned["val"]))
    print(f"US-HASH {us:.3f}, ITQ {itq:.3f} ({bits} bits, {protocol})")
    assert us > itq + margin, (us, itq)


def test_csq_clusters_its_pseudo_classes_in_the_space_args_align_names(tmp_path, monkeypatch):
    """With model.init=gcca (the default) the pseudo-classes were clustered in the closed-form start's space
    whatever method.args.align said: align=none and align=gcca trained the same model. auto keeps the
    start's space; a value naming another space is fitted on the training split."""
    from ushash.config import compose
    from ushash.hashing.methods import csq
    from ushash.hashing.training import run_train

    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 300, "val": 100, "test": 50},
                                       n_classes=5, dims={"image": 16, "text": 16}, aligned=True)
    seen, spaces = {}, {}
    real = csq._pseudo_classes

    def spy(module, args, n):
        seen[args.get("align")] = real(module, args, n)
        spaces[args.get("align")] = module.shared_space.resolved
        return seen[args.get("align")]

    monkeypatch.setattr(csq, "_pseudo_classes", spy)
    for align in ("auto", "none", "gcca"):
        cfg = compose("config", [f"paths.root={tmp_path}", "trainer.accelerator=cpu", "trainer.max_epochs=1",
                                 "bits=16", "model.batch_size=64", "trainer.enable_progress_bar=false", "method=csq",
                                 f"method.args.align={align}", f"run_name=csq-{align}"])
        run_train(cfg, splits=splits)
    assert spaces == {"auto": "gcca", "none": "gcca", "gcca": "gcca"}   # the start's space: gcca every time
    assert np.array_equal(seen["auto"], seen["gcca"])                   # the start's space is the one named
    assert not np.array_equal(seen["auto"], seen["none"])               # another space: other pseudo-classes
