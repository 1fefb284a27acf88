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


#: Caption variants: name -> (does it change the offline text encoder's (MiniLM's) embedding, what it does).
#: MiniLM's tokenizer is uncased, so re-casing alone encodes identically; dropping the final punctuation
#: changes the embedding a little (docs/cache.md has the measured cosines of each kind).
CAPTION_VARIANTS = {
    "recased": (True, "final punctuation dropped, lower or upper case (the case alone changes nothing)"),
    "reordered": (True, "words rotated (word order)"),
    "synonym": (True, "words replaced from a small synonym table (a, an -> one; picture -> image; ...)"),
    "typo": (True, "one letter of a longer word swapped with its neighbour"),
    "template": (True, "wrapped in a request template ('a picture of ...', 'show me ...')"),
}

SYNONYMS = {"a": "one", "an": "one", "the": "this", "picture": "image", "image": "picture", "big": "large",
            "large": "big", "small": "little", "little": "small", "man": "person", "woman": "person",
            "cat": "kitty", "dog": "puppy", "car": "automobile", "house": "home", "happy": "glad",
            "face": "expression", "red": "crimson", "blue": "azure", "green": "emerald", "flag": "banner"}

TEMPLATES = ("a picture of {}", "show me {}", "what does {} look like", "an image of {}", "{}, please")


def caption_variant(text: str, kind: str, k: int, rng: np.random.Generator) -> str:
    """The k-th variant of `kind` (CAPTION_VARIANTS) of a caption."""
    if kind == "recased":
        return recase(text, k)
    base = text.rstrip(".!?")
    words = base.split()
    if kind == "reordered":
        if len(words) < 2:
            return TEMPLATES[k % len(TEMPLATES)].format(base)
        r = 1 + k % (len(words) - 1)
        return " ".join(words[r:] + words[:r])
    if kind == "synonym":
        swapped = [SYNONYMS.get(w.lower(), w) for w in words]
        return " ".join(swapped) if swapped != words else TEMPLATES[k % len(TEMPLATES)].format(base)
    if kind == "typo":
        # a swap of two different letters (swapping the o's of "moon" made no typo: 9.5 % of Tux Paint's were
        # the caption itself, less its stop), inside a word of 4 letters or more
        spots = [(i, j) for i, w in enumerate(words) if len(w) >= 4 for j in range(1, len(w) - 2) if w[j] != w[j + 1]]
        if not spots:
            return base + base[-1:]
        i, j = spots[int(rng.integers(len(spots)))]
        w = words[i]
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
        return " ".join(words)
    if kind == "template":
        return TEMPLATES[k % len(TEMPLATES)].format(base[:1].lower() + base[1:])
    raise ValueError(f"caption variant {kind!r}: one of {sorted(CAPTION_VARIANTS)}")


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
