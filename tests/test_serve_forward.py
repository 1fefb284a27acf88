"""The served head's inference path (ushash.hashing.forward: eval_steps, unit prototypes, l2_normalize; the
float32 request path of ushash.serving.cache.request) gives the numbers of the module path it replaced:
codes and z bit-identical, on seeded inputs, ties at zero logits included."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ushash.core import codes as codes_lib
from ushash.hashing import forward as fwd
from ushash.hashing.heads import USHash
from ushash.serving.artifact import ExportedHead, load_export
from ushash.serving.cache import RequestError
from ushash.serving.cache.request import QueryEncoder


def _reference_encode(layers: nn.Module, prototypes: torch.Tensor, x: np.ndarray):
    """The forward pass as it was: the modules called, F.normalize, torch's comparison, np.packbits."""
    with torch.inference_mode():
        z = F.normalize(layers(torch.from_numpy(np.array(x, dtype=np.float32))), dim=-1)
        bits = (z @ F.normalize(prototypes, dim=-1).T > 0).numpy()
    return np.packbits(bits, axis=1, bitorder="little"), z.numpy()


def test_l2_normalize_is_f_normalize_in_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 33, generator=g, dtype=torch.float64).float()
    x[3] = 0.0                                   # a zero row: 0 / eps
    x[5] = 1e-30                                 # below eps: clamped
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fwd.l2_normalize(a), F.normalize(b, dim=-1)
    assert torch.equal(ya, yb)
    w = torch.randn(64, 33, generator=g)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eval_steps_give_the_modules_numbers(seed):
    torch.manual_seed(seed)
    layers = nn.Sequential(nn.Linear(16, 48), nn.LayerNorm(48), nn.GELU(), nn.Dropout(0.3),
                           nn.Linear(48, 40, bias=False), nn.LayerNorm(40, elementwise_affine=False),
                           nn.GELU(approximate="tanh"), nn.Linear(40, 24)).eval()
    x = torch.randn(300, 16) * 3
    steps = fwd.eval_steps(layers)
    with torch.inference_mode():
        assert torch.equal(steps(x), layers(x))
        assert torch.equal(steps(x[:1]), layers(x[:1]))     # one row: the served case
    with torch.no_grad():
        assert torch.equal(steps(x), layers(x))


def test_eval_steps_refuse_training_mode_and_unknown_layers():
    with pytest.raises(ValueError, match="training mode"):
        fwd.eval_steps(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train())
    with pytest.raises(TypeError, match="ReLU"):
        fwd.eval_steps(nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval())


