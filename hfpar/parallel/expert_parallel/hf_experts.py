"""Expert parallelism through the HF MoE block's OWN code: only its experts module is sharded by expert.

    found, problems = find_hf_experts(model)              # [HFExperts(path, module, block, E)], one line per refusal
    shard_hf_experts(found, ep_group, hidden_size=H)      # in place; each block class checked against itself first
    speed_up_hf_experts(found, hidden_size=H)             # ep = 1: plain SwiGLU experts run hfpar's CPU kernel

Every transformers 5 MoE block computes its routing itself (softmax / sigmoid, e_score_correction_bias, group-limited
top-k, routed scaling, sparsemixer, biases, ...) and then calls
    self.experts(hidden_states (N, H), top_k_index (N, k), top_k_weights (N, k)) -> (N, H)
on a module holding every expert's weights as tensors whose dim 0 is the expert (gate_up_proj, down_proj and, where
the family has them, their biases, in the family's own layout: transposed, interleaved, clamped SwiGLU, ...). So the
router, the shared experts, the dense first layers and the output capture (router_logits, aux loss) stay HF's code
unchanged, and only that call is replaced: this rank keeps experts [rank * E/ep, (rank + 1) * E/ep) of every
expert-indexed tensor, the selected (token, expert) copies travel to the rank holding their expert (dispatch_rows, the
same all-to-all as MoELayer), the module's ORIGINAL forward runs them with their local expert index and weight 1 (the
family's own expert math, through transformers' experts implementation: eager or grouped_mm), and the outputs come
back and are weighted and summed over the k copies here (as transformers' grouped_mm does).

Experts of the plain layout (gate_up_proj (E, 2I, H) [gate; up], down_proj (E, H, I), act(gate) * up, no bias,
not transposed: DeepSeek-V3, GLM-4-MoE, Kimi-K2, ...) run hfpar's grouped SwiGLU (moe.swiglu_experts, kernels.py:
faster than transformers' grouped_mm on CPU) on the rows each rank holds, instead of their own forward; at ep = 1
too (speed_up_hf_experts: the same forward without the all-to-all), so the HF router, shared experts and output
stay HF's code and only the expert math is hfpar's.

Accepted only after an equality check: the first block of each experts class runs, unsharded and then sharded, on the
same random tokens (different on every rank, same RNG state for both runs): its output, the gradient of its input and
of every block parameter (expert ones summed over the EP group, as EP grads are) must agree within 1e-4 relative (fp32
/ fp64; 16-bit: 5e-2; a gradient is measured against at least 1e-3 of the block's largest one, so that one which is
zero in exact arithmetic compares its rounding noise to the gradients' scale), all over the EP group. A module that
does not fit (parameters whose dim 0 differs, a forward that is neither (hidden_states, top_k_index, top_k_weights) nor
Llama-4's dense routed input, a failed check) is refused in one line naming it. Shared experts stacked as 3-D tensors
(a `shared...` module) are replicated, not sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_reduce, group_rank, group_size
from ..sharding import ShardSpec, set_shard_spec, shard_tensor
from .hf_experts_detect import (
    _COUNT_ATTRS,
    HFExperts,
    _forward_args,
    _forward_names,
    _plain_swiglu,
    find_hf_experts,
    is_hf_experts_sharded,
)
from .kernels import grouped_linear_applies
from .moe import dispatch_rows, swiglu_experts

__all__ = ["HFExperts", "find_hf_experts", "is_hf_experts_sharded", "shard_hf_experts", "speed_up_hf_experts"]


# ----------------------------------------------------------------------------- the sharded forward
@dataclass
class _EPState:
    E: int
    start: int
    count: int
    group: object  # None: ep = 1 (no all-to-all; speed_up_hf_experts)
    base: type  # the original class: its forward computes the local experts
    saved: dict  # what unshard() restores: parameters and count attributes
    plain: bool = False  # plain SwiGLU layout: hfpar's kernel runs the local experts on CPU
    zero: int = 0  # experts without weights of their own, routed to E .. E + zero - 1: run where the token is
    pairs: bool = False  # its forward needs two choices per row (_own_forward)


def _in_graph(experts: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A zero that ties every local expert tensor and the received rows into the graph, also where no row came (an
    eager HF forward then returns zeros unconnected to both): every rank's backward then runs the same collectives
    (the all-to-all back to the senders) and gives every expert tensor a grad (zero where unused) for the data-parallel
    reduction, a collective over the ranks holding the same experts."""
    return (x.reshape(-1)[:1].sum() + sum(p.reshape(-1)[:1].sum() for p in experts.parameters())) * 0


