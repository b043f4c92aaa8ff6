"""fp16 loss scaling for the backends whose optimizer Accelerate does not hold (TP / EP / CP-with-TP over DDP or
FSDP2, and pipeline parallelism).

    scaler = fp16_scaler(accelerator)         # Accelerate's GradScaler (fp16 on a GPU), None otherwise
    acc.backward(loss)                        # scales by it (the pipeline multiplies its factor by loss_scale())
    unscale_(scaler, optimizer)               # before hfpar's clipping and its logged grad norm; collective
    step_(scaler, optimizer)                  # skipped on every rank when any rank's grads overflowed

Accelerate's GradScaler is reused (the one acc.backward scales with, and save_state / load_state checkpoint), but
its found-inf flag is per process: enough when every rank holds the same reduced grads (DDP), not here, where TP /
EP / pipeline ranks hold different shards and an overflow in one rank's shard would make that rank alone skip
the step (the replicas drift apart and the scales diverge). So after unscale_ the flag is all-reduced (max) over
the world before anyone steps: every rank skips the same steps and updates its scale the same way. (torch's
ShardedGradScaler does that all-reduce too, but its (1,)-shaped flag breaks the step of fused optimizers, hfpar's
default AdamW, which take the flag as a scalar.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def fp16_scaler(accelerator):
    """Accelerate's fp16 GradScaler, or None without fp16 loss scaling (bf16, fp32, and fp16 on CPU, where
    Accelerate builds none)."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    # GradScaler creates its scale tensor in its first scale(); the pipeline multiplies its back-propagated factor
    # by get_scale() instead of calling scale(), and unscale_ needs the tensor: create it now
    scaler.scale(torch.ones((), device=accelerator.device))
    return scaler


def loss_scale(scaler) -> float:
    """The factor the current step's loss is multiplied by before backward (1 without fp16)."""
    return 1.0 if scaler is None else float(scaler.get_scale())


def _found_inf_flags(scaler, optimizer) -> dict:
    """{device: flag} the scaler recorded in unscale_ for this optimizer: what its step() and update() read.
    GradScaler keeps it in its per-optimizer state between unscale_ and step (torch.amp.grad_scaler)."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # noqa: SLF001


def unscale_(scaler, optimizer: torch.optim.Optimizer) -> None:
    """Divide the optimizer's grads by the loss scale, then make the found-inf flag the world's (collective:
    every rank calls it once per step)."""
    if scaler is None:
        return
    scaler.unscale_(optimizer)
    flags = _found_inf_flags(scaler, optimizer)
    if not flags:  # a rank with no grads at all still takes part (and its step() needs a recorded flag)
        flags[scaler._scale.device] = torch.zeros((), device=scaler._scale.device)  # noqa: SLF001
    anywhere = torch.stack([f.reshape(()).to(scaler._scale.device) for f in flags.values()]).amax()  # noqa: SLF001
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    for f in flags.values():
        f.copy_(anywhere.to(f.device).reshape(f.shape))


def found_inf(scaler, optimizer: torch.optim.Optimizer) -> bool:
    """After unscale_: whether the world's grads overflowed, i.e. whether the scaler's step() will skip (read from
    the flag it will read, not from a grad norm: a norm is only as global as the groups it was summed over)."""
    if scaler is None:
        return False
    return any(float(f.sum()) > 0 for f in _found_inf_flags(scaler, optimizer).values())


def step_(scaler, optimizer: torch.optim.Optimizer) -> None:
    """optimizer.step(), or under fp16 the scaler's: skipped where the world found an overflow, then the scale
    updated (halved after an overflow, grown after growth_interval clean steps) identically on every rank."""
    if scaler is None:
        optimizer.step()
        return
    scaler.step(optimizer)
    scaler.update()
