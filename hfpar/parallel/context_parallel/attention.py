"""Context-parallel attention for HF models: each rank holds T / cp tokens of every row; attention is exact over
the whole row, causal within each document of a packed row, whichever way the cut splits the documents.

    register_cp_attention()                                   # once: "hfpar_cp" in transformers' registry
    model.set_attn_implementation("hfpar_cp")
    with cp_rows(rows, cp_group, mode="ring"):                # forward AND backward (checkpoint recompute)
        loss = loss_fn(model(**local_batch).logits, ...)
        loss.backward()

Two mechanisms (q, k, v arrive as (B, H, T/cp, D) on every rank, in the rank's zigzag token order):
  ring     each rank keeps its queries; K / V pieces travel the ring (batched isend / irecv) while the current
           piece is computed (ring.py), so K / V memory per rank is O(T / cp). Works for any head count.
           overlap=False: the all-gather form (K, V of the whole row gathered, blockwise.py), kept as an option.
  ulysses  all-to-all from sequence-sharded (B, H, T/cp, D) to head-sharded (B, H/cp, T, D), full-row attention
           on the local heads, all-to-all back. Needs H divisible by cp; kv heads fewer than cp (or not
           divisible by it) are repeated to the query heads first, not refused.
Both compute every block with the device's fused kernel (fused.py / kernels.py: flash attention with its
log-sum-exp on CPU and CUDA), one call per document part of a block, so packed documents never attend to each
other; padding tokens attend to themselves only (no empty softmax row, no NaN). Sliding windows (the registry's
`sliding_window=`, per layer) cut the blocks' kernel calls (kernel_calls.py). Logit soft-capping (`softcap=`, Gemma 2)
has no fused kernel: those layers take the named fallback, blockwise.block_attention (ring: its all-gather form).
A `chunked_attention` layer (the config's layer_types: Llama 4) attends within chunks of attention_chunk_size
positions too (RowLayout.chunked: the chunks become documents of the layout); a query scaling by the token's index in
the row (Llama 4's attention temperature) is applied with the whole row's index (temperature.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers  # transformers.AttentionInterface when registering (hfpar/parallel/exports.py says why)

from ..comm import all_to_all_single_autograd, group_rank, group_size
from .blockwise import BLOCK, block_attention
from .fused import fused_attention
from .layout import RowLayout
from .ring import overlapped_ring_attention
from .state import MODES, _state, cp_row_slice, cp_rows, current_layout, current_tops  # noqa: F401 (this module's API)
from .temperature import temperature

NAME = "hfpar_cp"


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)  # (B, Hkv * n, T, D)


def ring_attention(
    q,
    k,
    v,
    rows: RowLayout,
    group,
    scaling=None,
    block: int = BLOCK,
    *,
    window=None,
    softcap=None,
    sink=None,
    overlap: bool = True,
    pieces: int = 4,
) -> torch.Tensor:
    """(B, H, Tl, D) local queries; k, v (B, Hkv, Tl, D) local -> (B, H, Tl, D). overlap=False, or a softcap:
    the all-gather form over blockwise attention (`block` rows per block). sink: (H,) attention-sink logits."""
    if softcap or not overlap:
        return block_attention(
            q,
            k,
            v,
            rows.doc,
            rows.local,
            rows.order,
            scaling,
            group=group,
            block=block,
            window=window,
            softcap=softcap,
            sink=sink,
        )
    if group_size(group) == 1:
        return fused_attention(q, k, v, rows, rows.local, rows.local, scaling, window, sink)
    return overlapped_ring_attention(q, k, v, rows, group, scaling, window, pieces, sink)


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, Tl, D) -> (B, H/cp, cp*Tl, D): head block j to rank j, sequence blocks concatenated in rank order."""
    cp = group_size(group)
    b, h, t, d = x.shape
    x = x.reshape(b, cp, h // cp, t, d).permute(1, 0, 2, 3, 4).contiguous()  # (cp, B, H/cp, Tl, D)
    x = all_to_all_single_autograd(x.reshape(cp, -1), None, None, group)  # row j <- rank j's block
    return x.reshape(cp, b, h // cp, t, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of _seq_to_heads: (B, H/cp, cp*Tl, D) -> (B, H, Tl, D)."""
    cp = group_size(group)
    b, hl, t_all, d = x.shape
    t = t_all // cp
    x = x.reshape(b, hl, cp, t, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H/cp, Tl, D)
    x = all_to_all_single_autograd(x.reshape(cp, -1), None, None, group)
    return x.reshape(cp, b, hl, t, d).permute(1, 0, 2, 3, 4).reshape(b, cp * hl, t, d)


def ulysses_attention(
    q, k, v, rows: RowLayout, group, scaling=None, block: int = BLOCK, *, window=None, softcap=None, sink=None
) -> torch.Tensor:
    cp = group_size(group)
    h, hkv = q.shape[1], k.shape[1]
    if h % cp:
        raise ValueError(
            f"ulysses attention: {h} attention heads (per TP rank) are not divisible by cp_size {cp}; "
            "use --cp_mode ring"
        )
    if hkv % cp:  # too few kv heads: repeat them
        k, v = _repeat_kv(k, h // hkv), _repeat_kv(v, h // hkv)
    order = rows.order  # equals rows.local at cp 1
    qh, kh, vh = (_seq_to_heads(x, group) for x in (q, k, v))  # (B, H/cp, T, D) gathered order
    if sink is not None:  # this rank's block of heads (head block j to rank j)
        j = group_rank(group)
        sink = sink[j * (h // cp) : (j + 1) * (h // cp)]
    if softcap:  # no fused kernel soft-caps: the blockwise fallback
        out = block_attention(
            qh, kh, vh, rows.doc, order, order, scaling, block=block, window=window, softcap=softcap, sink=sink
        )
    else:  # positions in order: one causal kernel call per document (and window band)
        inv = torch.argsort(order)
        qh, kh, vh = (x.index_select(2, inv) for x in (qh, kh, vh))  # (B, H/cp, T, D) position order
        pos = torch.arange(inv.numel(), device=inv.device)
        out = fused_attention(qh, kh, vh, rows, pos, pos, scaling, window, sink).index_select(2, order)
    return _heads_to_seq(out, group)


def cp_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature; returns ((B, Tl, H, D), None) like sdpa_attention_forward."""
    state = getattr(_state, "cur", None)
    if state is None:
        raise RuntimeError(
            "hfpar_cp attention called outside `with cp_rows(...)`: the row layout of the batch is "
            "unknown (the trainer sets it; in your own loop, shard the batch with shard_batch)"
        )
    if dropout:
        raise ValueError("context-parallel attention: attention dropout is not supported; set attention_dropout 0")
    rows, group, mode = state
    query = temperature(module, query, rows.local)  # Llama 4's NoPE layers: scaled by whole-row indices
    rows = _layer_rows(module, rows)
    dq, dv = query.shape[-1], value.shape[-1]
    if dq != dv:  # MLA (DeepSeek-V2/V3): the fused kernels take one head size; zero columns change no dot product
        scaling = dq**-0.5 if scaling is None else scaling  # and no output column kept
        query, key, value = (F.pad(x, (0, max(dq, dv) - x.shape[-1])) for x in (query, key, value))
    # an emulated group (shard_check.py: cp ranks as threads of one process) brings its own exchange
    fn = getattr(group, "attention", None) or (ring_attention if mode == "ring" else ulysses_attention)
    out = fn(
        query,
        key,
        value,
        rows,
        group,
        scaling,
        window=kwargs.get("sliding_window") or None,
        softcap=kwargs.get("softcap") or None,
        sink=kwargs.get("s_aux"),  # attention sinks (GPT-OSS): (H,) logits, one per (this TP rank's) head
    )
    return out[..., :dv].transpose(1, 2).contiguous(), None


def _layer_rows(module, rows: RowLayout) -> RowLayout:
    """The rows as this layer attends over them: a `chunked_attention` layer (the config's layer_types, as
    transformers builds its masks) within chunks of the config's attention_chunk_size as well (RowLayout.chunked)."""
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if isinstance(idx, int) and types and idx < len(types) and types[idx] == "chunked_attention":
        return rows.chunked(config.attention_chunk_size)
    return rows


def register_cp_attention() -> str:
    transformers.AttentionInterface.register(NAME, cp_attention_forward)
    return NAME
