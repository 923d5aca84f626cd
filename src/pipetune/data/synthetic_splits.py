"""The synthetic data set's splits: disjoint train and validation meetings, short or whole, each from its own seed.

Short meetings are data/synthetic.py's, whole ones data/synthetic_whole.py's (which builds on the short ones'
parts): this module picks between them, so neither imports the other's caller.
"""

from __future__ import annotations

import hashlib

from pipetune.config import SYNTHETIC_LENGTHS
from pipetune.data.synthetic import Meeting, generate_meetings
from pipetune.data.synthetic_whole import generate_whole_meetings


def _derive_seed(seed: int, split: str) -> int:
    digest = hashlib.sha256(f"pipetune-synthetic/{seed}/{split}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def synthetic_splits(
    seed: int = 0, n_train: int = 256, n_validation: int = 32, lengths: str = "short"
) -> dict[str, list[Meeting]]:
    """Disjoint "train" and "validation" splits, each generated from its own seed derived from ``seed``;
    ``lengths`` is data.synthetic_lengths: "short" meetings (synthetic.generate_meetings: 12-40 turns, a few hundred
    tokens) or "whole" ones (synthetic_whole.generate_whole_meetings: ~6,000 tokens, up to ~30,000)."""
    if lengths == "short":
        generate = generate_meetings
    elif lengths == "whole":
        generate = generate_whole_meetings
    else:
        raise ValueError(f"lengths={lengths!r} is unknown; use one of {', '.join(SYNTHETIC_LENGTHS)}")
    train = generate(n_train, seed=_derive_seed(seed, "train"))
    seen = {meeting.transcript for meeting in train}
    # A validation meeting equal to a train one is astronomically unlikely but would leak: skip it.
    n_drawn = n_validation
    while True:
        drawn = generate(n_drawn, seed=_derive_seed(seed, "validation"))
        validation = [meeting for meeting in drawn if meeting.transcript not in seen]
        if len(validation) >= n_validation:
            return {"train": train, "validation": validation[:n_validation]}
        n_drawn += n_validation - len(validation)
