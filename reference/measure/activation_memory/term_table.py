"""The term table both blocks' explanations are built from (gpt2_block.py, llama_block.py): the saved-tensor
records tallied into named terms by a block's own classifier, then one Row per term with the paper's bytes,
the closed form's and the counted ones. A record no term fits, or counted bytes of a term the configuration
has no row for, is an error: an unexplained byte."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import NamedTuple

from reference.measure.activation_memory.counting import SavedTensor

SAME = "same"  # the reason of a term whose bytes are the paper's


class Term(NamedTuple):
    key: str  # what the block's classifier calls it
    words: str  # how the table names it, with its closed form
    paper_bytes: Fraction  # the bytes of the paper's term(s) it is, or replaces (0: none)
    expected_bytes: Fraction  # the closed form for the block
    reason: str  # why expected differs from the paper's bytes, or "same"


@dataclasses.dataclass(frozen=True)
class Row:
    term: str  # the term's words
    paper_bytes: int
    expected_bytes: int  # the closed form: the paper's bytes corrected by the stated reason
    measured_bytes: int  # counted with the saved-tensor hooks
    reason: str


def tally(saved: list[SavedTensor], key_of: Callable[[SavedTensor], str | None]) -> dict[str, int]:
    """Bytes per term key; `key_of` names a record's term, None when it cannot."""
    out: dict[str, int] = {}
    for record in saved:
        key = key_of(record)
        if key is None:
            raise ValueError(f"unexplained saved tensor {record}: no term of the paper or the block fits it")
        out[key] = out.get(key, 0) + record.nbytes
    return out


def table(terms: Iterable[Term], measured: dict[str, int]) -> list[Row]:
    """One Row per term, in order, with its tallied bytes (0 when nothing was saved for it)."""
    left = dict(measured)
    rows = [Row(t.words, whole(t.paper_bytes), whole(t.expected_bytes), left.pop(t.key, 0), t.reason) for t in terms]
    if left:
        raise ValueError(f"saved tensors of terms the configuration should not have: {left}")
    return rows


def whole(value: Fraction) -> int:
    if value.denominator != 1:
        raise ValueError(f"{value} bytes is not whole: pick sizes the tensor-parallel size t divides")
    return int(value)
