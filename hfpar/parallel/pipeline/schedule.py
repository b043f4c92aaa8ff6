"""Pipeline schedules over the stages of one pipeline group: GPipe and 1F1B, for one accumulation step's rows.

    runner = PipelineRunner(stage, peers, schedule="1f1b", microbatches=4)   # peers: global rank of each stage
    loss_sum, n = runner.train(batch, loss_fn, scale)   # forward + backward; every stage gets the last one's sums
    loss_sum, n = runner.evaluate(batch, loss_fn)       # forward only

The rows are cut into `microbatches` along the batch dim. GPipe: all forwards, then all backwards (m micro-batches
in flight). 1F1B (PipeDream-Flush): stage s runs p - s - 1 warm-up forwards, then alternates one forward and one
backward, so at most p - s micro-batches are in flight on it. The last stage computes the loss of each
micro-batch (a SUM over its targets) and back-propagates loss_sum * scale.

Why by hand, not torch.distributed.pipelining's schedules: its stages infer the shapes of the tensors they
exchange from the first step and pre-allocate the receive buffers, while HF batches are padded to the longest
row of each batch, so T changes from step to step (padding every batch to --max_seq_length would spend compute
on padding). Here each activation and gradient travels after a small shape header. Sends are non-blocking and
receives blocking, which the two schedules' orders keep free of deadlock.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

SCHEDULES = ("gpipe", "1f1b")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # dtype, ndim, up to 6 dims


def schedule_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """[("F", i) | ("B", i), ...] for this stage."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"--pp_schedule {schedule!r}: valid values are {', '.join(SCHEDULES)}")
    warm = min(stages - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def microbatches(args) -> int:
    """--pp_microbatches, or its default: 2 x pp_size micro-batches, fewer when the per-device batch is smaller."""
    if args.pp_microbatches:
        return args.pp_microbatches
    rows = args.per_device_train_batch_size
    return max(d for d in range(1, min(2 * args.pp_size, rows) + 1) if rows % d == 0)


def split_microbatches(batch: dict, m: int) -> list[dict]:
    rows = batch["input_ids"].shape[0]
    if rows % m:
        raise ValueError(f"--pp_microbatches {m} does not divide the {rows} rows of a batch")
    parts = {k: v.chunk(m, dim=0) if torch.is_tensor(v) else [v] * m for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(m)]


class PipelineRunner:
    def __init__(self, stage, peers: list[int], schedule: str = "1f1b", microbatches: int = 1, model=None,
                 group=None, autocast=None):
        """stage: this rank's PipelineStage; model: what to call for the forward (the stage or a wrapper of it);
        peers: global rank of every stage of this rank's pipeline; group: the pipeline process group; autocast: a
        context-manager factory around each forward and its loss only (mixed precision). Not around the whole
        schedule: its backwards would run under autocast, whose weight-cast cache then outlives the micro-batches,
        which FSDP2's unsharded parameters (re-gathered per forward and backward) must not share."""
        self.stage, self.model = stage, model if model is not None else stage
        self.autocast = autocast or contextlib.nullcontext
        self.peers, self.group = peers, group
        self.schedule, self.m = schedule, microbatches
        self.order = schedule_order(schedule, stage.stage_index, stage.num_stages, microbatches)
        self.sent_bytes = 0       # activation / gradient bytes this stage sent (headers aside), since creation
        self.wait_s = 0.0         # seconds blocked in receives: this stage's idle time (the bubble), since creation
        self._pending: list = []

    # ------------------------------------------------------------------ point to point
    def _device(self) -> torch.device:
        return next(self.stage.parameters()).device

    def _send(self, t: torch.Tensor, stage: int) -> None:
        t = t.detach().contiguous()
        header = torch.zeros(_HEADER, dtype=torch.int64, device=t.device)
        header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
        header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        dst = self.peers[stage]
        self._pending += [(dist.isend(header, dst), header), (dist.isend(t, dst), t)]
        self.sent_bytes += t.numel() * t.element_size()

    def _recv(self, stage: int) -> torch.Tensor:
        src = self.peers[stage]
        header = torch.empty(_HEADER, dtype=torch.int64, device=self._device())
        t0 = time.perf_counter()
        dist.recv(header, src)
        self.wait_s += time.perf_counter() - t0
        h = header.tolist()
        t = torch.empty(h[2:2 + h[1]], dtype=_DTYPES[h[0]], device=header.device)
        dist.recv(t, src)
        return t

    def _wait(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def _broadcast_from_last(self, total: torch.Tensor) -> torch.Tensor:
        if len(self.peers) > 1:
            dist.broadcast(total, src=self.peers[-1], group=self.group)
        return total

    # ------------------------------------------------------------------ one step
    def _forward(self, mb: dict, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, position_ids=mb.get("position_ids"), attention_mask=mb.get("attention_mask"),
                          seq_len=mb["input_ids"].shape[1])

    def train(self, batch: dict, loss_fn, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        s, last = self.stage.stage_index, self.stage.is_last
        mbs = split_microbatches(batch, self.m)
        total = torch.zeros(2, dtype=torch.float64, device=self._device())
        inputs, outputs = {}, {}
        for kind, i in self.order:
            mb = mbs[i]
            if kind == "F":
                x = mb["input_ids"] if self.stage.is_first else self._recv(s - 1).requires_grad_()
                with self.autocast():
                    out = self._forward(mb, x)
                    if last:
                        loss_sum, n = loss_fn(out, mb["labels"])
                if last:
                    total += torch.stack([loss_sum.detach().double(), n.double()])
                    out = loss_sum * scale
                else:
                    self._send(out, s + 1)
                inputs[i], outputs[i] = x, out
                continue
            x, out = inputs.pop(i), outputs.pop(i)
            with self.stage.receiving(None if self.stage.is_first else x):
                if last:
                    out.backward()
                else:
                    torch.autograd.backward(out, self._recv(s + 1))
            if not self.stage.is_first:
                self._send(x.grad, s - 1)
        self._wait()
        total = self._broadcast_from_last(total)
        return total[0], total[1]

    @torch.no_grad()
    def evaluate(self, batch: dict, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.stage.stage_index
        total = torch.zeros(2, dtype=torch.float64, device=self._device())
        for mb in split_microbatches(batch, self.m if batch["input_ids"].shape[0] % self.m == 0 else 1):
            x = mb["input_ids"] if self.stage.is_first else self._recv(s - 1)
            with self.autocast():
                out = self._forward(mb, x)
                if self.stage.is_last:
                    loss_sum, n = loss_fn(out, mb["labels"])
            if self.stage.is_last:
                total += torch.stack([loss_sum.double(), n.double()])
            else:
                self._send(out, s + 1)
        self._wait()
        total = self._broadcast_from_last(total)
        return total[0], total[1]
