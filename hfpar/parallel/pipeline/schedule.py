"""Pipeline schedules over the stages of one pipeline group: GPipe, 1F1B and interleaved 1F1B, for one accumulation
step's rows.

    runner = PipelineRunner(stage, peers, schedule="1f1b", microbatches=4)   # peers: global rank of each stage
    loss_sum, n = runner.train(batch, loss_fn, scale)   # forward + backward; every stage gets the last one's sums
    loss_sum, n = runner.evaluate(batch, loss_fn)       # forward only

The rows are cut into `microbatches` along the batch dim. GPipe: all forwards, then all backwards (m micro-batches
in flight). 1F1B (PipeDream-Flush): stage s runs p - s - 1 warm-up forwards, then alternates one forward and one
backward, so at most p - s micro-batches are in flight on it. Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021):
each rank holds V chunks of layers (PipelineChunks: virtual stages r, r + p, ...); forwards walk the chunks in groups
of p micro-batches, (p - r - 1) x 2 + (V - 1) x p of them as warm-up, then one forward / one backward, backwards
walking the chunks in reverse; the bubble shrinks V-fold, (p - 1) / (V (m + p - 1)), for p2p traffic V times the
1F1B's. The last (virtual) stage computes the loss of each micro-batch (a SUM over its targets) and back-propagates
loss_sum * scale.

Each activation and gradient travels after a small shape header (why: docs/architecture.md#why-the-parallel-layers).
Sends are non-blocking and receives blocking; every schedule's order is free of deadlock and keeps each pair of ranks'
messages in the same order on both ends (tests/distributed/test_pp_stages.py replays the orders of p <= 8, V <= 4 to
check both).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # dtype, ndim, up to 6 dims


def schedule_order(
    schedule: str, stage: int, stages: int, microbatches: int, chunks: int = 1
) -> list[tuple[str, int, int]]:
    """[("F" | "B", micro-batch, chunk), ...] for pipeline rank `stage` of `stages`; chunk: the rank's local chunk
    (virtual stage chunk x stages + stage), always 0 unless interleaved_1f1b with chunks (V) > 1."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "interleaved_1f1b":
        return _interleaved_order(stage, stages, m, chunks)
    if schedule != "1f1b":
        raise ValueError(f"--pp_schedule {schedule!r}: valid values are {', '.join(SCHEDULES)}")
    warm = min(stages - stage - 1, m)
    order = [("F", i, 0) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(m - warm, m)]


