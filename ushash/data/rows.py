"""`Row`: one modality of one dataset item, the unit every dataset recipe produces."""

from __future__ import annotations

from dataclasses import dataclass, field

from ushash import MODALITIES


@dataclass(frozen=True)
class Row:
    """One modality of one item.

    modality: "image", "text" or "audio".
    id:       stable, unique within (split, modality); survives restarts and re-sharding.
    group:    the pairing key: rows sharing a group are each other's pairs (paired relevance).
    source:   a file path (image, audio) or the caption itself (text).
    labels:   class names for label relevance; may be empty.
    """

    modality: str
    id: str
    group: str
    source: str
    labels: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"Row {self.id!r}: unknown modality {self.modality!r}; expected one of {MODALITIES}")
        for name in ("id", "group", "source"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Row {self.id!r}: its {name} must be a string, got "
                                 f"{type(getattr(self, name)).__name__} {getattr(self, name)!r:.80}")
            # the store's digests join these with NUL: one inside would let two row lists share a digest
            if "\0" in getattr(self, name):
                raise ValueError(f"Row {self.id!r}: its {name} holds a NUL character; remove it from the data set")
        for name in ("id", "group"):   # written to the store's JSON and hashed as UTF-8 (a source is checked
            try:                       # when it is read: a caption that is not text is a failed row)
                getattr(self, name).encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"Row {self.id!r}: its {name} holds a lone surrogate "
                                 f"({getattr(self, name)[e.start]!r}); fix it in the data set") from None


def check_unique(rows: list[Row], where: str) -> None:
    """Raise if two rows of the same modality share an id (ids key resumable extraction)."""
    seen: dict[tuple[str, str], int] = {}
    dups = []
    for r in rows:
        key = (r.modality, r.id)
        if key in seen:
            dups.append(r.id)
        seen[key] = 1
    if dups:
        raise ValueError(f"{where}: {len(dups)} duplicate row ids, e.g. {dups[:5]}; ids must be unique per modality")
