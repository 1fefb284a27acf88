"""The compiled one-row pass (ushash.serving.rowpass) that answers a cache's single requests: exactly a naive
float64 reference's numbers (each op in float64, rounded to float32 at its output, sums in input order),
within float32 rounding of torch's path, the same codes wherever a logit is not within rounding of zero,
and ties at zero logits as torch gives them."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from ushash.core import codes as codes_lib
from ushash.hashing import forward as fwd
from ushash.hashing.heads import USHash
from ushash.serving.artifact import CorruptExport, ExportedHead, load_export
from ushash.serving.cache import RequestError
from ushash.serving.cache.request import QueryEncoder
from ushash.serving.rowpass import RowPass


def _layers(kind: str) -> nn.Sequential:
    torch.manual_seed(len(kind))
    if kind == "mixed":      # every op and option the layer list has
        mods = [nn.Linear(16, 48), nn.LayerNorm(48), nn.GELU(), nn.Dropout(0.3), nn.Linear(48, 40, bias=False),
                nn.LayerNorm(40, elementwise_affine=False), nn.GELU(approximate="tanh"), nn.Linear(40, 24)]
    elif kind == "linear":   # the shipped closed-form head's shape: one Linear from the image features
        mods = [nn.Linear(1280, 128)]
    else:                    # USHash's default MLP
        return USHash({"image": 24}, bits=64, dim=128).heads["image"].eval()
    return nn.Sequential(*mods).eval()


def _pass(layers: nn.Sequential, bits: int, seed: int = 0):
    ops, tensors = fwd.to_ops(layers, "h")
    dim = [m for m in layers if isinstance(m, nn.Linear)][-1].out_features
    protos = torch.randn(bits, dim, generator=torch.Generator().manual_seed(seed))
    unit = fwd.unit_prototypes(protos)
    return RowPass(ops, {k: v.detach() for k, v in tensors.items()}, unit), ops, tensors, protos, unit


def _naive(ops, tensors, unit, x):
    """The row pass written out in Python floats: every op in float64, rounded to float32 at its output."""
    h = np.asarray(x, np.float32)
    for op in ops:
        if op["op"] == "linear":
            w = tensors[op["weight"]].detach().numpy()
            acc = np.zeros(w.shape[0], np.float64)
            for k in range(w.shape[1]):               # input order
                acc += np.float64(h[k]) * w[:, k].astype(np.float64)
            if op["bias"]:
                acc = acc + tensors[op["bias"]].detach().numpy().astype(np.float64)
            h = acc.astype(np.float32)
        elif op["op"] == "layer_norm":
            v = [float(a) for a in h]
            mean = 0.0
            for a in v:
                mean += a
            mean /= len(v)
            var = 0.0
            for a in v:
                var += (a - mean) * (a - mean)
            inv = 1.0 / math.sqrt(var / len(v) + op["eps"])
            y = (h.astype(np.float64) - mean) * inv
            if op["weight"]:
                y = y * tensors[op["weight"]].detach().numpy().astype(np.float64)
            if op["bias"]:
                y = y + tensors[op["bias"]].detach().numpy().astype(np.float64)
            h = y.astype(np.float32)
        else:
            if op["approximate"] == "tanh":
                c = math.sqrt(2 / math.pi)
                f = [0.5 * a * (1.0 + math.tanh(c * (a + 0.044715 * a ** 3))) for a in map(float, h)]
            else:
                f = [0.5 * a * (1.0 + math.erf(a / math.sqrt(2))) for a in map(float, h)]
            h = np.array(f, np.float64).astype(np.float32)
    s = 0.0
    for a in h:
        s += float(a) * float(a)
    z = (h.astype(np.float64) / max(math.sqrt(s), 1e-12)).astype(np.float32)
    ut = unit.numpy().T
    logits = np.zeros(ut.shape[1], np.float64)
    for k in range(len(z)):
        logits += np.float64(z[k]) * ut[k].astype(np.float64)
    return codes_lib.pack((logits > 0)[None])[0], z, logits


@pytest.mark.parametrize("kind,bits", [("mixed", 16), ("mixed", 64), ("linear", 64), ("default", 128)])
def test_row_pass_is_the_naive_float64_computation(kind, bits):
    layers = _layers(kind)
    rows, ops, tensors, _, unit = _pass(layers, bits)
    x = np.random.default_rng(bits).normal(size=(5, layers[0].in_features)).astype(np.float32) * 3
    for r in x:
        code, z = rows(r)
        want_code, want_z, _ = _naive(ops, tensors, unit, r)
        assert code.dtype == np.uint8 and code.shape == (bits // 8,) and z.dtype == np.float32
        assert np.array_equal(code, want_code) and np.array_equal(z, want_z)


@pytest.mark.parametrize("kind,bits", [("mixed", 64), ("linear", 64), ("default", 64), ("default", 128)])
def test_row_pass_agrees_with_torch_to_float32_rounding(kind, bits):
    """z within a few float32 ulps of torch's one-row path; every code bit the same where torch's logit
    is not within 1e-5 of zero (only there may rounding flip one; a few in 10,000 logits are)."""
    layers = _layers(kind)
    rows, _, _, protos, unit = _pass(layers, bits, seed=1)
    x = np.random.default_rng(7).normal(size=(300, layers[0].in_features)).astype(np.float32)
    steps = fwd.eval_steps(layers)
    with torch.inference_mode():
        tz = fwd.embed(steps, torch.from_numpy(x))
        tl = fwd.logits(tz, protos, unit).numpy()
    worst, near_zero, differ = 0.0, 0, 0
    for i, r in enumerate(x):
        code, z = rows(r)
        t_code, t_z = fwd.encode(lambda xb: fwd.embed(steps, xb), protos, x[i:i + 1], bits, len(z), unit=unit)
        worst = max(worst, float(np.abs(z - t_z[0]).max()))
        sure = np.abs(tl[i]) > 1e-5
        near_zero += int((~sure).sum())
        got_bits, t_bits = codes_lib.unpack(code[None], bits)[0], codes_lib.unpack(t_code, bits)[0]
        assert np.array_equal(got_bits[sure], t_bits[sure])
        differ += int((got_bits != t_bits).sum())
    assert worst <= 4e-7, worst
    assert differ <= near_zero <= 1e-3 * tl.size, (differ, near_zero)


def test_ties_at_zero_logits_give_bit_zero():
    """A zero prototype's logit is 0 for every z, a zero row's z is 0 (its norm clamped): bit 0 either way,
    as torch's logit > 0 gives."""
    layers = nn.Sequential(nn.Linear(8, 16)).eval()
    with torch.no_grad():
        layers[0].bias.zero_()
    ops, tensors = fwd.to_ops(layers, "h")
    protos = torch.randn(16, 16, generator=torch.Generator().manual_seed(3))
    protos[5] = 0.0
    rows = RowPass(ops, {k: v.detach() for k, v in tensors.items()}, fwd.unit_prototypes(protos))
    x = np.random.default_rng(3).normal(size=(50, 8)).astype(np.float32)
    for r in x:
        code, _ = rows(r)
        assert not codes_lib.unpack(code[None], 16)[0, 5]
    code, z = rows(np.zeros(8, np.float32))
    assert not code.any() and not z.any()


