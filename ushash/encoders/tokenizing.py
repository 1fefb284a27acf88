"""Text -> padded id tensors: a deterministic hashing tokenizer and a wrapper for Hugging Face ones.

Both are plain picklable callables `list[str] -> {"input_ids", "attention_mask", ...}` so that a
DataLoader worker can run them as part of `Encoder.collate`.

HashTokenizer is for randomly initialised text towers (tests, tiny configs). Words (lower-cased `\\w+` runs and single punctuation marks) map to ids by blake2b, so the same text
gives the same ids in every process and on every machine; no vocabulary file is needed. It is not a
substitute for a model's real tokenizer: pretrained weights need the tokenizer they were trained with.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class HashTokenizer:
    """Map words into the non-special ids of a `vocab_size` vocabulary.

    With `bos_id`/`eos_id` set, every sequence is wrapped as [bos] words [eos]; `pad_id` fills the
    rest of a batch. Sequences longer than `max_length` are cut (keeping the final eos).
    """

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        pad_id: int = 0,
        bos_id: int | None = None,
        eos_id: int | None = None,
    ):
        self.vocab_size = int(vocab_size)
        self.max_length = int(max_length)
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.special = sorted({i for i in (pad_id, bos_id, eos_id) if i is not None})
        if any(not 0 <= i < self.vocab_size for i in self.special):
            raise ValueError(f"special token ids {self.special} must lie in [0, {self.vocab_size})")
        if self.vocab_size - len(self.special) < 1:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no room for words")
        n_wrap = (bos_id is not None) + (eos_id is not None)
        if self.max_length <= n_wrap:
            raise ValueError(f"max_length {self.max_length} is too short")

    def word_id(self, word: str) -> int:
        h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
        i = h % (self.vocab_size - len(self.special))
        for s in self.special:  # skip over the special ids, in ascending order
            if i >= s:
                i += 1
        return i

    def n_tokens(self, text: str) -> int:
        """The tokens `text` has, before a cut to max_length (bos and eos included)."""
        return len(words(text)) + (self.bos_id is not None) + (self.eos_id is not None)

    def ids(self, text: str) -> list[int]:
        body = [self.word_id(w) for w in words(text)]
        room = self.max_length - (self.bos_id is not None) - (self.eos_id is not None)
        body = body[:room]
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else []
        return head + body + tail

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Padded batch: {"input_ids": long [B, L], "attention_mask": long [B, L]}."""
        seqs = [self.ids(t) for t in texts]
        length = max(1, max((len(s) for s in seqs), default=1))
        input_ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for row, s in enumerate(seqs):
            input_ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
            attention_mask[row, : len(s)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


#: Files a Hugging Face tokenizer is read from besides its class's vocabulary files (`vocab_files_names`)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def tokenizer_digest(tok) -> str | None:
    """16 hex digits over the files a Hugging Face tokenizer (or a wrapper of one, `.tokenizer`) was read from:
    the name and bytes of each of its class's vocabulary files (vocab.txt, merges.txt, tokenizer.json,
    spiece.model, ...) and of `TOKENIZER_FILES` that its folder holds. The files, not the object: the same files
    read by another transformers version, from another folder or through the hub's cache give the same digest.
    None for a tokenizer not read from a folder found here (the hashing one: its settings are in the encoder's
    config; open_clip's bundled one: its version is the library's; one made in memory)."""
    from transformers import PreTrainedTokenizerBase

    inner = tok if isinstance(tok, PreTrainedTokenizerBase) else getattr(tok, "tokenizer", None)
    if not isinstance(inner, PreTrainedTokenizerBase):
        return None
    folder = _tokenizer_folder(str(getattr(inner, "name_or_path", "") or ""))
    if folder is None:
        return None
    names = {*TOKENIZER_FILES, *(v for v in (getattr(inner, "vocab_files_names", None) or {}).values()
                                 if isinstance(v, str))}
    h, read = hashlib.sha256(), 0
    for name in sorted(names):
        path = folder / name
        if path.is_file():
            data = path.read_bytes()
            h.update(f"{name}\0{len(data)}\0".encode())
            h.update(data)
            read += 1
    return h.hexdigest()[:16] if read else None


def _tokenizer_folder(name_or_path: str) -> Path | None:
    """The folder a tokenizer was read from: a local folder, or a hub id's snapshot in the local cache."""
    if not name_or_path:
        return None
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "tokenizer_config.json")
    except Exception:   # not a repo id (a path that does not exist), no hub library
        return None
    return Path(cached).parent if isinstance(cached, str) else None


class HFTokenizer:
    """A Hugging Face tokenizer with fixed padding/truncation settings; returns a dict of tensors."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, int(max_length)

    def n_tokens(self, text: str) -> int:
        """The tokens `text` has, before a cut to max_length (special tokens included)."""
        return len(self.tokenizer(text, truncation=False, verbose=False)["input_ids"])

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        return dict(enc)
