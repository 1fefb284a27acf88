"""aiSFX sound-effect embeddings (Ma & Lerch, ISMIR 2022), 512-d, from a PyPI wheel.

`aisfx` 0.1.2 ships the trained X-Sequential-CE checkpoint (`aisfx/models/checkpoint.pth`, CC BY 4.0)
and its network (`aisfx.models.cnn2d.EmbeddingNet('max', 3, 1, 64)`: four VGG-style conv blocks, mean
over mel bins, max over time). Its wheel pins numpy 1.23 / librosa 0.9, so install it beside the
project's stack with `pip install --no-deps aisfx`; only the network class is imported from it.

The input pipeline is aiSFX's training one (its Essentia path; the package's librosa fallback returns a
[mel, time] array where the network expects [time, mel]), rebuilt here on torch.stft:
44.1 kHz mono, no gain change (Essentia's EasyLoader with replayGain -6 dB scales by 1.0), 2048-sample
symmetric Hann frames every 1024 samples (first frame centred on sample 0), power spectrum, 96
triangular mel bands (HTK mel, 0-22050 Hz, triangles in the mel domain, each band's weights summing to
1), log10(1e4 * x + 1), divided by 9.4578 (the training set's maximum). The network sees blocks of 100
frames (about 2.3 s) every `block_hop` * 100 frames; a clip's embedding is the mean of its block
embeddings, skipping blocks that are all padding (exact digital silence).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ushash.encoders.base import Part, audio_to_length

PIP_NAME = "aisfx"
SAMPLE_RATE = 44100
FRAME, HOP = 2048, 1024
N_MELS, F_MIN, F_MAX = 96, 0.0, 22050.0
BLOCK = 100  # frames per network input
SPEC_MAX = 9.457798957824707  # aisfx.preprocessing.spectrogram_normalize(spec_norm="original")


def hz_to_mel(f):
    return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def mel_to_hz(m):
    return 700.0 * (10.0 ** (np.asarray(m, dtype=np.float64) / 2595.0) - 1.0)


def mel_filterbank(sr: int = SAMPLE_RATE, n_fft: int = FRAME, n_mels: int = N_MELS,
                   f_min: float = F_MIN, f_max: float = F_MAX) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] weights as Essentia's MelBands(htkMel, weighting="warping", unit_sum)."""
    n_bins = n_fft // 2 + 1
    bin_hz = (sr / 2.0) / (n_bins - 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2))
    edges_mel = hz_to_mel(edges)
    weights = np.zeros((n_mels, n_bins))
    for i in range(n_mels):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        j = np.arange(int(lo / bin_hz + 0.5), int(hi / bin_hz + 0.5))
        f = j * bin_hz
        m = hz_to_mel(f)
        rising = (f >= lo) & (f < mid)
        falling = (f >= mid) & (f < hi)
        weights[i, j[rising]] = (m[rising] - edges_mel[i]) / (edges_mel[i + 1] - edges_mel[i])
        weights[i, j[falling]] = (edges_mel[i + 2] - m[falling]) / (edges_mel[i + 2] - edges_mel[i + 1])
        total = weights[i].sum()
        if total > 0:
            weights[i] /= total
    return weights.astype(np.float32)


def bundled_weights_path() -> Path:
    try:
        import aisfx.inference
    except ModuleNotFoundError as e:
        raise ImportError(
            f"the offline audio encoder needs the aiSFX network and weights: pip install --no-deps {PIP_NAME}"
        ) from e
    return Path(aisfx.inference.get_path_modelWeights())


def load_embedding_weights(path: Path) -> dict[str, torch.Tensor]:
    """The `embedding_net.*` tensors of an aiSFX checkpoint (a pickled (state_dict, datasets) tuple).

    Loaded with weights_only=True; the dataset table holds numpy integer scalars, so those two numpy
    globals are allow-listed for this one call.
    """
    from torch.serialization import safe_globals

    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core to numpy._core
    allowed = [(core.multiarray.scalar, "numpy.core.multiarray.scalar"), np.dtype, type(np.dtype(np.int64))]
    with safe_globals(allowed):
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    state = checkpoint[0] if isinstance(checkpoint, tuple) else checkpoint
    prefix = "embedding_net."
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


class AisfxAudio(Part):
    """`seconds`: clip length; `block_hop`: block step as a fraction of a block (the paper: 0.5)."""

    dim = 512
    sample_rate = SAMPLE_RATE

    def __init__(self, seconds: float = 5.0, block_hop: float = 0.5, weights: str | None = None):
        super().__init__()
        path = Path(weights) if weights else bundled_weights_path()
        try:
            from aisfx.models.cnn2d import EmbeddingNet
        except ModuleNotFoundError as e:
            raise ImportError(f"the offline audio encoder needs the aiSFX network: pip install --no-deps {PIP_NAME}") from e
        self.net = EmbeddingNet("max", 3, 1, 64)
        self.net.load_state_dict(load_embedding_weights(path))
        self.seconds = float(seconds)
        self.hop_frames = max(1, int(round(BLOCK * block_hop)))
        n_frames = 1 + int(round(SAMPLE_RATE * self.seconds)) // HOP
        self.n_blocks = 1 if n_frames <= BLOCK else math.ceil((n_frames - BLOCK) / self.hop_frames) + 1
        # CPU-side constants for preprocess (plain attributes, so .to(device) leaves them on the CPU)
        self._window = torch.hann_window(FRAME, periodic=False)
        self._filters = torch.from_numpy(mel_filterbank())

    def log_mel(self, wave: np.ndarray) -> torch.Tensor:
        """[frames, 96] normalised log-mel spectrogram of a mono 44.1 kHz wave."""
        x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
        spec = torch.stft(x, FRAME, HOP, FRAME, window=self._window, center=True, pad_mode="constant",
                          return_complex=True).abs().pow(2)  # [bins, frames]
        mel = self._filters @ spec
        return (torch.log10(1e4 * mel + 1.0) / SPEC_MAX).T.contiguous()

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        """[n_blocks, 100, 96] spectrogram blocks; zero frames pad the last block."""
        spec = self.log_mel(audio_to_length(raw, SAMPLE_RATE, self.seconds))
        need = (self.n_blocks - 1) * self.hop_frames + BLOCK
        spec = torch.nn.functional.pad(spec, (0, 0, 0, max(0, need - spec.shape[0])))[:need]
        return spec.unfold(0, BLOCK, self.hop_frames).transpose(1, 2).contiguous()

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        b, n = batch.shape[:2]
        emb = self.net(batch.flatten(0, 1)).view(b, n, -1).float()  # [B, blocks, 512]
        valid = batch.flatten(2).amax(-1) > 0  # blocks with any signal
        valid = valid | ~valid.any(1, keepdim=True)  # an all-silent clip averages all its blocks
        w = valid.to(emb.dtype).unsqueeze(-1)
        return (emb * w).sum(1) / w.sum(1)