def test_row_pass_refuses_what_it_cannot_run():
    t = {"w": torch.zeros(4, 4), "w64": torch.zeros(4, 4, dtype=torch.float64), "g": torch.ones(3)}
    unit = torch.eye(8, 4)
    with pytest.raises(ValueError, match="'relu'"):
        RowPass([{"op": "relu"}], t, unit)
    with pytest.raises(ValueError, match="normalises over"):
        RowPass([{"op": "linear", "weight": "w", "bias": None},
                 {"op": "layer_norm", "normalized_shape": [3], "eps": 1e-5, "weight": "g", "bias": None}], t, unit)
    with pytest.raises(ValueError, match="approximate='fast'"):
        RowPass([{"op": "gelu", "approximate": "fast"}], t, unit)
    with pytest.raises(TypeError, match="float32"):
        RowPass([{"op": "linear", "weight": "w64", "bias": None}], t, unit)
    with pytest.raises(ValueError, match="multiple of 8"):
        RowPass([{"op": "linear", "weight": "w", "bias": None}], t, torch.eye(12, 4))
    with pytest.raises(ValueError, match="bias has 3 values for a row of 4"):
        RowPass([{"op": "linear", "weight": "w", "bias": "g"}], t, unit)
    with pytest.raises(ValueError, match=r"weight is \[4, 4\] for a row of 3"):
        RowPass([{"op": "layer_norm", "normalized_shape": [3], "eps": 1e-5, "weight": "g", "bias": None},
                 {"op": "linear", "weight": "w", "bias": None}], t, unit)
    with pytest.raises(ValueError, match="the prototypes are of 8"):
        RowPass([{"op": "linear", "weight": "w", "bias": None}], t, torch.eye(16, 8))
    rows = RowPass([{"op": "linear", "weight": "w", "bias": None}], t, unit)
    assert rows.in_dim == 4 and rows.bits == 8
    bad_rows = (np.zeros(5, np.float32), np.zeros(4, np.float64), np.zeros(8, np.float32)[::2],
                np.zeros((1, 4), np.float32))
    for bad in bad_rows:
        with pytest.raises(ValueError, match=r"C-contiguous float32 \[4\]"):   # never read out of bounds
            rows(bad)


