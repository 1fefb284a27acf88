"""`tiny`: randomly initialised, seeded, fast encoders for tests and smoke runs.

Not meaningful features: the point is exercising every code path in milliseconds. The same
(seed, dims, sizes) give the same weights, hence the same features and fingerprint, everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from torch import nn

from ushash.encoders.base import Encoder, Part, audio_to_length, register, seeded
from ushash.encoders.tokenizing import HashTokenizer


class TinyImage(Part):
    """Two strided convolutions on a `size` x `size` RGB image, mean-pooled, projected to `dim`."""

    def __init__(self, dim: int, size: int = 32):
        super().__init__()
        self.dim, self.size = dim, size
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, dim),
        )

    def preprocess(self, raw: Image.Image) -> torch.Tensor:
        img = raw.convert("RGB").resize((self.size, self.size), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1)
        return x / 127.5 - 1.0

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.net(batch)


class TinyText(Part):
    """Hashed words -> mean of learned word vectors (an EmbeddingBag)."""

    def __init__(self, dim: int, vocab_size: int = 4096, max_length: int = 64):
        super().__init__()
        self.dim = dim
        self.tokenizer = HashTokenizer(vocab_size, max_length)
        self.bag = nn.EmbeddingBag(vocab_size, dim, mode="mean")

    def preprocess(self, raw: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.ids(raw), dtype=torch.long)

    def collate(self, items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        lengths = torch.tensor([len(t) for t in items], dtype=torch.long)
        offsets = torch.cumsum(lengths, 0) - lengths
        ids = torch.cat(items) if items else torch.zeros(0, dtype=torch.long)
        return {"ids": ids, "offsets": offsets}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.bag(batch["ids"], batch["offsets"])  # an empty text gives a zero vector


class TinyAudio(Part):
    """Two strided 1-D convolutions on the raw wave, mean-pooled, projected to `dim`."""

    def __init__(self, dim: int, sample_rate: int = 16000, seconds: float = 1.0):
        super().__init__()
        self.dim, self.sample_rate, self.seconds = dim, sample_rate, seconds
        self.net = nn.Sequential(
            nn.Conv1d(1, 16, 64, stride=16),
            nn.ReLU(),
            nn.Conv1d(16, 32, 8, stride=4),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(32, dim),
        )

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(audio_to_length(raw, self.sample_rate, self.seconds).copy())

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.net(batch.unsqueeze(1))


@register("tiny")
class TinyEncoder(Encoder):
    """Random-init image/text/audio towers. `dim`: one int for all modalities, or {modality: int}."""

    def __init__(
        self,
        dim: int | Mapping[str, int] = 32,
        modalities: Sequence[str] = ("image", "text", "audio"),
        seed: int = 0,
        image_size: int = 32,
        vocab_size: int = 4096,
        sample_rate: int = 16000,
        audio_seconds: float = 1.0,
        device: str | torch.device | None = None,
        amp: bool = True,
    ):
        super().__init__(device=device, amp=amp)
        dims = dict(dim) if isinstance(dim, Mapping) else {m: int(dim) for m in modalities}
        missing = [m for m in modalities if m not in dims]
        if missing:
            raise ValueError(f"tiny encoder: no dim given for {missing}")
        builders = {
            "image": lambda: TinyImage(dims["image"], image_size),
            "text": lambda: TinyText(dims["text"], vocab_size),
            "audio": lambda: TinyAudio(dims["audio"], sample_rate, audio_seconds),
        }
        unknown = [m for m in modalities if m not in builders]
        if unknown:
            raise ValueError(f"tiny encoder: unknown modalities {unknown}; choose from {list(builders)}")
        for m in modalities:
            with seeded(seed):  # per part, so a tower's weights do not depend on which others exist
                self.parts[m] = builders[m]()
        if "audio" in self.parts:
            self.sample_rate, self.audio_seconds = sample_rate, audio_seconds
        self._finish(
            dict(dim=dims, modalities=list(self.parts), seed=seed, image_size=image_size,
                 vocab_size=vocab_size, sample_rate=sample_rate, audio_seconds=audio_seconds)
        )
