"""Variable-length attention over padding-free rows (`--attn_implementation hfpar_varlen`): each sample attends
only to itself, and no work is spent on the masked-out pairs between samples.

    register()                                                  # once, before the model is built
    model = AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    model(input_ids=ids, position_ids=pos, labels=labels)       # (1, T) rows, position ids restarting per sample

Why hfpar writes this: transformers' sdpa / eager paths for packed rows build a (T, T) block-diagonal mask and
compute every masked block (SDPA's masked kernels skip none); its varlen path needs the flash-attn package (or a hub
download), and flex attention has no backward on CPU. torch ships FlashAttention-2's varlen kernel itself
(torch.nn.attention.varlen.varlen_attn), so this runs it on CUDA (bf16 / fp16, head dims <= 256) with nothing else
to install, and elsewhere (CPU, fp32) computes the same attention one sample at a time with SDPA: exact, and what
the CPU tests hold against sdpa's masked attention (tests/unit/test_varlen_attention.py).

The samples' bounds come with the batch as transformers' flash kwargs (cu_seq_lens_q / max_length_q): hfpar's
one-row batches carry them (hfpar.data.collate.flash_kwargs, computed on the host), and so do transformers'
DataCollatorWithFlattening(return_flash_attn_kwargs=True) batches; then nothing is read back from the device and,
under torch.compile, the kernel is traced with its block. Without them they are found from the position ids the
way transformers' masking_utils.find_packed_sequence_indices finds them (a new sample wherever a position id is not
the previous one + 1, and at every row start), once per forward (every layer gets the same position_ids tensor):
one host sync per forward on CUDA and a graph break per block under torch.compile.

Refused loudly where it would compute something else: an attention mask (padded rows), a KV cache or q / k lengths
that differ (generation), attention dropout, logit soft-capping, attention sinks, position biases, a bidirectional
module (an encoder, a vision tower), and, without the flash kwargs, no position ids reaching the attention or
position ids that are not one per token (multimodal 3-D positions).
"""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn.functional as F
import transformers  # its registries imported on registering, not here (hfpar/parallel/exports.py: why)

from hfpar.data.collate import sample_bounds
from hfpar.train import VARLEN

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older torch: the per-sample SDPA path only
    varlen_attn = None
# torch 2.13's varlen_attn takes enable_gqa; 2.11's has no such argument (k / v then get the query's heads here)
_GQA_ARG = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters

NAME = VARLEN
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_cache: list = [None, None, None]  # [weakref to the position_ids tensor, its _version, (cu_seqlens, bounds)]


def register() -> str:  # also hfpar.register_varlen_attention
    """Adds hfpar_varlen to transformers' attention and mask registries (idempotent); returns the name."""
    transformers.AttentionInterface.register(NAME, varlen_attention_forward)
    # no (T, T) mask: None, or a 2-D padding mask that the attention refuses (padded rows have no place here)
    masks = transformers.masking_utils
    masks.ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, masks.flash_attention_mask)
    return NAME


register_varlen_attention = register  # the name hfpar exports (users' own code: Trainer, TRL, a plain loop)


def segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """position_ids (B, T) -> (cu_seqlens int32 (N + 1,) on their device, the same boundaries as ints) over the
    B * T tokens flattened: a sample starts at every row start and wherever a position is not the previous + 1."""
    ref, version, value = _cache
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return value
    cu = sample_bounds(position_ids)  # the host sync of a forward
    value = (cu, cu.tolist())
    _cache[:] = [weakref.ref(position_ids), position_ids._version, value]
    return value


