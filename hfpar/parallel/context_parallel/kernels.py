"""The device's fused attention kernel for one block, forward returning the log-sum-exp, and its own backward.

    out, lse = attend(q, k, v, kind, mask, scale)                   # kind "full" | "causal" | "mask"
    dq, dk, dv = attend_backward(dout, q, k, v, out, lse, kind, mask, scale)

q (B, H, tq, D), k / v (B, Hkv, tk, D) with H a multiple of Hkv; lse (B, H, tq) in float32 (float64 for float64
inputs). attend_backward takes the *merged* output and log-sum-exp of the query rows (over every block they saw):
a flash-attention backward then yields exactly this block's share of dq, dk, dv (its probabilities are
exp(s - lse_merged), delta = rowsum(dout * out_merged)), which is how the ring merges backward without a second
softmax pass.

The kernels (private aten ops, why: docs/architecture.md#why-the-parallel-layers):
    CPU   aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): any float dtype, GQA, an additive mask.
    CUDA  aten._scaled_dot_product_flash_attention (fp16 / bf16, no mask: GQA kv heads taken as they are) or
          aten._scaled_dot_product_efficient_attention (fp32, or a mask as an additive bias; kv heads repeated
          for GQA and their gradients summed back).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _bias(mask: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _cpu_forward(q, k, v, causal, mask, scale):
    bias = None if mask is None else _bias(mask.to(q.device), q.dtype)
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal, mask, scale):
    bias = None if mask is None else _bias(mask.to(q.device), q.dtype)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _repeat(x, n):
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _unrepeat(g, n):
    return g if n == 1 else g.unflatten(1, (-1, n)).sum(2)


def _cuda_bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(B, H, tq, tk) additive bias for the efficient kernel, which needs each bias row 16-byte aligned (a stride
    that is a multiple of 4 fp32 / 8 bf16 values): allocated with tk padded to a multiple of 16, then sliced."""
    tk = mask.shape[-1]
    bias = torch.zeros(*mask.shape[:-1], tk + (-tk) % 16, dtype=q.dtype, device=q.device)[..., :tk]
    return bias.masked_fill_(~mask.to(q.device), float("-inf")).expand(q.shape[0], q.shape[1], -1, -1)


def _use_flash(q, mask) -> bool:
    return mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _half_masked(q, mask) -> bool:
    """A window-cut block in bf16 / fp16 (the edges of a sliding-window band, few per row): run in fp32.
    why: docs/architecture.md#why-the-parallel-layers"""
    return mask is not None and q.dtype in (torch.float16, torch.bfloat16)


def _cuda_forward(q, k, v, causal, mask, scale):
    if _half_masked(q, mask):
        out, lse = _cuda_forward(q.float(), k.float(), v.float(), causal, mask, scale)
        return out.to(q.dtype), lse
    if _use_flash(q, mask):  # flash takes fewer kv heads (GQA) as they are
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    n = q.shape[1] // k.shape[1]
    k, v = _repeat(k, n), _repeat(v, n)
    bias = None if mask is None else _cuda_bias(mask, q)
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]  # the efficient kernel pads lse rows to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, causal, mask, scale):
    if _half_masked(q, mask):  # fp32 gradients: the callers accumulate in fp32
        return _cuda_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, causal, mask, scale)
    n = q.shape[1] // k.shape[1]
    tq, tk = q.shape[2], k.shape[2]
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout is 0: the philox state is not read
    if _use_flash(q, mask):  # GQA as in forward: dk, dv come with the kv heads
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, tq, tk, 0.0, causal, seed, seed, scale=scale
        )[:3]
    bias = None if mask is None else _cuda_bias(mask, q)
    lse = torch.nn.functional.pad(lse.float(), (0, (-tq) % 32)).contiguous()
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        _repeat(k, n),
        _repeat(v, n),
        bias,
        out,
        lse,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, _unrepeat(dk, n), _unrepeat(dv, n)


def _common(*xs):
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return tuple(x.to(dt) for x in xs)


def attend(q, k, v, kind: str, mask, scale: float):
    """(out (B, H, tq, D) in q's dtype, lse (B, H, tq)) of one block; kind "full", "causal" or "mask"."""
    fwd = _cpu_forward if q.device.type == "cpu" else _cuda_forward
    q, k, v = _common(q, k, v)  # under autocast q, k (roped in fp32) and v (bf16) can differ: one dtype, as SDPA
    return fwd(q, k, v, kind == "causal", mask, scale)


def attend_backward(dout, q, k, v, out, lse, kind: str, mask, scale: float):
    """This block's (dq, dk, dv), given the merged output and log-sum-exp of its query rows."""
    bwd = _cpu_backward if q.device.type == "cpu" else _cuda_backward
    dout, q, k, v, out = _common(dout, q, k, v, out)
    return bwd(dout, q, k, v, out, lse, kind == "causal", mask, scale)
