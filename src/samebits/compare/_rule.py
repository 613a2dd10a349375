"""The one comparison rule of every verdict: when two records of one identity count as equal."""

from __future__ import annotations

from samebits.stream.reader import Record

EQUAL, DIFFERS, SHAPE_ONLY = "equal", "differs", "shape_only"


def record_match(rec_a: Record, rec_b: Record) -> str:
    """EQUAL only when both records hold their value's digest (or a metric's bits, or both are
    None) and those agree; SHAPE_ONLY (compared, never counted equal) when a tensor has no digest
    on a side but dtype and shape agree; anything else DIFFERS."""
    if rec_a.kind == rec_b.kind == "tensor" and not (rec_a.absent and rec_b.absent) and \
            (rec_a.capped or rec_b.capped or rec_a.digest is None or rec_b.digest is None):
        return SHAPE_ONLY if same_shape(rec_a, rec_b) else DIFFERS
    return EQUAL if rec_a.same_content(rec_b) else DIFFERS


def same_shape(rec_a: Record, rec_b: Record) -> bool:
    """Two tensor records that agree in everything a capped record keeps (dtype, shape)."""
    return (rec_a.kind == rec_b.kind == "tensor" and not rec_a.absent and not rec_b.absent
            and rec_a.dtype == rec_b.dtype and rec_a.shape == rec_b.shape)

__all__ = ["record_match", "same_shape", "EQUAL", "DIFFERS", "SHAPE_ONLY"]
