"""Text -> padded id tensors: a deterministic hashing tokenizer and a wrapper for Hugging Face ones.

Both are plain picklable callables `list[str] -> {"input_ids", "attention_mask", ...}` so that a
DataLoader worker can run them as part of `Encoder.collate`.

HashTokenizer is for randomly initialised text towers (tests, tiny configs). Words (lower-cased `\\w+` runs and single punctuation marks) map to ids by blake2b, so the same text
gives the same ids in every process and on every machine; no vocabulary file is needed. It is not a
substitute for a model's real tokenizer: pretrained weights need the tokenizer they were trained with.
"""

from __future__ import annotations

import hashlib
import json
import re

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


def tokenizer_digest(tok) -> str | None:
    """16 hex digits over what a Hugging Face tokenizer (or a wrapper of one, `.tokenizer`) turns text into ids
    with: a fast tokenizer's whole serialisation (vocabulary, merges, normaliser, pre-tokeniser, post-processor,
    added tokens; not the truncation and padding its calls set), a slow one's vocabulary, and either's special
    tokens and plain settings (paths left out, so the same files elsewhere agree). None for any other tokenizer
    (the hashing one: its settings are in the encoder's config; open_clip's bundled one: its version is the
    library's)."""
    from transformers import PreTrainedTokenizerBase

    inner = tok if isinstance(tok, PreTrainedTokenizerBase) else getattr(tok, "tokenizer", None)
    if not isinstance(inner, PreTrainedTokenizerBase):
        return None
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is not None:   # less the truncation and padding a call sets (the encoder's max_length is its config)
        backend = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    settings = {k: v for k, v in inner.init_kwargs.items()
                if isinstance(v, (str, int, float, bool, type(None))) and "file" not in k and "path" not in k}
    record = {"class": type(inner).__name__, "settings": settings,
              "special": {k: str(v) for k, v in inner.special_tokens_map.items()},
              "model": backend if backend is not None else sorted(inner.get_vocab().items())}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
