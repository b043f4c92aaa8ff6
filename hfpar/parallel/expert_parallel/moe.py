"""Mixture-of-experts layers with expert parallelism (EP): GroupedExperts, MoELayer.

    router  = TopKRouter(H, E, top_k=2, group=dp_group)                 # see router.py
    experts = GroupedExperts(E, H, I)                                    # gate_up_proj (E, 2I, H), down_proj (E, H, I)
    moe     = MoELayer(router, experts, ep_group=ep_group)               # keeps only this rank's E/ep experts
    y = moe(x)                                                           # (B, T, H) -> (B, T, H)

Parameter names and layouts are those of transformers 5 (Mixtral, Qwen2-MoE) so state dicts copy
over unchanged: `gate.weight` (E, H); `experts.gate_up_proj` (E, 2I, H) with rows [gate; up];
`experts.down_proj` (E, H, I); `shared_expert.*`, `shared_expert_gate.weight` (1, H). Blocks that name them
otherwise (`router`, `shared_experts`) keep their names: MoELayer(..., router_name=, shared_name=).
    h = act(x @ gate_up_proj[e][:I].T) * (x @ gate_up_proj[e][I:].T);   y = h @ down_proj[e].T

Forward of MoELayer, N = B*T tokens, k copies each:
    route           weights (N, k), experts (N, k)
    sort            token copies by expert                               (N*k, H), counts (E,)
    [capacity]      drop copies past `capacity` per expert, in global token order
    dispatch (ep>1) expert e lives on EP rank e // (E/ep); all-to-all the counts (E,), then
                    all-to-all the tokens with uneven splits; re-sort the received rows by local expert
    experts         one grouped matmul per projection over the local experts (CPU: kernels.py)
    combine         inverse of the above, weighted sum of the k copies (in the input dtype) [+ shared expert]
Only routed token copies travel; ep size 1 means no communication at all.

Gradients of expert parameters: an EP rank's expert grads already sum the contributions of the
tokens of every rank of its EP group. Expert params carry a ShardSpec (kind "ep", dim 0, the EP group;
hfpar.parallel.sharding) so the data-parallel backend can reduce them over the expert-data-parallel group (the dp ranks
holding the same experts, size dp/ep) instead of the whole dp group: with the trainer's dp-mean convention,
grad = sum over that group / dp.

Run the tests: python -m pytest tests/distributed/test_moe_layers.py -q
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import all_gather, all_to_all_single_autograd, group_rank, group_size
from ..sharding import ShardSpec, set_shard_spec
from .kernels import grouped_linear, grouped_linear_applies
from .router import AuxLossBackprop, TopKRouter, current_token_mask, moe_token_mask, set_aux_loss_grad_scale

__all__ = [
    "TopKRouter",
    "GroupedExperts",
    "MoELayer",
    "dispatch_rows",
    "AuxLossBackprop",
    "set_aux_loss_grad_scale",
    "moe_token_mask",
]


# ----------------------------------------------------------------------------- grouped matmul
# Activations by HF name, without importing transformers (spawned test ranks stay light);
# other names fall back to transformers' ACT2FN.
_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(name: str):
    if name in _ACTS:
        return _ACTS[name]
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused grouped GEMM applies: on CUDA sm90+ in bf16 with 16-byte aligned rows; on CPU in fp32
    where torch has the public F.grouped_mm. why: docs/architecture.md#why-the-parallel-layers"""
    if x.device.type == "cpu":
        return hasattr(F, "grouped_mm") and x.dtype == w.dtype == torch.float32
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None or not x.is_cuda or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if x.shape[-1] % 8 or w.shape[-1] % 8 or w.shape[-2] % 8:
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def _grouped_linear(
    x: torch.Tensor, w: torch.Tensor, counts: list[int], offs: torch.Tensor, fused: bool
) -> torch.Tensor:
    """Rows of x sorted by group; group g -> x_g @ w[g].T.  x (N, in), w (G, out, in) -> (N, out)."""
    if fused:
        fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
        return fn(x, w.transpose(-2, -1), offs=offs)  # (N, out)
    # Fallback: one GEMM per group on contiguous slices. Empty groups still go through F.linear so
    # every expert parameter is in the graph (zero grad) and DDP-style hooks always fire.
    return torch.cat([F.linear(xg, w[g]) for g, xg in enumerate(torch.split(x, counts))], dim=0)


