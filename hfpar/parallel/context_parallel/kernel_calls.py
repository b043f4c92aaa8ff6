"""Which kernel calls compute document-causal (optionally sliding-window) attention between two sets of tokens.

    ops = pair_calls(doc_row, q_segs, k_segs, window=None)     # [Op(qa, qb, ka, kb, kind, mask), ...]

q_segs / k_segs describe a tensor's sequence axis as contiguous global-position ranges: [(index, position,
length), ...] (a zigzag shard is two ranges, a ring piece one, a whole row in position order one). doc_row is the
row's document id per global position (-1 padding); documents are contiguous position ranges (the collator packs
them one after the other, padding at the end). For every document the part of each q range and k range inside it
is related by position only, so the visible region of a (q range, k range) pair is one of:
    "full"    every key before every query (an earlier chunk): the kernel without a mask
    "causal"  the same positions on both sides: the kernel's own is_causal (top-left aligned, Tq == Tk)
    "mask"    a sliding window cuts the region: the kernel with an explicit (tq, tk) mask, rows and columns with
              nothing visible trimmed off (no empty softmax row)
    "self"    padding queries, which attend to themselves only (out = v, no kernel call)
Rectangles with nothing visible are not emitted. The list is plain Python over a few integers per document, made
once per batch and ring piece and reused by every layer (RowLayout.cache).

Sliding window w (transformers' convention, masking_utils.sliding_window_overlay): key k is visible from query q
when q - w < k <= q.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Op(NamedTuple):
    qa: int  # query index range [qa, qb) in the q tensor
    qb: int
    ka: int  # key index range [ka, kb) in the k tensor
    kb: int
    kind: str  # "full" | "causal" | "mask" | "self"
    mask: torch.Tensor | None = None  # (qb - qa, kb - ka) bool, for "mask"


def runs(doc_row: list[int]) -> list[tuple[int, int, int]]:
    """[(start, end, doc id), ...] maximal runs of equal document id over positions."""
    out, start = [], 0
    for i in range(1, len(doc_row) + 1):
        if i == len(doc_row) or doc_row[i] != doc_row[start]:
            out.append((start, i, doc_row[start]))
            start = i
    return out


def _window_rect(qa, qb, ka, kb, causal: bool, window: int):
    """(qa, qb, ka, kb, kind, mask) of positions [qa, qb) x [ka, kb) (causal: qa == ka, qb == kb) under a window,
    or None when nothing is visible."""
    far = (qb - 1) - ka  # largest query - key distance in the rectangle
    if far < window:
        return qa, qb, ka, kb, "causal" if causal else "full", None
    near = 0 if causal else qa - (kb - 1)
    if near >= window:
        return None
    qb2 = min(qb, kb - 1 + window)  # rows at or past kb - 1 + w see no key
    ka2 = max(ka, qa - window + 1)  # keys at or before qa - w are seen by no row
    qp = torch.arange(qa, qb2)[:, None]
    kp = torch.arange(ka2, kb)[None, :]
    mask = (kp > qp - window) & (kp <= qp)
    return qa, qb2, ka2, kb, "mask", mask


def _pair(qa, qb, ka, kb, window):
    """Rectangles of position ranges Q = [qa, qb), K = [ka, kb) inside one document, key <= query."""
    rects = []
    if ka < min(kb, qa):  # keys before the first query: seen by every query
        rects.append((qa, qb, ka, min(kb, qa), False))
    oa, ob = max(ka, qa), min(kb, qb)
    if oa < ob:  # shared positions: causal square ...
        rects.append((oa, ob, oa, ob, True))
        if ob < qb:  # ... and the later queries see all of it
            rects.append((ob, qb, oa, ob, False))
    out = []
    for a, b, c, d, causal in rects:
        if window is None:
            out.append((a, b, c, d, "causal" if causal else "full", None))
        elif (r := _window_rect(a, b, c, d, causal, window)) is not None:
            out.append(r)
    return out


def pair_calls(doc_row: list[int], q_segs, k_segs, window: int | None = None) -> list[Op]:
    """Kernel calls covering every visible (query, key) pair of q_segs x k_segs exactly once (see module doc)."""
    doc_runs = runs(doc_row)
    ops = []
    for qi, qp, qn in q_segs:
        for ki, kp, kn in k_segs:
            for s, e, d in doc_runs:
                qa, qb, ka, kb = max(qp, s), min(qp + qn, e), max(kp, s), min(kp + kn, e)
                if qa >= qb or ka >= kb:
                    continue
                if d < 0:  # padding: each query attends to itself only
                    oa, ob = max(qa, ka), min(qb, kb)
                    if oa < ob:
                        ops.append(Op(oa - qp + qi, ob - qp + qi, oa - kp + ki, ob - kp + ki, "self"))
                    continue
                for a, b, c, dd, kind, mask in _pair(qa, qb, ka, kb, window):
                    ops.append(Op(a - qp + qi, b - qp + qi, c - kp + ki, dd - kp + ki, kind, mask))
    return ops


def segments(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(index, position, length), ...] the maximal runs of consecutive positions of a 1-D position tensor."""
    p = positions.tolist()
    out, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            out.append((start, p[start], i - start))
            start = i
    return out