@pytest.mark.parametrize("rows", [1, 2, 17, 1000])
def test_exported_head_encodes_as_the_module_path(head, rows):
    rng = np.random.default_rng(rows)
    for m in head.modalities:
        x = rng.normal(size=(rows, head.in_dims[m])).astype(np.float32)
        codes, z = head.encode(m, x)
        ref_codes, ref_z = _reference_encode(head.layers[m], head.prototypes, x)
        assert codes.dtype == np.uint8 and codes.shape == (rows, head.bits // 8)
        assert np.array_equal(codes, ref_codes) and np.array_equal(z, ref_z)
        one_codes, one_z = head.encode(m, x[-1])             # a vector: one row (the served case), against
        ref_one = _reference_encode(head.layers[m], head.prototypes, x[-1:])   # one row (another GEMM shape)
        assert np.array_equal(one_codes, ref_one[0]) and np.array_equal(one_z, ref_one[1])


def test_rows_over_one_batch_and_empty_input(head):
    x = np.random.default_rng(7).normal(size=(fwd.BATCH + 3, head.in_dims["image"])).astype(np.float32)
    codes, z = head.encode("image", x)
    ref = [_reference_encode(head.layers["image"], head.prototypes, x[i:i + fwd.BATCH])
           for i in range(0, len(x), fwd.BATCH)]
    assert np.array_equal(codes, np.concatenate([r[0] for r in ref]))
    assert np.array_equal(z, np.concatenate([r[1] for r in ref]))
    codes, z = head.encode("image", np.zeros((0, head.in_dims["image"]), np.float32))
    assert codes.shape == (0, head.bits // 8) and z.shape == (0, head.dim)


def test_ties_at_zero_logits_give_bit_zero_as_before():
    """Logits of +0.0, -0.0, NaN and the smallest subnormals: the bit is logit > 0 either way (bit 9's
    prototype is zero, so its logit is 0 whatever z is)."""
    tiny = np.float32(1e-45)
    z = torch.tensor([[0.0, -0.0, tiny, -tiny, 1.0, -1.0, -3.0, 0.5] * 2, [float("nan")] * 16], dtype=torch.float32)
    protos = torch.eye(16)                      # logit i = z_i (unit rows already)
    protos[9] = 0.0                             # a zero prototype: its logit is 0 for every z
    codes, out_z = fwd.encode(lambda xb: xb, protos, z.numpy(), bits=16, dim=16)
    with torch.inference_mode():
        ref = (z @ F.normalize(protos, dim=-1).T > 0).numpy()
    assert np.array_equal(codes, np.packbits(ref, axis=1, bitorder="little"))
    assert np.array_equal(codes_lib.unpack(codes, 16), [[0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1], [0] * 16])
    unit = fwd.unit_prototypes(protos)
    again, _ = fwd.encode(lambda xb: xb, protos, z.numpy(), bits=16, dim=16, unit=unit)
    assert np.array_equal(again, codes)


def test_training_encode_is_unchanged():
    """USHash.encode (evaluation, exports' reference) still runs the modules: the reference numbers."""
    torch.manual_seed(3)
    model = USHash({"image": 16}, bits=32, dim=24, hidden=40).eval()
    x = np.random.default_rng(3).normal(size=(50, 16)).astype(np.float32)
    codes, z = model.encode("image", x)
    ref_codes, ref_z = _reference_encode(model.heads["image"], model.prototypes.detach(), x)
    assert np.array_equal(codes, ref_codes) and np.array_equal(z, ref_z)


def test_a_head_built_from_other_prototypes_follows_them(export_dir):
    """The unit prototypes are made from the tensors the head is built with (a zero one included)."""
    from safetensors.torch import load_file

    head = load_export(export_dir)
    tensors = load_file(str(export_dir / "weights.safetensors"))
    name = head.manifest["prototypes"]["tensor"]
    tensors[name][0] = 0.0
    tensors[name][1] *= -2.0
    other = ExportedHead(head.manifest, tensors)
    x = np.random.default_rng(5).normal(size=(40, head.in_dims["text"])).astype(np.float32)
    codes, z = other.encode("text", x)
    ref_codes, ref_z = _reference_encode(other.layers["text"], tensors[name], x)
    assert np.array_equal(codes, ref_codes) and np.array_equal(z, ref_z)
    assert not codes_lib.unpack(codes, other.bits)[:, 0].any()        # the zero prototype's bit: always 0
    assert not np.array_equal(codes, head.encode("text", x)[0])


@pytest.mark.parametrize("bits", [8, 16, 64, 256, 1024])
def test_pack_of_bools_is_the_general_pack(bits):
    rng = np.random.default_rng(bits)
    b = rng.random((33, bits)) > 0.5
    want = np.zeros((33, bits // 8), np.uint8)
    for i in range(bits):                       # bit i = bit i % 8 of byte i // 8, LSB first
        want[:, i // 8] |= b[:, i].astype(np.uint8) << (i % 8)
    assert np.array_equal(codes_lib.pack(b), want)
    assert np.array_equal(codes_lib.pack(b.astype(np.float32) - 0.5), want)
    assert np.array_equal(codes_lib.pack(b[:, ::-1][:, ::-1]), want)        # a strided view
    assert np.array_equal(codes_lib.unpack(want, bits), b)


@pytest.mark.parametrize("shape", [(4, 12), (4, 0), (4, 2048), (64,), (2, 2, 8)])
def test_pack_still_refuses_bad_shapes(shape):
    with pytest.raises(ValueError):
        codes_lib.pack(np.ones(shape, bool))


def test_request_rows_of_any_dtype_make_the_same_queries(head):
    enc = QueryEncoder(head)
    x = np.random.default_rng(1).normal(size=(5, head.in_dims["audio"])).round(3)
    qs = {dt: enc.from_feature_rows("audio", x.astype(dt)) for dt in (np.float32, np.float64, np.float16)}
    q16 = enc.from_feature_rows("audio", x.astype(np.float16).astype(np.float32))
    ints = np.rint(x * 10).astype(np.int64)
    for a, b in zip(qs[np.float32], qs[np.float64]):
        assert a.code == b.code and np.array_equal(a.z, b.z) and a.z.dtype == np.float32
    for a, b in zip(qs[np.float16], q16):
        assert a.code == b.code and np.array_equal(a.z, b.z)
    for a, b in zip(enc.from_feature_rows("audio", ints), enc.from_feature_rows("audio", ints.astype(np.float32))):
        assert a.code == b.code and np.array_equal(a.z, b.z)
    ref_codes, ref_z = _reference_encode(head.layers["audio"], head.prototypes, x.astype(np.float32))
    for i, q in enumerate(qs[np.float32]):
        assert q.code == ref_codes[i].tobytes()
        assert np.array_equal(q.z, (ref_z[i] / np.float32(np.sqrt(ref_z[i] @ ref_z[i]))).astype(np.float32))
    assert enc.from_feature_rows("audio", np.zeros((0, head.in_dims["audio"]), np.float32)) == []


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_request_rows_that_are_not_finite_are_refused_alike(head, dtype):
    enc = QueryEncoder(head)
    d = head.in_dims["image"]
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((2, d), dtype)
        x[1, 3] = bad
        with pytest.raises(RequestError, match="must be finite numbers"):
            enc.from_feature_rows("image", x)
    with pytest.raises(RequestError, match="finite float32"):
        enc.from_feature_rows("image", np.full((1, d), 1e39))
    with pytest.raises(RequestError, match="must be finite numbers"):
        enc.from_feature_rows("image", np.full((1, d), "a"))


@pytest.mark.parametrize("dim", [16, 128, 333])
def test_the_unit_rows_of_a_batch_are_each_rows_unit_vector(dim):
    from ushash.serving.cache.request import _unit, _units

    rng = np.random.default_rng(dim)
    z = (rng.normal(size=(500, dim)) * rng.uniform(0.01, 100, size=(500, 1))).astype(np.float32)
    z[3], z[4], z[5] = 0.0, 1e-35, -1e-38      # zero and tiny rows: divided by 1e-30
    for rows in (z, z.astype(np.float64), z[:1], z[7:9]):
        got = _units(rows)
        assert len(got) == len(rows)
        for g, r in zip(got, rows):
            want = _unit(r)
            assert g.dtype == want.dtype == np.float32 and g.shape == want.shape and np.array_equal(g, want)
