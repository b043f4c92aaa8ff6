"""The reference model of a preference objective: a component the objective owns, built before the trainer.

    reference = FrozenReference()        # or LoRABaseReference(), PrecomputedReference(), ZeRO3Reference(model)
    objective = DPOObjective(model, ctx, reference=reference, ...)   # None: reference-free
    # the trainer: objective.bind(wrapped model) -> reference.bind; objective.prepare(...) -> reference.precompute
    with reference(backend):             # the backend's model turned into the reference, for a no-grad forward
        backend.eval_loss(...)

None of them holds grads or optimizer state. The first three are the policy's own modules with other values in
them; under ZeRO-3 (whose parameters live outside the module between forwards) the reference is a copy of the
initial model partitioned by a DeepSpeed inference engine of its own (TRL's way), run in the policy's place.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule

from hfpar.distributed import swapped
from hfpar.objectives.base import Batches


class Reference:
    """The policy as the reference. precomputed: its values are computed once (precompute) and read from the
    samples (sample), with no reference forward during training."""

    precomputed = False

    def bind(self, model: torch.nn.Module) -> None:
        """The model as the backend prepared it (after the data-parallel wrap: FSDP2 replaced the parameters)."""
        self.model = model

    def __call__(self, backend) -> contextlib.AbstractContextManager:
        """Within: a forward of `backend` (backend.eval_loss) is the reference's."""
        raise NotImplementedError

    def precompute(self, logps: Callable, train_batches: Batches, eval_batches: Batches) -> None:
        """logps(batch, scope) -> (P, 2) reference log-probs of a planned batch's pairs."""

    def sample(self, split: str, index: int, sample: dict) -> dict:
        return sample


class LoRABaseReference(Reference):
    """LoRA: the base model is the reference (PEFT's BaseTunerLayer.enable_adapters, found through any wrap)."""

    @contextlib.contextmanager
    def __call__(self, backend):
        from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: PLC0415  (peft is optional: LoRA runs only)

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m in layers:
                m.enable_adapters(True)


class FrozenReference(Reference):
    """A copy of this rank's parameter shards at the start (the reference), swapped into the policy's own
    parameters for a no-grad forward: the reference is sharded exactly as the policy (no grads, no optimizer
    state). A plain parameter's data is swapped (no copy: the frozen tensor is put in, the policy's put back); a
    DTensor's local shard (FSDP2, which all-gathers from its own storage) is overwritten in place and restored."""

    def bind(self, model: torch.nn.Module) -> None:
        self.params = [p for p in model.parameters()]
        self.frozen = [_local(p).detach().clone() for p in self.params]
        # FSDP2 keeps the root's gathered parameters after a forward: resharded around the swap, so that the next
        # forward gathers them again from the shards (the reference's, then the policy's)
        self.sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def _reshard(self) -> None:
        for m in self.sharded:
            m.reshard()

    @staticmethod
    def _put(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Puts value in as p's data; returns what it held."""
        if hasattr(p, "to_local"):
            held = p.to_local().detach().clone()
            p.to_local().copy_(value)
            return held
        held, p.data = p.data, value
        return held

    @contextlib.contextmanager
    def __call__(self, backend):
        self._reshard()
        with torch.no_grad():
            stash = [self._put(p, f) for p, f in zip(self.params, self.frozen)]
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                for p, s in zip(self.params, stash):
                    self._put(p, s)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p.data


class PrecomputedReference(Reference):
    """--precompute_ref_log_probs: before training (the policy IS the reference then, before resume loads a
    checkpoint), the reference log-probs of every pair this rank's steps and evals will use, from exactly their
    micro-batches; the samples then carry them (ref_chosen_logps, ref_rejected_logps) and no reference forward runs."""

    precomputed = True

    def __init__(self):
        self.tables: dict[str, dict[int, tuple[float, float]]] = {}
        self.done = False

    def __call__(self, backend):
        if self.done:
            raise RuntimeError("a precomputed reference runs no forward after precompute")
        return contextlib.nullcontext()  # the model has not been trained yet: it is the reference

    def precompute(self, logps: Callable, train_batches: Batches, eval_batches: Batches) -> None:
        train = {}
        for ix, plan in train_batches():
            if all(i in train for i in ix):
                continue
            ref = logps(*plan()).cpu()
            for row, i in enumerate(ix):
                train[i] = (float(ref[row, 0]), float(ref[row, 1]))
        evals = {}
        for idx, plan in eval_batches():
            ref = logps(*plan()).cpu()
            for row, i in enumerate(idx):
                if i is not None:  # a padding slot (None) has no targets in the eval: its reference is never read
                    evals[i] = (float(ref[row, 0]), float(ref[row, 1]))
        self.tables, self.done = {"train": train, "eval": evals}, True

    def sample(self, split: str, index: int, sample: dict) -> dict:
        table = self.tables.get(split)
        if table is None:
            return sample
        c, r = table.get(index, (math.nan, math.nan))
        return {**sample, "ref_chosen_logps": c, "ref_rejected_logps": r}


class ZeRO3Reference(Reference):
    """ZeRO-3: a copy of the initial model (made before the wrap, when its parameters are whole), partitioned by a
    DeepSpeed engine of its own with the policy's DeepSpeed config and no optimizer (TRL's ref model under ZeRO-3):
    each rank holds 1/dp of the reference, gathered layer by layer in its forward, as the policy's. Within the
    context the backend's model is that engine."""

    def __init__(self, model: torch.nn.Module, source: str | None = None):
        """source: the policy's model directory, read again (partitioned as it loads, TRL's way) when the policy was
        loaded partitioned (zero3_init_flag) and so has no whole copy; only for a model hfpar did not reshape."""
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            if source is None:
                raise ValueError(
                    "the reference model under ZeRO-3: the policy was loaded partitioned (zero3_init_flag), "
                    "so no whole copy of it exists to build the reference from; pass "
                    "--precompute_ref_log_probs, or zero3_init_flag: false in the accelerate config"
                )
            self.copy = type(model).from_pretrained(source, dtype=torch.float32, trust_remote_code=False)
        else:
            self.copy = copy.deepcopy(model)
        self.engine = None

    def bind(self, model: torch.nn.Module) -> None:
        import deepspeed  # noqa: PLC0415  (DeepSpeed runs only: its import is not hfpar's)
        from accelerate.state import AcceleratorState  # noqa: PLC0415  (as above)

        config = copy.deepcopy(AcceleratorState().deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        self.engine, *_ = deepspeed.initialize(model=self.copy, config=config, mpu=getattr(model, "mpu", None))
        self.engine.eval()
        self.copy = None
        # what the reference costs each rank: its partition (ZeRO-3's ds_tensor), as the policy's parameters
        self.bytes_per_rank = sum(
            p.ds_tensor.numel() * p.ds_tensor.element_size() for p in self.engine.module.parameters()
        )
        if self.engine.global_rank == 0:
            print(
                f"[hfpar] reference model: a ZeRO-3 engine of its own, {self.bytes_per_rank / 2**20:.2f} MiB of "
                "parameters per rank",
                flush=True,
            )

    def __call__(self, backend):
        return swapped(backend, "model", self.engine)