def _interleaved_order(r: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved order (forward_backward_pipelining_with_interleaving) on rank r. The k-th forward
    runs chunk (k mod pV) // p on micro-batch (k // pV) x p + k mod p: p micro-batches through chunk 0, the same p
    through chunk 1, ...; the k-th backward the same walk with the chunks reversed. Rank r runs (p - r - 1) x 2 +
    (V - 1) x p forwards before its first backward (the last rank's first backward, of chunk V - 1, needs the
    forward of micro-batch 0 through every chunk before it), then alternates."""
    if m % p:
        raise ValueError(f"--pp_microbatches {m}: the interleaved schedule needs a multiple of --pp_size {p}")
    total = m * v
    warm = min((p - r - 1) * 2 + (v - 1) * p, total)

    def at(kind: str, k: int) -> tuple[str, int, int]:
        c = (k % (p * v)) // p
        return kind, (k // (p * v)) * p + k % p, c if kind == "F" else v - 1 - c

    order = [at("F", k) for k in range(warm)]
    for k in range(total - warm):
        order += [at("F", warm + k), at("B", k)]
    return order + [at("B", k) for k in range(total - warm, total)]


def microbatches(rows: int, pp: int, schedule: str, requested: int = 0) -> int:
    """The micro-batches of a per-device batch of `rows`: `requested` (--pp_microbatches), or its default: 2 x pp
    micro-batches, fewer when the batch is smaller (interleaved_1f1b: a multiple of pp; 0 when none divides the
    batch, which the preflight reports)."""
    if requested:
        return requested
    step = pp if schedule == "interleaved_1f1b" else 1
    return max((d for d in range(step, min(2 * pp, rows) + 1, step) if rows % d == 0), default=0)


def pipeline_stages(pp: int, schedule: str, virtual_stages: int = 1) -> int:
    """Stages the layers are cut into: pp, or pp x virtual_stages (--pp_virtual_stages) for interleaved_1f1b."""
    return pp * virtual_stages if schedule == "interleaved_1f1b" else pp


def split_microbatches(batch: dict, m: int) -> list[dict]:
    rows = batch["input_ids"].shape[0]
    if rows % m:
        raise ValueError(f"--pp_microbatches {m} does not divide the {rows} rows of a batch")
    parts = {k: v.chunk(m, dim=0) if torch.is_tensor(v) else [v] * m for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(m)]


class PipelineRunner:
    def __init__(
        self,
        stage,
        peers: list[int],
        schedule: str = "1f1b",
        microbatches: int = 1,
        model=None,
        group=None,
        autocast=None,
        micro_scope=None,
    ):
        """stage: this rank's PipelineStage, or PipelineChunks (interleaved_1f1b); model: what to call for the
        forward of a single stage (the stage or a wrapper of it); peers: global rank of every stage of this rank's
        pipeline; group: the pipeline process group; autocast: a context-manager factory around each forward and
        its loss only (mixed precision). Not around the whole schedule: its backwards would run under autocast,
        whose weight-cast cache then outlives the micro-batches, which FSDP2's unsharded parameters (re-gathered
        per forward and backward) must not share. micro_scope: (i, micro-batch i's dict) -> a context manager around its
        forward AND its backward (the per-micro-batch state layers read: MoE routers' token mask, the context-
        parallel row layout; activation checkpointing recomputes in backward)."""
        self.stage, self.peers, self.group = stage, peers, group
        self.autocast = autocast or contextlib.nullcontext
        self.micro_scope = micro_scope or (lambda i, mb: contextlib.nullcontext())
        self.chunks = list(getattr(stage, "chunks", [stage]))  # chunk c of rank r: virtual stage c x p + r
        self.model = model if model is not None else stage  # chunks: called as model(x, chunk=c) (PipelineChunks)
        if schedule == "interleaved_1f1b" and len(self.chunks) < 2:
            raise ValueError("--pp_schedule interleaved_1f1b: the rank holds one stage; build PipelineChunks")
        if schedule != "interleaved_1f1b" and len(self.chunks) > 1:
            raise ValueError(
                f"--pp_schedule {schedule}: the rank holds {len(self.chunks)} chunks; use interleaved_1f1b"
            )
        self.schedule, self.m = schedule, microbatches
        self.order = schedule_order(schedule, stage.stage_index, stage.num_stages, microbatches, len(self.chunks))
        self.sent_bytes = 0  # activation / gradient bytes this stage sent (headers aside), since creation
        self.wait_s = 0.0  # seconds blocked in receives: this stage's idle time (the bubble), since creation
        self._pending: list = []

    # ------------------------------------------------------------------ point to point
    def _device(self) -> torch.device:
        return next(self.stage.parameters()).device

    def _rank_of(self, virtual: int) -> int:
        return self.peers[virtual % len(self.peers)]

    def _send(self, t: torch.Tensor, virtual: int) -> None:
        t = t.detach().contiguous()
        header = torch.zeros(_HEADER, dtype=torch.int64, device=t.device)
        header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
        header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        dst = self._rank_of(virtual)
        self._pending += [(dist.isend(header, dst), header), (dist.isend(t, dst), t)]
        self.sent_bytes += t.numel() * t.element_size()

    def _recv(self, virtual: int) -> torch.Tensor:
        src = self._rank_of(virtual)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self._device())
        t0 = time.perf_counter()
        dist.recv(header, src)
        self.wait_s += time.perf_counter() - t0
        h = header.tolist()
        t = torch.empty(h[2 : 2 + h[1]], dtype=_DTYPES[h[0]], device=header.device)
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
    def _forward(self, c: int, mb: dict, x: torch.Tensor) -> torch.Tensor:
        kw = {"chunk": c} if len(self.chunks) > 1 else {}
        return self.model(
            x,
            position_ids=mb.get("position_ids"),
            attention_mask=mb.get("attention_mask"),
            seq_len=mb["input_ids"].shape[1],
            **kw,
        )

    def train(self, batch: dict, loss_fn, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        mbs = split_microbatches(batch, self.m)
        total = torch.zeros(2, dtype=torch.float64, device=self._device())
        inputs, outputs = {}, {}  # (chunk, micro-batch) -> what its backward needs
        for kind, i, c in self.order:
            mb, chunk = mbs[i], self.chunks[c]
            v = chunk.stage_index  # virtual stage (the stage itself unless interleaved)
            if kind == "F":
                x = mb["input_ids"] if chunk.is_first else self._recv(v - 1).requires_grad_()
                with self.micro_scope(i, mb), self.autocast():
                    out = self._forward(c, mb, x)  # (b, T, H) hidden states, or (b, T, vocab) logits on the last
                    if chunk.is_last:
                        loss_sum, n = loss_fn(out, mb["labels"])
                if chunk.is_last:
                    total += torch.stack([loss_sum.detach().double(), n.double()])
                    out = loss_sum * scale
                else:
                    self._send(out, v + 1)
                inputs[c, i], outputs[c, i] = x, out
                continue
            x, out = inputs.pop((c, i)), outputs.pop((c, i))
            with self.micro_scope(i, mb), chunk.receiving(None if chunk.is_first else x):
                if chunk.is_last:
                    out.backward()
                else:
                    torch.autograd.backward(out, self._recv(v + 1))
            if not chunk.is_first:
                self._send(x.grad, v - 1)
        self._wait()
        total = self._broadcast_from_last(total)
        return total[0], total[1]

    @torch.no_grad()
    def evaluate(self, batch: dict, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.zeros(2, dtype=torch.float64, device=self._device())
        mbs = split_microbatches(batch, self.m if batch["input_ids"].shape[0] % self.m == 0 else 1)
        # chunk by chunk, each over every micro-batch: a forward only waits on earlier forwards, and each pair of
        # ranks sends and receives in the same (chunk, micro-batch) order
        for c, chunk in enumerate(self.chunks):
            v = chunk.stage_index
            for i, mb in enumerate(mbs):
                x = mb["input_ids"] if chunk.is_first else self._recv(v - 1)
                with self.micro_scope(i, mb), self.autocast():
                    out = self._forward(c, mb, x)
                    if chunk.is_last:
                        loss_sum, n = loss_fn(out, mb["labels"])
                if chunk.is_last:
                    total += torch.stack([loss_sum.double(), n.double()])
                else:
                    self._send(out, v + 1)
        self._wait()
        total = self._broadcast_from_last(total)
        return total[0], total[1]
