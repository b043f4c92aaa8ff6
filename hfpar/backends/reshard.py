"""Resume on another mesh: whether a checkpoint loads natively, through its full form, or is refused; and the full
form (hfpar.checkpoint.full_state) loaded through the live layout's own sharding.

    mode, why = resume_mode(backend_cls, state, ctx, chunks)     # "native" | "reshard" | None (why: one line)
    load_full_state(module, optimizer, full, hf_name)           # every rank: its pieces of every tensor
    load_full_state_zero(engine, full)                          # ZeRO-1/2: DeepSpeed's fragments set per parameter
    pieces_of_module(module, optimizer, hf_name)               # what a per-rank file records to be joined offline

A checkpoint loads natively when its layout family, tp / ep / pp sizes and chunks per pipeline rank are this run's,
and the world size too unless the family reshards on load itself (DDP's full state, FSDP2's DCP). Otherwise it is
resharded when the writer recorded a readable full form ("reshardable" in trainer_state.json) and this backend can
load one; else refused before the model loads, naming both meshes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hfpar.checkpoint.safe_load import CheckpointError
from hfpar.parallel.pieces import piece_layout, piece_of
from hfpar.parallel.sharding import local_tensor

from .strategies import checkpoint_layout

MESH = ("world_size", "dp", "tp", "ep", "cp", "pp")


def mesh_text(strategy: str, sizes: dict) -> str:
    return (
        f"{strategy} x {sizes['world_size']} processes (" + " ".join(f"{k} {sizes.get(k, 1)}" for k in MESH[1:]) + ")"
    )


def resume_mode(backend_cls, state: dict, ctx, chunks: int) -> tuple[str | None, str | None]:
    """("native", None), ("reshard", None) or (None, the refusal): how checkpoint `state` resumes under this run."""
    strategy = ctx.strategy
    theirs = {k: state.get(k, 1) for k in MESH}
    mine = {"world_size": ctx.world, **{k: getattr(ctx, k) for k in MESH[1:]}}
    same_layout = checkpoint_layout(state.get("strategy")) in (None, strategy.layout)
    same_split = all(theirs[k] == mine[k] for k in ("tp", "ep", "pp")) and (
        ctx.pp == 1 or state.get("pp_virtual_stages", 1) == chunks
    )
    same_world = theirs["world_size"] == mine["world_size"] or not backend_cls.resume_needs_same_world(strategy.name)
    if same_layout and same_split and same_world:
        return "native", None
    if state.get("reshardable") and backend_cls.loads_full_state(strategy.name):
        return "reshard", None
    a, b = mesh_text(state.get("strategy", "?"), theirs), mesh_text(strategy.name, mine)
    if not state.get("reshardable"):
        why = (
            "its writer "
            f"({state.get('strategy', '?')}{' with model parallelism' if theirs['tp'] > 1 or theirs['pp'] > 1 else ''}"
            f"{', LoRA' if state.get('peft') else ''}) records no full form to reshard from"
        )
    else:
        why = f"this run ({strategy.name}, {backend_cls.name} backend) cannot load a resharded state yet"
    return None, (
        f"checkpoint written on {a}, this run is {b}: {why}; resume on the checkpoint's mesh (see "
        "docs/reliability.md, 'Resume on another mesh', for the supported changes)"
    )


def _state_piece(v, p: torch.Tensor, group: dict):
    """An optimizer state value for live parameter p: scalars (step) as AdamW keeps them, tensors cut like p."""
    if not torch.is_tensor(v) or v.dim() == 0 or v.numel() == 1 and p.numel() != 1:
        on_device = group.get("fused") or group.get("capturable")
        dev = local_tensor(p).device if on_device else torch.device("cpu")
        return torch.tensor(float(v), dtype=torch.float32, device=dev)
    piece = piece_of(v, p)
    if isinstance(p, DTensor):
        return DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return piece


@torch.no_grad()
def load_full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, full, hf_name) -> None:
    """Every tensor of module's state dict (and every AdamW state of optimizer's parameters) set to this rank's piece
    of the full tensor (hf_name: state-dict name -> HF name). Collective-free. CheckpointError when a name is
    missing."""
    missing = []
    for key, t in module.state_dict(keep_vars=True).items():
        name = hf_name(key)
        if name in full.model:
            local_tensor(t).copy_(piece_of(full.model[name], t))
        else:
            missing.append(name)
    names = {id(p): hf_name(n) for n, p in module.named_parameters(remove_duplicate=False)}
    for group in optimizer.param_groups if optimizer is not None else []:
        for p in group["params"]:
            st = full.optim.get(names.get(id(p), "?"))
            if st is None:
                missing.append(f"optimizer state of {names.get(id(p), '?')}")
                continue
            optimizer.state[p] = {k: _state_piece(v, p, group) for k, v in st.items()}
    if missing:
        raise CheckpointError(
            f"the checkpoint's full state has no {', '.join(missing[:3])}"
            f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}: another model?"
        )


@torch.no_grad()
def load_full_state_zero(engine, full) -> None:
    """DeepSpeed ZeRO-1/2's engine: the module's weights, then each parameter's fp32 master and AdamW states through
    DeepSpeed's own fragment mapping (safe_set_full_fp32_param / safe_set_full_optimizer_state), after creating the
    flat AdamW states DeepSpeed creates lazily at its first step."""
    # an optional dependency (hfpar[deepspeed]), imported on use as in zero.py: only ZeRO runs reach this
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # noqa: PLC0415

    zopt, module = engine.optimizer, engine.module
    load_full_state(module, None, full, lambda k: k)  # the module's (bit16 / fp32) weights
    step = next(iter(full.optim.values()))["step"] if full.optim else 0
    for group, flat in zip(zopt.optimizer.param_groups, zopt.single_partition_of_fp32_groups):
        zopt.optimizer.state[flat] = {
            "step": _state_piece(step, flat, group),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    zopt._hp_optimizer_states_linked = False
    zopt._lazy_init_hp_params_optimizer_state()  # each parameter's optimizer fragments point into those states
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        safe_set_full_fp32_param(p, full.model[name].to(torch.float32))
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(p, full.optim[name][key].to(torch.float32), key)


def pieces_of_module(module: torch.nn.Module, optimizer: torch.optim.Optimizer, hf_name) -> dict:
    """What a per-rank file records besides its tensors so that they join offline: each state-dict key's HF name and
    piece layout, and the state-dict key of each optimizer index."""
    layout = {k: {"name": hf_name(k), **piece_layout(t)} for k, t in module.state_dict(keep_vars=True).items()}
    keys = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    return {"layout": layout, "optimizer_keys": [keys[id(p)] for g in optimizer.param_groups for p in g["params"]]}
