"""Variants of a request: the transformations that make a class's members differ from its rows.

With raw media (`raw_media=true`) they are real: a caption re-cased without its final punctuation, an image
cropped and JPEG re-encoded, a sound noised and attenuated. Without (pre-extracted features only) a
Gaussian perturbation in feature space stands in for them. Every random draw comes from the `rng` passed
in, so a seeded pool is reproducible.
"""

from __future__ import annotations

import io
import math

import numpy as np


def perturb_features(x: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
    """x plus Gaussian noise of norm `noise` x ||x|| (a random direction)."""
    e = rng.normal(size=x.shape[0]).astype(np.float32)
    return x + noise * np.linalg.norm(x) * e / np.linalg.norm(e)


def recase(text: str, k: int) -> str:
    """The k-th re-casing of a caption: final punctuation dropped, lower case (even k) or upper case (odd k)."""
    return text.rstrip(".!?").upper() if k % 2 else text.rstrip(".!?").lower()


def jpeg_crop(image, rng: np.random.Generator, crop_frac: float, quality: int):
    """A random crop of `crop_frac` of each side, resized back, JPEG re-encoded at `quality`.
    Returns (the decoded RGB image, its JPEG bytes)."""
    from PIL import Image

    w, h = image.size
    cw, ch = max(1, int(w * crop_frac)), max(1, int(h * crop_frac))
    ox, oy = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    img = image.crop((ox, oy, ox + cw, oy + ch)).resize((w, h), Image.BILINEAR)
    jb = io.BytesIO()
    img.save(jb, format="JPEG", quality=int(quality))
    return Image.open(io.BytesIO(jb.getvalue())).convert("RGB"), jb.getvalue()


def add_noise(audio: np.ndarray, rng: np.random.Generator, snr_db: float) -> np.ndarray:
    """The sound at -6 dB gain plus white noise at `snr_db` below its power (float32)."""
    p = float(np.mean(audio ** 2)) or 1e-8
    noisy = 0.5 * audio + rng.normal(scale=math.sqrt(p / 10 ** (snr_db / 10)), size=audio.shape).astype(np.float32)
    return noisy.astype(np.float32)
