"""US-HASH's losses and objective against naive references: plain loops over pairs on seeded tiny tensors."""

import math

import numpy as np
import pytest
import torch

from ushash.hashing import losses
from ushash.hashing.methods.ushash import objective
from ushash.hashing.module import MAX_LOGIT_SCALE, USHashModule


def _cos(a, b):
    return float(a @ b) / (math.sqrt(float(a @ a)) * math.sqrt(float(b @ b)))


def _naive_infonce(ha, hb, ga, gb, t, similarity):
    """Both directions: for each anchor with a positive, minus the mean over its positives j of
    log(exp(s_ij) / sum_k exp(s_ik)) (every row of the other side in the denominator, positives too); the
    mean over those anchors; the two directions averaged."""
    def s(x, y):
        return (_cos(x, y) if similarity == "cosine" else float(x @ y) / len(x)) / t

    def side(xa, xb, g1, g2):
        per_anchor = []
        for i in range(len(xa)):
            pos = [j for j in range(len(xb)) if g1[i] == g2[j]]
            if not pos:
                continue
            denom = sum(math.exp(s(xa[i], xb[k])) for k in range(len(xb)))
            per_anchor.append(-sum(math.log(math.exp(s(xa[i], xb[j])) / denom) for j in pos) / len(pos))
        return sum(per_anchor) / len(per_anchor) if per_anchor else 0.0

    return 0.5 * (side(ha, hb, ga, gb) + side(hb, ha, gb, ga))


@pytest.mark.parametrize("similarity", ["dot", "cosine"])
def test_contrastive_is_the_naive_symmetric_infonce(similarity):
    """Several captions of one image in the batch (repeated group ids on one side) are all its positives,
    and each other's negatives' denominator; a row whose group has no row on the other side is no anchor."""
    gen = torch.Generator().manual_seed(0)
    ha, hb = torch.tanh(torch.randn(5, 16, generator=gen, dtype=torch.float64)), \
        torch.tanh(torch.randn(7, 16, generator=gen, dtype=torch.float64))
    ga = torch.tensor([0, 1, 2, 3, 9])             # group 9 has no text: no anchor on the image side
    gb = torch.tensor([0, 0, 1, 2, 2, 2, 3])       # several captions of images 0 and 2
    for t in (0.84, torch.tensor(0.3, dtype=torch.float64)):
        got = float(losses.contrastive(ha, hb, ga, gb, t, similarity=similarity))
        assert got == pytest.approx(_naive_infonce(ha, hb, ga.tolist(), gb.tolist(), float(t), similarity), rel=1e-10)


def test_distillation_is_the_naive_mean_over_every_pair_and_only_the_codes_learn():
    gen = torch.Generator().manual_seed(1)
    ha = torch.tanh(torch.randn(4, 8, generator=gen, dtype=torch.float64)).requires_grad_()
    hb = torch.tanh(torch.randn(3, 8, generator=gen, dtype=torch.float64))
    ta = torch.nn.functional.normalize(torch.randn(4, 5, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    tb = torch.nn.functional.normalize(torch.randn(3, 5, generator=gen, dtype=torch.float64), dim=-1)
    for kernel, target in (("cosine", lambda c: c), ("angular", lambda c: 1 - 2 * math.acos(c) / math.pi)):
        a, at = ha.detach(), ta.detach()
        naive = np.mean([(float(a[i] @ hb[j]) / 8 - target(float(at[i] @ tb[j]))) ** 2
                         for i in range(4) for j in range(3)])
        got = losses.similarity_distillation(ha, hb, ta, tb, kernel)
        assert float(got.detach()) == pytest.approx(naive, rel=1e-10)
        got.backward()
        assert ha.grad is not None and ta.grad is None  # the teacher is a target, not trained
        ha.grad = None


def test_quantization_balance_decorrelation_prototype_are_their_naive_formulas():
    gen = torch.Generator().manual_seed(2)
    h = torch.tanh(torch.randn(6, 4, generator=gen, dtype=torch.float64))
    n, bits = h.shape
    assert float(losses.quantization(h)) == pytest.approx(
        np.mean([(abs(float(h[i, b])) - 1) ** 2 for i in range(n) for b in range(bits)]), rel=1e-12)
    assert float(losses.balance(h)) == pytest.approx(
        np.mean([(sum(float(h[i, b]) for i in range(n)) / n) ** 2 for b in range(bits)]), rel=1e-12)
    c = [[sum(float(h[i, a] * h[i, b]) for i in range(n)) / n for b in range(bits)] for a in range(bits)]
    assert float(losses.decorrelation(h)) == pytest.approx(
        sum(c[a][b] ** 2 for a in range(bits) for b in range(bits) if a != b) / (bits * (bits - 1)), rel=1e-12)
    assert float(losses.decorrelation(h[:1])) == 0.0
    p = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    assert float(losses.prototype(p)) == pytest.approx(
        sum(_cos(p[a], p[b]) ** 2 for a in range(4) for b in range(4) if a != b) / (4 * 3), rel=1e-10)


def _batch(n, bits, dim, present, seed=3):
    gen = torch.Generator().manual_seed(seed)
    h = {m: torch.tanh(torch.randn(n, bits, generator=gen)) for m in present}
    z = {m: torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=-1) for m in present}
    t = {m: torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=-1) for m in present}
    g = {m: torch.arange(n) for m in present}
    return h, z, t, g, {m: torch.tensor(p, dtype=torch.bool) for m, p in present.items()}


