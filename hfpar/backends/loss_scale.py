"""fp16 loss scaling for the backends whose optimizer Accelerate does not hold (TP / EP / CP-with-TP over DDP or
FSDP2, and pipeline parallelism).

    scaler = world_scaler(accelerator)        # None unless fp16 on a GPU (Accelerate builds no scaler on CPU)
    acc.backward(loss)                        # scales by it (Accelerate's backward uses accelerator.scaler)
    unscale_(scaler, optimizer)               # before hfpar's clipping and its logged grad norm
    step_(scaler, optimizer)                  # skipped on every rank when any rank's grads overflowed

Accelerate's GradScaler is a plain `torch.amp.GradScaler`: its found-inf flag is per process, which is enough when
every rank holds the same reduced grads (DDP) but not here, where TP / EP / pipeline ranks hold different shards
and an overflow in one rank's shard would make that rank alone skip the step (the replicas drift apart and the
scales diverge). `world_scaler` swaps it for torch's `ShardedGradScaler` with the same settings and state, whose
`unscale_` all-reduces the found-inf flag over the world before anyone steps, so every rank skips the same steps
and backs its scale off the same way. It stays `accelerator.scaler`: `acc.backward` scales with it and
`save_state` / `load_state` checkpoint it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def world_scaler(accelerator) -> ShardedGradScaler | None:
    """Accelerate's fp16 GradScaler replaced (in place, on the accelerator) by a world-synchronised one; None
    without fp16 loss scaling."""
    scaler = getattr(accelerator, "scaler", None)
    if isinstance(scaler, ShardedGradScaler):  # prepared before (a second backend on the same accelerator)
        return scaler
    if scaler is None or not scaler.is_enabled():
        return None
    group = dist.group.WORLD if dist.is_initialized() else None
    synced = ShardedGradScaler(accelerator.device.type, process_group=group)
    synced.load_state_dict(scaler.state_dict())  # init scale, growth / backoff factors, interval, tracker
    accelerator.scaler = synced
    return synced


def loss_scale(scaler) -> float:
    """The factor the current step's loss is multiplied by before backward (1 without fp16)."""
    return 1.0 if scaler is None else float(scaler.get_scale())


def unscale_(scaler, optimizer: torch.optim.Optimizer) -> None:
    """Divide the optimizer's grads by the loss scale; the found-inf flag is then the world's (collective)."""
    if scaler is not None:
        scaler.unscale_(optimizer)


def found_inf(scaler, optimizer: torch.optim.Optimizer) -> bool:
    """After unscale_: whether the world's grads overflowed, i.e. whether the scaler's step() will skip. Read from
    the per-optimizer state GradScaler keeps between unscale_ and step (what its own step() reads), not from the
    grad norm: a norm is only as global as the groups it was summed over."""
    if scaler is None:
        return False
    state = scaler._per_optimizer_states[id(optimizer)]  # noqa: SLF001
    return any(float(v.sum()) > 0 for v in state["found_inf_per_device"].values())


def step_(scaler, optimizer: torch.optim.Optimizer) -> None:
    """optimizer.step(), or under fp16 the scaler's: skipped where the world found an overflow, then the scale
    updated (halved after an overflow, grown after growth_interval clean steps) identically on every rank."""
    if scaler is None:
        optimizer.step()
        return
    scaler.step(optimizer)
    scaler.update()
