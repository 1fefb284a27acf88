"""The payload codecs and the export loader: seeded naive references for the codecs, a
loaded export whose payload disagrees with its head or whose files are oversized, checked scoring of a
query of the wrong shape, and a worker call that raises StopIteration."""

import asyncio
import os
import tracemalloc

import numpy as np
import pytest
from test_export_checks import _resave, copy, tiny  # noqa: F401 (fixtures)

from ushash.serving import artifact
from ushash.serving.artifact import CorruptExport, ExportError, TruncatedExport, load_export
from ushash.serving.payload import PayloadError, PayloadFormat
from ushash.serving.workers import Workers


# ------------------------------------------------------------------------------------------ naive reference

def _naive_decode(f: PayloadFormat, x: np.ndarray) -> np.ndarray:
    """Decoded records, one value at a time: the k largest |x| (ties to the lower dimension), then fp16, or
    int4 with an fp16 scale absmax / 7 per group of the kept values."""
    out = np.zeros_like(x)
    for r in range(len(x)):
        keep = sorted(range(f.dim), key=lambda i: (-abs(float(x[r, i])), i))[:f.length]
        idx = np.array(sorted(keep))
        v = x[r, idx]
        if f.kind == "fp16":
            dv = v.astype(np.float16).astype(np.float32)
        elif f.kind == "fp32":
            dv = v
        else:
            dv = np.zeros_like(v)
            for g in range(0, len(v), f.group_size):
                seg = v[g:g + f.group_size]
                s = np.float32(np.float16(np.abs(seg).max() / np.float32(7)))
                dv[g:g + f.group_size] = (np.clip(np.rint(seg / s), -7, 7) * s) if s > 0 else 0
        out[r, idx] = dv
    return out


@pytest.mark.parametrize("dim,settings", [
    (7, dict(kind="int4", group_size=3)), (33, dict(kind="int4", group_size=32, topk=5)),
    (33, dict(kind="int4", group_size=64)), (300, dict(kind="fp16", topk=4)), (9, dict(kind="fp32", topk=9)),
    (1, dict(kind="int4", group_size=1)),
    (33, dict(kind="int4", group_size=10 ** 12)),   # one scale per vector, not a row padded to 10**12 values
])
def test_codecs_and_scores_match_a_naive_reference(dim, settings):
    rng = np.random.default_rng(dim)
    f = PayloadFormat(dim, **settings)
    x = rng.normal(size=(5, dim)).astype(np.float32)
    x[1] = 0.0                                   # all zero: decodes to zero, scores 0
    x[2] = 0.25                                  # all equal: ties to the lower dimensions
    x[3] = np.round(x[3] * 2) / 2                # many ties of |x|
    rec = f.encode(x)
    ref = _naive_decode(f, x)
    np.testing.assert_allclose(f.decode(rec), ref, rtol=1e-6, atol=1e-7)
    q = rng.normal(size=dim).astype(np.float32)
    q /= np.linalg.norm(q)
    want = (ref.astype(np.float64) @ q) / np.maximum(np.linalg.norm(ref.astype(np.float64), axis=1), 1e-15)
    for checked in (True, False):
        np.testing.assert_allclose(f.scores(q, rec, checked), want, atol=2e-6)
    np.testing.assert_allclose(f.cosine(q, rec), want, atol=2e-6)


# ------------------------------------------------------------------------------------------ checked scores

@pytest.mark.parametrize("settings", [dict(kind="int4"), dict(kind="fp16"), dict(kind="int4", topk=8)])
def test_checked_scores_refuse_a_query_of_the_wrong_shape_or_not_finite(settings):
    # the compiled int4 path read past the end of a short query (garbage cosines of ~1e34)
    f = PayloadFormat(64, **settings)
    rec = f.encode(np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32))
    for q in (np.ones(8, np.float32), np.ones((2, 64), np.float32), np.full(64, np.nan, np.float32)):
        with pytest.raises(PayloadError, match="q_unit"):
            f.scores(q, rec, checked=True)
    q = np.ones(64, np.float32) / 8
    np.testing.assert_allclose(f.scores(q, rec, checked=True), f.scores(np.tile(q, (4, 1)), rec, checked=True),
                               atol=1e-6)


# ------------------------------------------------------------------------------------------ export payload

def _payload_dim(mf, dim):
    mf["payload"]["dim"] = dim
    for s in mf["payload"]["modalities"].values():
        s["dim"] = dim
        s["nbytes"] = PayloadFormat.from_settings({k: v for k, v in s.items() if k != "nbytes"}).nbytes


@pytest.mark.parametrize("change", [
    lambda mf: _payload_dim(mf, 10 ** 9),        # a 2 GB record per entry: the cache's store a memory bomb
    lambda mf: _payload_dim(mf, 16),             # z of the head would never encode
    lambda mf: mf["payload"]["modalities"].pop("text"),   # text entries could not be stored
], ids=["huge-dim", "other-dim", "missing-modality"])
def test_a_payload_that_disagrees_with_the_head_is_corrupt(copy, change):
    _resave(copy, manifest=change)
    with pytest.raises(CorruptExport, match="payload"):
        load_export(copy)


@pytest.mark.parametrize("value", [[], None, "fp16"])
def test_malformed_payload_modalities_are_corrupt_exports(copy, value):
    _resave(copy, manifest=lambda mf: mf["payload"].update(modalities=value))
    with pytest.raises(ExportError, match="modalities") as e:
        load_export(copy)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ oversized files

def _peak_while(fn):
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_an_oversized_weights_file_is_refused_before_it_is_read(copy):
    os.truncate(copy / "weights.safetensors", 256 << 20)      # sparse: no disk used

    def load():
        with pytest.raises(TruncatedExport, match="weights.safetensors"):
            load_export(copy)
    assert _peak_while(load) < 16 << 20


def test_an_oversized_manifest_is_refused_before_it_is_read(copy, monkeypatch):
    monkeypatch.setattr(artifact, "MAX_MANIFEST_BYTES", 1 << 20, raising=False)
    os.truncate(copy / "manifest.json", 64 << 20)

    def load():
        with pytest.raises(CorruptExport, match="manifest.json"):
            load_export(copy)
    assert _peak_while(load) < 16 << 20


def test_a_manifest_nested_past_the_recursion_limit_is_a_corrupt_export(copy):
    (copy / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CorruptExport, match="manifest.json is not valid JSON"):
        load_export(copy)


# ------------------------------------------------------------------------------------------ workers

def test_a_call_raising_stop_iteration_reaches_its_awaiter():
    # a Future refuses StopIteration: the awaiter used to wait forever
    w = Workers(1)

    async def main():
        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(w.run(next, iter(())), 5)
        return await w.run(lambda: 7)
    try:
        assert asyncio.run(main()) == 7
    finally:
        w.close()