def test_the_objective_masks_an_absent_modality_as_a_naive_loop_does():
    """Audio for only some items: each modality pair is scored on the rows present in both (a pair with
    fewer than two such rows is left out), the contrastive, float and distillation terms are the mean over
    the pairs scored, and the per-row terms take every present row of every modality once."""
    n, bits, dim = 6, 16, 8
    present = {"image": [1, 1, 1, 1, 1, 1], "text": [1, 1, 1, 0, 1, 1], "audio": [1, 0, 0, 1, 0, 1]}
    h, z, t, g, pres = _batch(n, bits, dim, present)
    mod = USHashModule({"image": 4, "text": 4, "audio": 3}, bits=bits, dim=dim)
    parts, weights = objective(mod, h, z, g, pres, {}, teacher=t)
    tc, tf = float(mod.code_temperature().detach()), float(mod.float_temperature().detach())
    con, flt, dis = [], [], []
    mods = list(present)
    for ia in range(len(mods)):
        for ib in range(ia + 1, len(mods)):
            a, b = mods[ia], mods[ib]
            rows = [i for i in range(n) if present[a][i] and present[b][i]]
            if len(rows) < 2:
                continue
            ga = [int(g[a][i]) for i in rows]
            con.append(_naive_infonce(h[a][rows], h[b][rows], ga, ga, tc, "cosine"))
            flt.append(_naive_infonce(z[a][rows], z[b][rows], ga, ga, tf, "cosine"))
            dis.append(np.mean([(float(h[a][i] @ h[b][j]) / bits - float(t[a][i] @ t[b][j])) ** 2
                                for i in rows for j in rows]))
    assert len(con) == 3  # image-audio and text-audio have 3 and 2 rows in common
    parts = {k: v.detach() for k, v in parts.items()}
    assert float(parts["contrastive"]) == pytest.approx(np.mean(con), rel=1e-5)
    assert float(parts["float"]) == pytest.approx(np.mean(flt), rel=1e-5)
    assert float(parts["distill"]) == pytest.approx(np.mean(dis), rel=1e-5)
    stacked = torch.cat([h[m][torch.tensor(present[m], dtype=torch.bool)] for m in mods])
    assert len(stacked) == sum(map(sum, present.values()))
    assert float(parts["quant"]) == pytest.approx(float(((stacked.abs() - 1) ** 2).mean()), rel=1e-6)
    assert float(parts["balance"]) == pytest.approx(float((stacked.mean(0) ** 2).mean()), rel=1e-6)
    assert weights["contrastive"] == mod.hparams.w_contrastive and weights["distill"] == mod.hparams.w_distill


def test_the_temperature_is_a_log_scale_clamped_at_clips_bound():
    """exp(logit_scale) = 1 / temperature, learned from model.temperature (or fixed), and clamped at 100 as
    CLIP's (the gradient stops there)."""
    mod = USHashModule({"image": 4, "text": 4}, bits=16, dim=8, temperature=0.25)
    assert float(mod.code_temperature().detach()) == pytest.approx(0.25)
    assert float(mod.float_temperature().detach()) == pytest.approx(0.25)
    assert mod.logit_scale.requires_grad
    with torch.no_grad():
        mod.logit_scale.fill_(math.log(1000.0))
    assert float(mod.code_temperature().detach()) == pytest.approx(1 / MAX_LOGIT_SCALE)
    mod.code_temperature().backward()
    assert float(mod.logit_scale.grad) == 0.0
    fixed = USHashModule({"image": 4, "text": 4}, bits=16, dim=8, learn_temperature=False)
    assert not fixed.logit_scale.requires_grad and not fixed.float_logit_scale.requires_grad


@pytest.mark.parametrize("case", ["all_equal", "zeros", "one_row", "audio_absent", "audio_once"])
def test_every_gradient_is_finite_on_degenerate_batches(case):
    """All rows equal (every pair tied), all-zero features, a batch of one group (the last partial batch can
    be), a modality absent from the whole batch or present for one row: the loss and every gradient finite."""
    torch.manual_seed(0)
    mod = USHashModule({"image": 6, "text": 4, "audio": 3}, bits=16, dim=8, init="random", w_margin=1.0)
    n = 1 if case == "one_row" else 5
    audio = {"audio_absent": [0] * n, "audio_once": [1] + [0] * (n - 1)}.get(case, [1] * n)
    h, z, g, present = {}, {}, {}, {}
    for m, d in mod.model.in_dims.items():
        x = {"all_equal": torch.ones(n, d), "zeros": torch.zeros(n, d)}.get(case, torch.randn(n, d))
        z[m], lg = mod.model(m, x)
        h[m] = mod.relaxed(lg, 4.0)
        g[m] = torch.arange(n)
        present[m] = torch.tensor(audio if m == "audio" else [1] * n, dtype=torch.bool)
    parts, weights = objective(mod, h, z, g, present, {})
    loss = sum(weights[k] * v for k, v in parts.items())
    assert torch.isfinite(loss), parts
    loss.backward()
    for name, p in mod.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
