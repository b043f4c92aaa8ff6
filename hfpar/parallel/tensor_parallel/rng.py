"""Dropout inside a tensor-parallel region draws its own masks on each TP rank (Megatron-LM's model-parallel RNG).

Every rank is seeded alike (`--seed`, as HF's Trainer does), so without this the TP ranks draw the same numbers: the
dropout after a row-parallel layer (replicated activations) must, and does, get the same mask on every rank, but a
dropout inside a region (attention probabilities of this rank's heads) would give rank r's heads the very masks of
rank 0's: head h and head h + H/tp dropped together, a correlation one process never has. Within a region in training,
the device's generator is forked: one number drawn from the host's generator (on every rank alike, so the streams
stay in step; no device sync) seeds it with that number + the TP rank; after the region its state is put back.
Activation checkpointing replays the forward from the saved generator state, so a recomputed region draws the same
masks.

Under sequence parallelism every decoder block holds this rank's T/tp tokens outside its regions too (the dropout
after a row-parallel layer acts on the rank's chunk): the blocks are forked the same way, so rank r's tokens do not
take the masks of rank 0's.

    install_region_rng(module, rank)   # where the region holds a dropout with p > 0 (has_dropout)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["has_dropout", "install_region_rng"]


def has_dropout(module: nn.Module) -> bool:
    """A dropout module with p > 0 in the region, or a float attribute naming dropout (HF attentions' functional
    `attention_dropout` / `dropout`) above 0 on one of its modules."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for k, v in vars(m).items():
            if "dropout" in k and isinstance(v, float) and not isinstance(v, bool) and v > 0:
                return True
    return False


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    mod = torch.get_device_module(device.type)
    return mod.default_generators[device.index if device.index is not None else mod.current_device()]


def _device(args: tuple, kwargs: dict) -> torch.device | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.device
    return None


@torch.compiler.disable  # generator state is host-side bookkeeping: run eagerly around a compiled block's region
def _fork(module, args, kwargs, *, rank: int):
    device = _device(args, kwargs) if module.training else None
    if device is None:
        return None
    # the seed comes from the host's generator (no device sync); drawn alike on every TP rank
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.default_generator))
    gen = _generator(device)
    module._hfpar_rng_saved.append((gen, gen.get_state()))
    gen.manual_seed(seed + rank)
    return None


@torch.compiler.disable
def _restore(module, args, kwargs, out):
    if module.training and module._hfpar_rng_saved:
        gen, state = module._hfpar_rng_saved.pop()
        gen.set_state(state)
    return None


def install_region_rng(module: nn.Module, rank: int) -> None:
    """Fork the generator around `module`'s forward in training (see the module docstring)."""
    module._hfpar_rng_saved = []
    module.register_forward_pre_hook(lambda m, a, k: _fork(m, a, k, rank=rank), with_kwargs=True)
    module.register_forward_hook(_restore, with_kwargs=True, always_call=True)