def _ep_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs
) -> torch.Tensor:
    st: _EPState = self._hfpar_ep
    if st.group is None and not grouped_linear_applies(hidden_states, self.gate_up_proj):
        return st.base.forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)  # e.g. moved to GPU
    shape = hidden_states.shape  # (N, H), or (B, T, H) where the block hands its rows unflattened (DBRX)
    hidden_states = hidden_states.reshape(-1, shape[-1])
    N, k = top_k_index.shape[0], top_k_index.shape[-1]
    idx = top_k_index.reshape(-1)  # (N*k,)
    order = torch.argsort(idx, stable=True)  # copies sorted by global expert (experts without weights last)
    counts = torch.bincount(idx, minlength=st.E + st.zero)  # (E + zero,)
    if counts.numel() != st.E + st.zero:
        raise ValueError(f"{type(self).__name__}: expert index {int(idx.max())} >= num_experts {st.E + st.zero}")
    x_sorted = hidden_states[order // k]  # (N*k, H)

    def local(x: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        if st.plain and grouped_linear_applies(x, self.gate_up_proj):
            out = swiglu_experts(self, x, local_counts.tolist())  # (R, H)
            return out if st.group is None else out + _in_graph(self, x)
        ids = torch.repeat_interleave(torch.arange(st.count, device=x.device), local_counts)  # (R,)
        return _own_forward(self, x, ids, top_k_weights.dtype, *args, **kwargs) + _in_graph(self, x)

    if st.zero:  # the copies routed to experts without weights: the module's own forward, on this rank, under
        real = int(counts[: st.E].sum())  # their local index (count + j); a host read, as dispatch_rows' counts
        ids = idx[order[real:]] - st.E + st.count
        y_zero = _own_forward(self, x_sorted[real:], ids, top_k_weights.dtype, *args, **kwargs)
        x_sorted, counts = x_sorted[:real], counts[: st.E]
    if st.group is None:  # ep = 1: every expert is here
        y_sorted = local(x_sorted, counts)  # (N*k, H), unweighted
    else:
        y_sorted, _, _ = dispatch_rows(x_sorted, counts, st.group, local)
    if st.zero:
        y_sorted = torch.cat([y_sorted, y_zero.to(y_sorted.dtype)])
    weighted = y_sorted * top_k_weights.reshape(-1)[order, None]  # promoted dtype, as transformers' grouped_mm
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    out = weighted[inv].view(N, k, -1).sum(dim=1).to(hidden_states.dtype)  # (N, H)
    return out.reshape(*shape[:-1], out.shape[-1])  # the shape it was handed


def _own_forward(self, x: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, *args, **kwargs) -> torch.Tensor:
    """The module's original forward on rows x (R, H), row i to its local expert ids[i], weight 1: (R, H). A forward
    that cannot take one choice per row (LongCat-Flash's squeezes the choice dim away: transformers assumes top_k > 1)
    gets every row twice, weights 1 and 0: the second copy adds an exact zero (and zero gradients), twice the work."""
    st: _EPState = self._hfpar_ep
    ids = ids[:, None].expand(-1, 2) if st.pairs else ids[:, None]  # (R, 1) or (R, 2)
    w = torch.ones(ids.shape, dtype=dtype, device=x.device)
    if st.pairs:
        w[:, 1] = 0
    return st.base.forward(self, x, ids, w, *args, **kwargs).reshape(-1, x.shape[-1])  # R may be 0


def _one_choice_fails(m: nn.Module, hidden_size: int) -> bool:
    """Whether m's own forward (not yet sharded) raises on one row with one choice (see _own_forward)."""
    p = next(m.parameters())
    x = torch.zeros(1, hidden_size, dtype=p.dtype, device=p.device)
    one = torch.zeros(1, 1, dtype=torch.long, device=p.device)
    try:
        with torch.no_grad():
            m(x, one, torch.ones(1, 1, dtype=p.dtype, device=p.device))
    except (ValueError, IndexError, RuntimeError):
        return True
    return False


_PAIRS: dict[type, bool] = {}  # experts class -> its forward needs two choices per row (_own_forward)


def _ep_dense_forward(self, routed_in: torch.Tensor) -> torch.Tensor:
    """Llama-4's experts: routed_in (E*N, H) holds every token for every expert, scaled by its routing score (0 where
    the expert was not selected). An all-zero row gives an exactly zero output and gradient (bias-free SwiGLU), so
    only the nonzero (expert, token) rows travel; each rank runs the original forward on its experts' rows, padded
    to equal counts (the forward's bmm layout), and the outputs go back to their (expert, token) places."""
    st: _EPState = self._hfpar_ep
    x = routed_in.view(st.E, -1, routed_in.shape[-1])  # (E, N, H)
    with torch.no_grad():
        e_idx, n_idx = (x != 0).any(dim=-1).nonzero(as_tuple=True)  # (M,) each, sorted by expert
        counts = torch.bincount(e_idx, minlength=st.E)  # (E,)

    def local(rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        width = int(local_counts.max()) if local_counts.numel() else 0
        ids = torch.repeat_interleave(torch.arange(st.count, device=rows.device), local_counts)  # (R,)
        pos = torch.arange(rows.shape[0], device=rows.device) - (torch.cumsum(local_counts, 0) - local_counts)[ids]
        padded = rows.new_zeros(st.count, width, rows.shape[-1]).index_put((ids, pos), rows)  # (El, w, H)
        out = st.base.forward(self, padded.view(-1, rows.shape[-1])).view(st.count, width, -1)
        return out[ids, pos] + _in_graph(self, rows)

    y, _, _ = dispatch_rows(x[e_idx, n_idx], counts, st.group, local)  # (M, H)
    return x.new_zeros(x.shape[0], x.shape[1], y.shape[-1]).index_put((e_idx, n_idx), y).view(-1, y.shape[-1])


_CLASSES: dict[type, type] = {}


def _ep_class(cls: type, dense: bool) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"ExpertParallel{cls.__name__}",
            (cls,),
            {"forward": _ep_dense_forward if dense else _ep_forward, "__module__": cls.__module__},
        )
    return _CLASSES[cls]


def _local_rows(p: torch.Tensor, x: HFExperts, rank: int, ep: int) -> tuple[torch.Tensor, list[int] | None]:
    """This rank's rows of an expert-indexed tensor of x (its experts' rows; of a tensor that also holds rows for the
    experts without weights, those rows split over the ranks too: packed parts [E, zero]) and the packed parts."""
    packed = [x.E, x.zero] if x.zero and p.shape[0] == x.E + x.zero else None
    return shard_tensor(p.detach(), 0, rank, ep, packed), packed


def _shard(x: HFExperts, ep_group) -> None:
    if is_hf_experts_sharded(x.module):  # sped up at ep = 1 before: undo first
        _unshard(x)
    m, ep = x.module, group_size(ep_group)
    count = x.E // ep
    start = group_rank(ep_group) * count
    saved = dict(m.named_parameters())  # its own and a child's (DBRX's GLU): every one expert-indexed
    for n, p in saved.items():
        rows, packed = _local_rows(p, x, group_rank(ep_group), ep)
        local = nn.Parameter(rows, requires_grad=p.requires_grad)
        experts = {"num_experts": x.E, "start": start}
        set_shard_spec(
            local, ShardSpec(kind="ep", group=ep_group, dim=0, size=ep, packed_splits=packed, experts=experts)
        )
        _set(m, n, local)
    attrs = {a: getattr(m, a) for a in _COUNT_ATTRS if getattr(m, a, None) in (x.E, x.E + x.zero)}
    for a, v in attrs.items():  # the local routing range: count experts here, then the ones without weights
        setattr(m, a, count if v == x.E else count + x.zero)
    base = type(m)
    plain, pairs = _plain_swiglu(m), _PAIRS.get(base, False)
    m._hfpar_ep = _EPState(x.E, start, count, ep_group, base, {**saved, **attrs}, plain, x.zero, pairs)
    m.__class__ = _ep_class(base, dense=_forward_args(m) == 1)


def _set(m: nn.Module, dotted: str, value) -> None:
    """setattr on the submodule that holds `dotted` (a parameter or count attribute of m or of a child)."""
    owner, _, name = dotted.rpartition(".")
    setattr(m.get_submodule(owner) if owner else m, name, value)


def _speed_up(x: HFExperts) -> None:
    m = x.module
    m._hfpar_ep = _EPState(x.E, 0, x.E, None, type(m), {}, True)
    m.__class__ = _ep_class(type(m), dense=False)


def _unshard(x: HFExperts) -> None:
    m, st = x.module, x.module._hfpar_ep
    for n, v in st.saved.items():
        _set(m, n, v)
    m.__class__ = st.base
    m._hfpar_ep = None


# ----------------------------------------------------------------------------- the equality check
def _rel(a: torch.Tensor | None, b: torch.Tensor | None, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor); floor: a gradient that is zero in exact arithmetic (a renormalized top-1
    weight's router) holds rounding noise only, measured against the scale of the block's other gradients."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(max(floor, 1e-30))).item() if b.numel() else 0.0


def _run(block: nn.Module, x: torch.Tensor, cot_seed: int, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Output, grads of the input and every trainable block parameter, for loss = sum(out * random cotangent)."""
    names = [n for n, p in block.named_parameters() if p.requires_grad]
    params = dict(block.named_parameters())
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        torch.manual_seed(1234)  # same jitter / noise in both runs
        out = block(x, **kw)
    out = out[0] if isinstance(out, (tuple, list)) else out
    g = torch.Generator().manual_seed(cot_seed)
    cot = torch.randn(out.shape, generator=g).to(out.device)
    grads = torch.autograd.grad((out.float() * cot).sum(), [x] + [params[n] for n in names], allow_unused=True)
    return out.detach(), {"input": grads[0], **dict(zip(names, grads[1:]))}


class _Routed(nn.Module):
    """The experts module called directly, with routing given (see _routed_everywhere); under its own name."""

    def __init__(self, name: str, experts: nn.Module, idx: torch.Tensor, weights: torch.Tensor):
        super().__init__()
        self.add_module(name, experts)
        self._name, self._idx, self._weights = name, idx, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = getattr(self, self._name)(x, self._idx, self._weights)  # DBRX's: (N, 1, H) for rows (N, H)
        return out.reshape(-1, x.shape[-1])


def _routed_everywhere(x: HFExperts, hidden_size: int, rank: int, inp: torch.Tensor) -> tuple | None:
    """The check's second run: the experts module called with routing that reaches every expert, those without
    weights too (a block's own router may pick few of them on random tokens: a tiny model's routing biases).
    None where its forward does not take (rows, top_k_index, top_k_weights) rows as given (checked on its
    unsharded self): the block run alone then."""
    if _forward_args(x.module) != 3:
        return None
    routed = x.E + x.zero
    n = torch.arange(2 * routed, device=inp.device)
    idx = torch.stack([n % routed, (n + 1 + rank % max(routed - 1, 1)) % routed], dim=1)  # (N, 2)
    g = torch.Generator().manual_seed(2000 + rank)
    weights = (torch.rand(idx.shape, generator=g) + 0.5).to(device=inp.device, dtype=inp.dtype)
    rows = torch.randn(idx.shape[0], hidden_size, generator=g).to(inp).requires_grad_()
    wrapper = _Routed(x.path.rpartition(".")[2], x.module, idx, weights)
    try:
        with torch.no_grad():
            wrapper(rows)
    except Exception:  # noqa: BLE001 - the module takes its rows otherwise (DBRX: unflattened): the block run only
        return None
    return wrapper, rows, {}


def _check(x: HFExperts, ep_group, hidden_size: int, vocab_size: int | None) -> tuple[float, str]:
    """Shards x (in place) and returns the worst relative difference to the unsharded block, over the EP group.
    ep_group None: this process alone, x sped up (ep = 1) instead of sharded."""
    if is_hf_experts_sharded(x.module):  # compare with the HF forward itself
        _unshard(x)
    w = next(x.module.parameters())
    rank = group_rank(ep_group) if ep_group is not None else 0
    g = torch.Generator().manual_seed(1000 + rank)  # different tokens on every rank
    inp = torch.randn(2, 8, hidden_size, generator=g).to(device=w.device, dtype=w.dtype).requires_grad_()
    kw = {}
    if vocab_size and "input_ids" in _forward_names(x.block):  # hash routing (DeepSeek-V4) reads the ids
        kw["input_ids"] = torch.randint(0, vocab_size, (2, 8), generator=g).to(w.device)
    runs = [(x.block, inp, kw)]
    if direct := _routed_everywhere(x, hidden_size, rank, inp):
        runs.append(direct)
    wants = [_run(block, i, 7 + rank, **k) for block, i, k in runs]
    prefix = x.path.rpartition(".")[2]
    _PAIRS[type(x.module)] = _forward_args(x.module) == 3 and _one_choice_fails(x.module, hidden_size)
    for _, want in wants:
        for n, p in x.module.named_parameters():  # EP grads sum every rank's tokens; the
            if p.requires_grad and ep_group is not None:  # same order on every rank (collectives)
                g = want.get(f"{prefix}.{n}")
                g = torch.zeros_like(p) if g is None else g
                want[f"{prefix}.{n}"] = _local_rows(all_reduce(g, ep_group), x, rank, group_size(ep_group))[0]
    _shard(x, ep_group) if ep_group is not None else _speed_up(x)
    worst = (0.0, "output")
    for (block, i, k), (want_out, want), what in zip(runs, wants, ("", "experts called directly: ")):
        got_out, got = _run(block, i, 7 + rank, **k)
        scale = max([float(v.abs().max()) for v in want.values() if v is not None and v.numel()] + [0.0])
        worst = max(
            [worst, (_rel(got_out, want_out), f"{what}output")]
            + [(_rel(got.get(n), v, 1e-3 * scale), f"{what}grad {n}") for n, v in want.items()]
        )
    if ep_group is None:
        return worst
    every = all_reduce(torch.tensor([worst[0]], dtype=torch.float64, device=w.device), ep_group, op=dist.ReduceOp.MAX)
    return float(every[0]), worst[1]


def shard_hf_experts(found: list[HFExperts], ep_group, hidden_size: int, vocab_size: int | None = None) -> None:
    """Shard every found experts module over ep_group (in place), the first of each class after the equality check.
    Collective over ep_group. Raises ValueError (one line) when a check fails; nothing is left sharded then."""
    checked: dict[type, bool] = {}
    done: list[HFExperts] = []
    try:
        for x in found:
            cls = type(x.module)
            if cls not in checked:
                wide = next(x.module.parameters()).dtype in (torch.float32, torch.float64)
                try:
                    rel, what = _check(x, ep_group, hidden_size, vocab_size)
                except Exception as exc:
                    if is_hf_experts_sharded(x.module):
                        _unshard(x)
                    raise ValueError(
                        f"{x.path} ({cls.__name__}): the expert-parallel block failed its check "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
                    ) from exc
                done.append(x)
                if rel > (1e-4 if wide else 5e-2):
                    raise ValueError(
                        f"{x.path} ({cls.__name__}): the expert-parallel block differs from the HF block "
                        f"by {rel:.1e} relative ({what}) on the same tokens; it is not sharded"
                    )
                checked[cls] = True
                continue
            _shard(x, ep_group)
            done.append(x)
    except ValueError:
        for x in done:
            _unshard(x)
        raise


def speed_up_hf_experts(found: list[HFExperts], hidden_size: int, vocab_size: int | None = None) -> list[str]:
    """ep = 1: every found experts module of the plain SwiGLU layout, on CPU, runs hfpar's kernel (in place; the
    first of each class after the equality check against its own forward, in this process alone). A module that
    does not fit or fails the check keeps its HF forward (nothing is refused: this is speed only). Returns the
    paths sped up."""
    ok: dict[type, bool] = {}
    done = []
    for x in found:
        m, cls = x.module, type(x.module)
        if is_hf_experts_sharded(m) or not _plain_swiglu(m) or next(m.parameters()).device.type != "cpu":
            continue
        if cls not in ok:
            wide = next(m.parameters()).dtype in (torch.float32, torch.float64)
            try:
                rel, _ = _check(x, None, hidden_size, vocab_size)
                ok[cls] = rel <= (1e-4 if wide else 5e-2)
            except Exception:  # noqa: BLE001 - any failure: keep HF's
                ok[cls] = False
            if not ok[cls] and is_hf_experts_sharded(m):
                _unshard(x)
            if ok[cls]:
                done.append(x.path)
            continue
        if ok[cls]:
            _speed_up(x)
            done.append(x.path)
    return done