def _flash_applies(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's FlashAttention-2 varlen kernel takes q (T, H, D) / v: CUDA, bf16 / fp16, head dims <= 256."""
    d = q.shape[-1]
    return varlen_attn is not None and q.is_cuda and q.dtype in _FLASH_DTYPES and d <= 256 and v.shape[-1] == d


def _refuse(why: str):
    raise ValueError(f"--attn_implementation {NAME}: {why}")


_BUCKET = 0.8  # a group's samples are >= 0.8 x its longest: right-padding costs at most 1 / 0.8**2 = 1.56x


def _groups(lengths: list[int]) -> list[list[int]]:
    """Sample indices, longest first, in groups whose shortest is >= _BUCKET x their longest."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[i] >= _BUCKET * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _per_sample(q, k, v, bounds: list[int], scale, window: int | None, gqa: bool) -> torch.Tensor:
    """q (T, H, D), k / v (T, Hkv, D): each sample's causal SDPA on its own tokens -> (T, H, D).

    Samples of similar lengths go through one SDPA call (`_groups`), each right-padded to its group's longest: under
    the causal mask no real query sees a pad key (they all come after it), so each sample's result is its own
    attention's; one call per sample would pay Python and autograd work per sample and layer. Inputs 4-D: SDPA's
    fused CPU kernel takes nothing else (3-D runs the math path, which keeps every score matrix)."""
    t, h, dv = q.shape[0], q.shape[1], v.shape[-1]
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    q, k, v = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (q, k, v))  # row t: the pad token (zeros)
    where, outs = [], []
    for g in _groups(lengths):
        n = lengths[g[0]]
        span = torch.arange(n)
        idx = starts[g, None] + span  # (G, n) token rows of the group's samples
        idx = torch.where(span < torch.tensor([lengths[i] for i in g])[:, None], idx, t).to(q.device)
        qs, ks, vs = (x[idx].transpose(1, 2) for x in (q, k, v))  # (G, heads, n, D)
        mask, causal = None, True
        if window is not None and n > window:  # transformers' sliding window: key j visible from i when i - j < window
            i = torch.arange(n, device=q.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
            causal = False
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        where.append(idx.reshape(-1))
        outs.append(o.transpose(1, 2).reshape(-1, h, dv))
    # every real token written once; the pads' rows all land on row t, which is dropped
    return q.new_zeros(t + 1, h, dv).index_put((torch.cat(where),), torch.cat(outs))[:t]


@torch.compiler.disable  # data-dependent sample boundaries: a graph break under --torch_compile
def _found(position_ids: torch.Tensor, t: int) -> tuple[torch.Tensor, list[int]]:
    return segments(position_ids if position_ids.dim() == 2 else position_ids.reshape(-1, t))


@torch.compiler.disable  # a loop over the samples
def _per_sample_of(q, k, v, cu: torch.Tensor, bounds: list[int] | None, scale, window, gqa: bool) -> torch.Tensor:
    return _per_sample(q, k, v, bounds if bounds is not None else cu.tolist(), scale, window, gqa)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, T, D)
    key: torch.Tensor,  # (B, Hkv, T, D)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature -> ((B, T, H, D), None).

    The samples: from transformers' flash kwargs when the batch brings them (cu_seq_lens_q and max_length_q, as
    transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes them: no host sync, and under
    torch.compile the kernel is traced with the block), else found from the position ids."""
    if attention_mask is not None:
        _refuse("takes padding-free rows with position ids and no attention mask (got an attention mask)")
    if query.shape[2] != key.shape[2] or kwargs.get("past_key_values") is not None:
        _refuse("computes training forwards, not generation with a KV cache (query and key lengths differ)")
    if dropout:
        _refuse(f"attention dropout {dropout} is not implemented; set the config's attention_dropout to 0")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            _refuse(f"this model's attention uses {name}, which it does not implement; use sdpa or eager")
    if not getattr(module, "is_causal", True):
        _refuse("computes causal attention only (this module is bidirectional)")
    b, h, t, _ = query.shape
    cu, longest, bounds = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"), None
    if cu is None or longest is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            _refuse("no position_ids reached the attention (this family does not pass them); use sdpa")
        if position_ids.numel() != b * t:
            _refuse(
                f"position ids of shape {tuple(position_ids.shape)} for {b} row(s) of {t} tokens (multimodal "
                "positions, e.g. Qwen-VL's 3-D ones, cannot mark samples); use sdpa"
            )
        cu, bounds = _found(position_ids, t)
        longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    window, gqa = kwargs.get("sliding_window"), key.shape[1] != h
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[-1]) for x in (query, key, value))  # (B*T, n, D)
    if _flash_applies(q, v):
        left = -1 if window is None else window - 1  # (W - 1, 0): transformers' flash convention
        kw = {"scale": scaling, "window_size": (left, 0)}
        if gqa and _GQA_ARG:
            kw["enable_gqa"] = True
        elif gqa:  # query head j reads kv head j // (H / Hkv), as SDPA's enable_gqa and transformers' repeat_kv
            k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
        out = varlen_attn(q, k, v, cu, cu, longest, longest, **kw)
    else:
        out = _per_sample_of(q, k, v, cu, bounds, scaling, window, gqa)
    return out.reshape(b, t, h, v.shape[-1]), None