class GroupedExperts(nn.Module):
    """E SwiGLU-style experts stored as 3-D tensors (transformers 5 layout).

    forward(x_sorted (N, H), tokens_per_expert (E,)) -> (N, H); rows of x_sorted are grouped by expert
    in expert order (tokens_per_expert[e] rows for expert e, zeros allowed).
    `backend`: "auto" (CPU: kernels.grouped_linear, the hand-written backward; CUDA: torch grouped_mm on sm90+ bf16,
    else the per-expert loop), "grouped_linear", "grouped_mm", "loop".
    """

    backend: str = "auto"

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act_fn: str = "silu"):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.act_name = act_fn
        self.act_fn = _activation(act_fn)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))  # (E, 2I, H)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))  # (E, H, I)
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"act={self.act_name}"
        )

    def shard(self, start: int, count: int) -> GroupedExperts:
        """A new module holding copies of experts [start, start + count)."""
        out = GroupedExperts(count, self.hidden_size, self.intermediate_size, self.act_name)
        out.to(device=self.gate_up_proj.device, dtype=self.gate_up_proj.dtype)
        with torch.no_grad():
            out.gate_up_proj.copy_(self.gate_up_proj[start : start + count])
            out.down_proj.copy_(self.down_proj[start : start + count])
        return out

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if tokens_per_expert.numel() != self.num_experts:
            raise ValueError(f"GroupedExperts: {tokens_per_expert.numel()} counts for {self.num_experts} experts")
        mode = self.backend
        if mode == "grouped_linear" or (mode == "auto" and grouped_linear_applies(x, self.gate_up_proj)):
            return self._forward_cpu(x, tokens_per_expert.tolist())
        fused = mode == "grouped_mm" or (mode == "auto" and _grouped_mm_supported(x, self.gate_up_proj))
        counts = [] if fused else tokens_per_expert.tolist()
        offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32) if fused else None
        gate_up = _grouped_linear(x, self.gate_up_proj, counts, offs, fused)  # (N, 2I)
        gate, up = gate_up.chunk(2, dim=-1)  # (N, I) each
        h = self.act_fn(gate) * up  # (N, I)
        return _grouped_linear(h, self.down_proj, counts, offs, fused)  # (N, H)

    def _forward_cpu(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """CPU: kernels.grouped_linear (its docstring says why it beats torch's grouped_mm there)."""
        return swiglu_experts(self, x, counts)


def swiglu_experts(m: nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x (M, H) sorted by expert (counts[e] rows each) -> act(x W_g^T) * (x W_u^T) @ W_d^T, (M, H), on CPU, with
    m's gate_up_proj (E, 2I, H), down_proj (E, H, I), act_fn; m keeps the weight-gradient buffers (kernels.py).
    Also what hf_experts.py runs for transformers' experts modules of this layout."""
    cache = m.__dict__.setdefault("_grad_buffers", {})  # not state: no parameter, no buffer
    gate, up = grouped_linear(x, m.gate_up_proj, counts, cache).chunk(2, dim=-1)  # (M, I) each
    return grouped_linear(m.act_fn(gate) * up, m.down_proj, counts, cache)  # (M, H)


# ----------------------------------------------------------------------------- the MoE layer
def sorted_counts(sorted_ids: torch.Tensor, E: int) -> torch.Tensor:
    """(E,) int64 rows per expert of ascending expert ids (ids >= E, dropped or padding copies, not counted).
    Not torch.bincount: its CUDA kernel reads the largest id on the host to size its output, a host sync in every
    MoE forward; the bounds of a sorted array need none (transformers uses histc for the same reason)."""
    bounds = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=sorted_ids.device, dtype=sorted_ids.dtype))
    return bounds[1:] - bounds[:-1]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def dispatch_rows(x_sorted: torch.Tensor, counts: torch.Tensor, ep_group, compute) -> tuple[torch.Tensor, int, int]:
    """Expert-parallel all-to-all: rows of x_sorted (M, H) sorted by global expert, counts (E,) rows per expert;
    expert e lives on rank e // (E/ep) of ep_group. compute(x_local (R, H), counts_local (E/ep,)) runs this rank's
    experts on the rows it received, sorted by local expert. Returns (outputs (M, H) in x_sorted's order,
    rows sent to other ranks, rows received from them)."""
    ep = group_size(ep_group)
    El = counts.numel() // ep
    # 1. counts: row r of recv = how many copies rank r sends to each of my local experts.
    recv = all_to_all_single_autograd(counts, None, None, ep_group).view(ep, El)  # (ep, El)
    send_splits = counts.view(ep, El).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    me = group_rank(ep_group)
    sent, received = sum(send_splits) - send_splits[me], sum(recv_splits) - recv_splits[me]
    # 2. tokens: blocks ordered (source rank, local expert) -> re-sort by (local expert, source rank).
    x_recv = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, ep_group)  # (R, H)
    local_expert = torch.repeat_interleave(torch.arange(El, device=x_recv.device).repeat(ep), recv.reshape(-1))  # (R,)
    perm = torch.argsort(local_expert, stable=True)
    y_local = compute(x_recv[perm], recv.sum(0))  # (R, H)
    # 3. back: undo the re-sort, reverse all-to-all.
    y_recv = y_local[_inverse(perm)]  # (R, H)
    return all_to_all_single_autograd(y_recv, send_splits, recv_splits, ep_group), sent, received


