"""LightningDataModule over the feature store: batches of groups, each with one row per modality.

A training batch is a dict `modality -> (x [B, D], group [B] int64, present [B] bool)`. Batches are drawn
over groups (the pairing key). For every group in the batch each modality contributes one of its rows
(chosen at random when a group has several, e.g. five captions), or is marked absent (a stamp without a
sound), so any pair of modalities present in the data is trained on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ushash.core.groups import vocabulary
from ushash.data.store import FeatureSplit, open_split


class GroupBatches(Dataset):
    def __init__(self, split: FeatureSplit, modalities: tuple[str, ...], seed: int = 0, in_memory: bool = True):
        self.modalities = [m for m in modalities if m in split.tables]
        if len(self.modalities) < 2:
            raise ValueError(f"{split.path}: cross-modal training needs two modalities, found {split.modalities}")
        names, index = vocabulary({m: split.tables[m].groups for m in self.modalities})
        self.groups = list(names)  # the training groups: their count is the module's n_train_groups
        self.x, self.members = {}, {}
        for m in self.modalities:
            t = split.tables[m]
            self.x[m] = torch.from_numpy(np.array(t.x, dtype=np.float32)) if in_memory else t.x
            members: list[list[int]] = [[] for _ in names]
            for row, g in enumerate(index[m]):
                members[g].append(row)
            self.members[m] = members
        self.rng = np.random.default_rng(seed)
        self._labels: torch.Tensor | None = None  # label_matrix, made on first use

    def label_matrix(self, split: FeatureSplit) -> torch.Tensor:
        """[n groups, n labels] float 0/1: the class labels of each training group (the union over its rows of
        every modality); a group whose rows carry no label has an all-zero row. Made once."""
        if self._labels is None:
            per_group: list[set] = [set() for _ in self.groups]
            for m in self.modalities:
                labels = split.tables[m].labels
                for g, rows in enumerate(self.members[m]):
                    for r in rows:
                        per_group[g].update(labels[r])
            vocab = {lab: i for i, lab in enumerate(sorted(set().union(*per_group)))}
            mat = torch.zeros(len(self.groups), max(len(vocab), 1))
            for g, labs in enumerate(per_group):
                for lab in labs:
                    mat[g, vocab[lab]] = 1.0
            self._labels = mat
        return self._labels

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, g: int):
        return g

    def collate(self, gs: list[int]) -> dict:
        out = {}
        g_t = torch.as_tensor(gs, dtype=torch.long)
        for m in self.modalities:
            rows = [self.members[m][g] for g in gs]
            present = torch.tensor([len(r) > 0 for r in rows])
            idx = [r[self.rng.integers(len(r))] if r else 0 for r in rows]
            x = self.x[m][idx] if isinstance(self.x[m], torch.Tensor) else torch.from_numpy(np.asarray(self.x[m][idx]))
            out[m] = (x, g_t, present)
        return out


class FeatureDataModule(pl.LightningDataModule):
    """Reads train/val splits from finished feature-store folders. Batches are made in this process (no
    DataLoader workers): they index rows already in memory, and the row draws stay those of one generator,
    which a worker would copy and replay each epoch."""

    def __init__(self, train_path: str, val_path: str, modalities: list[str], batch_size: int = 256,
                 seed: int = 0):
        super().__init__()
        self.train_path, self.val_path = Path(train_path), Path(val_path)
        self.modalities, self.batch_size, self.seed = tuple(modalities), batch_size, seed
        self.train_split = self.val_split = None

    def setup(self, stage: str | None = None):
        if self.train_split is None:
            self.train_split = open_split(self.train_path)
            self.val_split = open_split(self.val_path)
            self.train_set = GroupBatches(self.train_split, self.modalities, seed=self.seed)

    def train_dataloader(self):
        # Keep the last partial batch: on small sets (766 Tux Paint stamps) dropping it loses a third of the data.
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=False,
                          collate_fn=self.train_set.collate)

    def val_dataloader(self):
        # Validation is computed on whole tables in the module's on_validation_epoch_end; one dummy batch.
        return DataLoader([0], batch_size=1)
