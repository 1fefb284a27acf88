"""The group vocabulary: the pairing key's names across the modalities of one or more tables, made once.

    names, index = vocabulary({"image": groups_i, "text": groups_t})
    names[index["text"][j]] == groups_t[j]        # names: sorted unique strings; index: int64 per row

The batcher, the GCCA fit, the pseudo-classes, the relevance of the retrieval metrics and the number of
training groups a module is told about all come from this one function, so they cannot disagree.
"""

from __future__ import annotations

import numpy as np


def vocabulary(groups: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(sorted unique group names as str [G], key -> int64 index into names of each row's group)."""
    arrays = {k: np.asarray(g).astype(str) for k, g in groups.items()}
    if not arrays:
        return np.zeros(0, str), {}
    names, inverse = np.unique(np.concatenate(list(arrays.values())), return_inverse=True)
    out, start = {}, 0
    for k, g in arrays.items():
        out[k] = inverse[start:start + len(g)].astype(np.int64)
        start += len(g)
    return names, out