def _tensors(export_dir):
    from safetensors.torch import load_file

    return load_file(str(export_dir / "weights.safetensors"))


def test_a_single_request_is_encoded_by_the_row_pass(head):
    """QueryEncoder's one-row requests: the head's encode_row (code bytes, z) = the row pass's numbers, the
    code that `encode` gives, z within float32 rounding of encode's and of unit norm; rows in a batch
    still go through `encode`."""
    enc = QueryEncoder(head)
    x = np.random.default_rng(11).normal(size=(40, head.in_dims["text"])).astype(np.float32)
    codes, z = head.encode("text", x)
    for i, r in enumerate(x):
        q = enc.from_features("text", r)
        code, zr = head.encode_row("text", r)
        assert q.code == code == codes[i].tobytes()
        assert np.array_equal(q.z, zr) and q.z.dtype == np.float32
        assert np.abs(zr - z[i]).max() <= 4e-7 and abs(float(zr @ zr) - 1.0) < 1e-6
    batch = enc.from_feature_rows("text", x[:2])
    assert [b.code for b in batch] == [c.tobytes() for c in codes[:2]]


def test_a_single_row_that_vanishes_is_refused(head, export_dir):
    """A head whose last layer maps every row to zero: the one-row path refuses it as the batch path does."""
    tensors = _tensors(export_dir)
    last = head.manifest["head"]["layers"]["image"][-1]
    tensors[last["weight"]].zero_()
    tensors[last["bias"]].zero_()
    enc = QueryEncoder(ExportedHead(head.manifest, tensors))
    row = np.ones(head.in_dims["image"], np.float32)
    with pytest.raises(RequestError, match="overflows or vanishes"):
        enc.from_features("image", row)
    with pytest.raises(RequestError, match="overflows or vanishes"):
        enc.from_feature_rows("image", np.stack([row, row]))


def test_a_layer_list_the_row_pass_cannot_run_is_a_corrupt_export(head, export_dir):
    layers = {m: [dict(op) for op in ops] for m, ops in head.manifest["head"]["layers"].items()}
    ln = next(op for op in layers["audio"] if op["op"] == "layer_norm")
    ln["normalized_shape"] = [ln["normalized_shape"][0] + 1]
    manifest = {**head.manifest, "head": {**head.manifest["head"], "layers": layers}}
    with pytest.raises(CorruptExport, match="layer list unusable"):
        ExportedHead(manifest, _tensors(export_dir))


def test_rows_beyond_float32s_range_are_refused_alone_as_in_a_batch(head, tmp_path):
    """Where torch's float32 kernels overflow (a LayerNorm's variance, the norm's sum of squares), the row
    pass does too, and refuses the row: every row refused in a batch is refused alone, on the default MLP
    head and on a Linear-only head (the shipped closed-form shape). Alone it is refused even where torch's
    LayerNorm overflows to a row of its bias and the batch serves that bias's embedding for it."""
    from ushash.serving.export import write_export

    torch.manual_seed(0)
    linear = load_export(write_export(USHash({"image": 16}, bits=64, dim=32, layers=1).eval(), tmp_path / "lin",
                                      {"name": "synthetic", "fingerprint": "0"}))
    base = np.random.default_rng(5).normal(size=16).astype(np.float32)
    one_huge, all_big = base.copy(), np.full(16, 3e19, np.float32)
    one_huge[0] = 3e38
    for h in (head, linear):
        m = "image"
        enc = QueryEncoder(h)
        refused_in_batch = 0
        for row in (one_huge, all_big):
            try:
                enc.from_feature_rows(m, np.stack([row, base]))
            except RequestError as e:
                assert "overflows or vanishes" in str(e)
                refused_in_batch += 1
            with pytest.raises(RequestError, match="overflows or vanishes"):
                enc.from_features(m, row)
        assert refused_in_batch == (1 if h is head else 2)   # the MLP's batch takes all_big (its bias's z)
        ok = enc.from_features(m, base * np.float32(1e6))      # large but within range: encoded alike
        assert ok.code == h.encode(m, (base * np.float32(1e6))[None])[0][0].tobytes()