class MoELayer(nn.Module):
    """Routed experts (+ optional shared expert), dropless by default, expert-parallel over `ep_group`.

    `ep_group=None` (or a group of one rank) means no expert parallelism; `router.group=None` means
    statistics over this process's tokens only. `experts` may hold all E experts (same on every rank; this rank's E/ep
    are copied out) or only this rank's E/ep. `capacity_factor`: per-expert capacity ceil(cf * k * N_global / E),
    N_global the real tokens over `router.group` (which must contain the EP group); copies past it, in global order
    (rank of router.group, then token), are dropped and contribute zero. Padding (see
    `moe_token_mask`) never takes capacity: with a capacity its copies are dropped.
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: GroupedExperts,
        *,
        ep_group=None,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        capacity_factor: float | None = None,
        router_name: str = "gate",
        shared_name: str = "shared_expert",
    ):
        super().__init__()
        E = router.num_experts
        ep = group_size(ep_group) if ep_group is not None else 1  # None = no expert parallelism
        if E % ep:
            raise ValueError(f"MoELayer: num_experts={E} is not divisible by the expert-parallel size ep={ep}")
        if not 1 <= router.top_k <= E:
            raise ValueError(f"MoELayer: top_k={router.top_k} must be in [1, num_experts={E}]")
        if experts.hidden_size != router.hidden_size:
            raise ValueError(
                f"MoELayer: experts hidden_size={experts.hidden_size} != router hidden_size={router.hidden_size}"
            )
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"MoELayer: capacity_factor={capacity_factor} must be > 0 (or None for dropless)")
        self.num_experts, self.top_k = E, router.top_k
        self.ep_group, self.ep_size = ep_group, ep
        self.ep_rank = group_rank(ep_group) if ep > 1 else 0
        if capacity_factor is not None and ep > 1 and router.group is None:
            raise ValueError(
                "MoELayer: capacity_factor with ep > 1 needs router.group (the data-parallel group, "
                "which contains the EP group) so capacity comes from global counts"
            )
        self.num_local_experts = E // ep
        self.local_expert_start = self.ep_rank * self.num_local_experts
        if experts.num_experts == E and ep > 1:
            experts = experts.shard(self.local_expert_start, self.num_local_experts)
        elif experts.num_experts != self.num_local_experts:
            raise ValueError(
                f"MoELayer: experts holds {experts.num_experts} experts; expected {E} (all) or "
                f"{self.num_local_experts} (this rank's, num_experts={E} / ep={ep})"
            )
        if ep > 1:
            for p in experts.parameters():
                set_shard_spec(
                    p,
                    ShardSpec(
                        kind="ep",
                        group=ep_group,
                        dim=0,
                        size=ep,
                        experts={"num_experts": E, "start": self.local_expert_start},
                    ),
                )
        # registered under the HF block's names (mlp.gate or mlp.router, mlp.experts, mlp.shared_expert(s)), so the
        # state-dict keys stay HF's; self.gate / self.router and self.shared_expert reach them whatever the name
        self.router_name, self.shared_name = router_name, shared_name
        self._modules[router_name] = router
        self.experts = experts
        if shared_expert is not None:
            self._modules[shared_name] = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.capacity_factor = capacity_factor
        self.parallelized = False  # set by apply_expert_parallel (applied once)
        self.attached_mask: torch.Tensor | None = None  # (B, T) of the latest forward (attach_moe_token_mask)
        self.last_dropped = torch.zeros((), dtype=torch.long)  # token copies dropped by capacity, this rank
        # Routing volume counters (python ints, accumulated by every EP forward; whoever reads them resets
        # them, e.g. the trainer once per step under --log_comm_bytes): token copies this rank sends to
        # experts on OTHER EP ranks, and copies it receives from other ranks for its own experts. The
        # dispatch all-to-all sends the first, the combine all-to-all sends back the second, and backward
        # repeats both, so the minimum token traffic of this rank per forward+backward is
        # 2 x (routed + received) x H x element size (the per-expert count exchange comes on top).
        self.routed_remote_rows = 0
        self.received_remote_rows = 0

    @property
    def gate(self) -> TopKRouter:
        return self._modules[self.router_name]

    router = gate

    @property
    def shared_expert(self) -> nn.Module | None:
        return self._modules.get(self.shared_name)

    def extra_repr(self) -> str:
        return (
            f"ep={self.ep_size}, local_experts=[{self.local_expert_start}, "
            f"{self.local_expert_start + self.num_local_experts}), capacity_factor={self.capacity_factor}"
        )

    # --------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, H = x.shape
        x_flat = x.reshape(-1, H)  # (N, H)
        N, k, E = x_flat.shape[0], self.top_k, self.num_experts
        if token_mask is None:  # an enclosing moe_token_mask, else the model's latest forward's (attach_...)
            token_mask = current_token_mask()
            token_mask = self.attached_mask if token_mask is None else token_mask
        if token_mask is not None:
            if token_mask.numel() != N:
                raise ValueError(f"MoELayer: token mask of shape {tuple(token_mask.shape)} for input {(B, T, H)}")
            token_mask = token_mask.reshape(N).to(x.device) != 0  # (N,) bool
        weights, experts, _ = self.gate(x_flat, token_mask)  # (N, k) fp32, (N, k)

        flat_expert = experts.reshape(-1)  # (N*k,) copy i = token i // k
        if self.capacity_factor is not None and token_mask is not None:  # padding copies sort last, dropped
            flat_expert = torch.where(token_mask.repeat_interleave(k), flat_expert, E)
        order = torch.argsort(flat_expert, stable=True)  # (N*k,) copies by expert, token order kept
        expert_sorted = flat_expert[order]  # (N*k,) ascending
        counts = sorted_counts(expert_sorted, E)  # (E,)
        if self.capacity_factor is not None:
            keep = self._capacity_keep(expert_sorted, counts)  # (N*k,) bool, sorted order
            order = order[keep]
            counts = sorted_counts(expert_sorted[keep], E)
            self.last_dropped = (flat_expert < E).sum() - keep.sum()  # real copies dropped
        x_sorted = x_flat[order // k]  # (M, H), M = copies kept

        y_sorted = self._experts_ep(x_sorted, counts)  # (M, H)

        w = weights.reshape(-1)[order].to(x.dtype)  # (M,)
        y_copies = x_flat.new_zeros(N * k, H).index_copy(0, order, y_sorted * w[:, None])  # (N*k, H)
        out = y_copies.view(N, k, H).sum(dim=1)  # (N, H)
        if self.shared_expert is not None:
            shared = self.shared_expert(x_flat)  # (N, H)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x_flat)) * shared
            out = out + shared
        return out.view(B, T, H)

    def _capacity_keep(self, expert_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Keep mask for sorted copies: global position within the expert < capacity."""
        E, group = self.num_experts, self.gate.group
        n_local = (expert_sorted < E).sum() // self.top_k  # real tokens (k copies each)
        local = torch.cat([counts, n_local[None]])[None]  # (1, E+1)
        if group is not None and group_size(group) > 1:
            every = all_gather(local, dim=0, group=group)  # (G, E+1)
            offset = every[: group_rank(group)].sum(0)[:E]  # (E,) copies of lower ranks
            n_global = int(every[:, E].sum())
        else:
            offset, n_global = torch.zeros_like(counts), int(n_local)
        capacity = math.ceil(self.capacity_factor * self.top_k * n_global / E)
        starts = torch.cumsum(counts, 0) - counts  # (E,) first sorted row of each expert
        valid = expert_sorted < E
        e = expert_sorted.clamp(max=E - 1)
        pos = torch.arange(expert_sorted.numel(), device=e.device) - starts[e] + offset[e]
        return valid & (pos < capacity)

    def _experts_ep(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(M, H) copies sorted by global expert, counts (E,) -> expert outputs in the same order."""
        if self.ep_size == 1:
            return self.experts(x_sorted, counts)
        y, sent, received = dispatch_rows(x_sorted, counts, self.ep_group, self.experts)
        self.routed_remote_rows += sent
        self.received_remote_rows += received
        return y

    # --------------------------------------------------------------------- export
    @torch.no_grad()
    def full_expert_state(self) -> dict[str, torch.Tensor]:
        """{"gate_up_proj": (E, 2I, H), "down_proj": (E, H, I)} gathered over the EP group (collective)."""
        return {
            name: all_gather(p.detach(), dim=0, group=self.ep_group) if self.ep_size > 1 else p.detach().clone()
            for name, p in self.experts.named_parameters()
        }
