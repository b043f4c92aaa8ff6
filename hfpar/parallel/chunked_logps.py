"""Per-token log-probs and entropies of an LM head's targets, computed over token chunks: the [tokens, vocab] logits
never exist at once (what an RL objective needs: a differentiable log-prob per completion token, not a loss sum).

    lp, ent = chunked_token_logps(h, weight, bias, target, group=None, chunk=2048, temperature=1.0)
    # h (N, H) the head's input rows, target (N,) token ids (IGNORE = -100: lp 0); lp (N,) fp32 differentiable
    # w.r.t. h, weight, bias; ent (N,) fp32 the entropy of each row's next-token distribution, no gradient;
    # temperature: of the distribution, softmax(logits / temperature) (a sampler's: what RL scores its tokens under)

Forward: for each chunk of C rows the logits (C, V/tp) are formed in the compute dtype, upcast to fp32 and reduced to
the log-sum-exp, the target's logit and sum(p * z) (over the tensor-parallel group when the head is vocab-parallel:
one max and one sum all-reduce per chunk); only the (N,) log-sum-exp is kept for backward. Backward: the gradient of
each log-prob is known only then (it depends on the importance ratio, the clipping, the KL), so each chunk's logits
are formed again and turned into d lp / d z = g * (one-hot - softmax): one extra head matmul per chunk instead of
(N, V) logits, their softmax and its gradient kept alive. Peak extra memory: two chunks of fp32 logits.

Under a vocab-parallel head the input gradient returned is this rank's partial sum (the head's input passed through
copy_to_parallel_region, whose backward all-reduces it), as chunked_loss's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpar.parallel.comm import all_reduce, group_rank, group_size
from hfpar.parallel.labels import IGNORE

LOGITS_PER_CHUNK = 1 << 26  # C x V/tp fp32 logits per chunk (256 MiB): C = 2048 tokens at V = 32k


def vocab_shard(weight: torch.Tensor, group, cdt: torch.dtype) -> tuple[int, int, torch.dtype]:
    """(tp degree, this rank's first vocab row, the softmax's dtype: fp32 at least) of a head's weight rows."""
    tp = group_size(group) if group is not None else 1
    return tp, group_rank(group) * weight.shape[0] if tp > 1 else 0, torch.promote_types(cdt, torch.float32)


def _local(target: torch.Tensor, start: int, width: int):
    """(valid, the target's row is in this vocab shard, its local index (0 where not))."""
    valid = target != IGNORE
    mine = valid & (target >= start) & (target < start + width)
    return valid, mine, (target - start).masked_fill(~mine, 0)


class _ChunkedTokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, target, group, chunk, cdt, temperature=1.0):
        tp, start, acc = vocab_shard(weight, group, cdt)
        n = h.shape[0]
        lp, ent, lse = (torch.zeros(n, dtype=acc, device=h.device) for _ in range(3))
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
            for s in range(0, n, chunk):
                z = _scaled(F.linear(h[s : s + chunk].to(cdt), w, b).to(acc), temperature)  # (C, V_l)
                m = z.max(dim=-1).values
                if tp > 1:
                    m = all_reduce(m, group, op=dist.ReduceOp.MAX)
                z.sub_(m.unsqueeze(-1))
                valid, mine, lt = _local(target[s : s + chunk], start, z.shape[1])
                z_t = z.gather(1, lt.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
                e = torch.exp(z)
                stats = torch.stack([e.sum(-1), z_t, torch.linalg.vecdot(e, z)])
                del e, z
                if tp > 1:
                    stats = all_reduce(stats, group)
                sum_exp, z_t, ez = stats.unbind(0)
                log_z = sum_exp.log()
                lp[s : s + chunk] = (z_t - log_z) * valid
                ent[s : s + chunk] = log_z - ez / sum_exp
                lse[s : s + chunk] = m + log_z
        ctx.save_for_backward(h, weight, bias, target, lse)
        ctx.group, ctx.chunk, ctx.cdt, ctx.start, ctx.temperature = group, chunk, cdt, start, temperature
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        h, weight, bias, target, lse = ctx.saved_tensors
        chunk, cdt = ctx.chunk, ctx.cdt
        acc = lse.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        with torch.no_grad(), torch.autocast(h.device.type, enabled=False):
            w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
            for s in range(0, h.shape[0], chunk):
                hc = h[s : s + chunk].to(cdt)
                z = _scaled(F.linear(hc, w, b).to(acc), ctx.temperature)
                z.sub_(lse[s : s + chunk].unsqueeze(-1)).exp_().neg_()  # - softmax (this vocab shard)
                valid, mine, lt = _local(target[s : s + chunk], ctx.start, z.shape[1])
                z[torch.arange(z.shape[0], device=z.device), lt] += mine.to(acc)  # + one-hot
                # d loss / d logits (the 1 / temperature of the scaled logits' chain rule)
                z.mul_((g[s : s + chunk].to(acc) * valid / ctx.temperature).unsqueeze(-1))
                if grad_h is not None:
                    grad_h[s : s + chunk] = (z.to(cdt) @ w).to(h.dtype)
                if grad_w is not None:
                    grad_w.addmm_(z.t(), hc.to(acc))
                if grad_b is not None:
                    grad_b += z.sum(0)
        out_w = grad_w.to(weight.dtype) if grad_w is not None else None
        out_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, out_w, out_b, None, None, None, None, None


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits of the distribution at `temperature` (z / T, in place: z is the chunk's own fp32 copy)."""
    return z if temperature == 1.0 else z.div_(temperature)


def chunked_apply(fn, h, weight, bias, target, group, chunk, *extra):
    """fn.apply over flattened rows (h (..., H), target (...)), in the compute dtype (autocast's, else h's), `chunk`
    rows at a time (None: LOGITS_PER_CHUNK logits of the local vocab): the one call of both chunked heads. extra: the
    function's own trailing arguments."""
    dev = h.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    chunk = chunk or max(1, LOGITS_PER_CHUNK // weight.shape[0])
    return fn.apply(h.reshape(-1, h.shape[-1]), weight, bias, target.reshape(-1), group, chunk, cdt, *extra)


def chunked_token_logps(h, weight, bias, target, *, group=None, chunk: int | None = None, temperature: float = 1.0):
    """(log softmax(F.linear(h, weight, bias) / temperature)[target], entropy) per row, chunked over rows (see the
    module docstring). h (..., H) and target (...) flattened alike; weight the local vocab rows of a vocab-parallel
    head when group is its tensor-parallel group. Under autocast the matmuls run in the autocast dtype, the softmax in
    fp32."""
    return chunked_apply(_ChunkedTokenLogps, h, weight, bias, target, group, chunk, float(temperature))
