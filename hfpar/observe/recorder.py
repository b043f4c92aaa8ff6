"""The RunRecorder: what a run writes about itself, handed records by the trainer (it never calls the trainer).

    recorder = RunRecorder(accelerator, ctx, "out", model, total_steps=100, global_batch=32, logging_steps=10,
                           report_to="none")                  # before the backend wraps the model
    recorder.model_ready(backend, implementation)             # after: host memory, versions, optimizer
    recorder.start(start_step)                                # metrics.jsonl (cut back to start_step on resume)
    recorder.step(rec); recorder.eval(step, {"eval_loss": ...})
    recorder.end_loop(); recorder.finish()                    # run_info.json, report.png, summary table, trackers

Outputs under the output dir: metrics.jsonl (one object per optimizer step, eval records), run_info.json (written
after the first step, once optimizer state exists, and again at the end), report.png; the tracker logging
(accelerator.log), the progress bar and the console step line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hfpar.observe import metrics as M
from hfpar.observe import plot


class RunRecorder:
    def __init__(
        self,
        accelerator,
        ctx,
        output_dir: str | Path,
        model: torch.nn.Module,
        *,
        total_steps: int,
        global_batch: int,
        logging_steps: int,
        report_to: str,
        run_extra: dict | None = None,
    ):
        self.acc, self.ctx, self.out = accelerator, ctx, Path(output_dir)
        self.total_steps, self.global_batch, self.logging_steps = total_steps, global_batch, logging_steps
        self.trackers = report_to != "none"
        self.run_extra = run_extra or {}
        self.n_params = M.param_count(model)  # full count, before any wrapper shards the parameters
        M.track_grad_bytes()  # grads are freed after each step: record their bytes as the optimizer steps
        self.backend = self.rss_after_load = self.run_meta = None
        self.start_step, self.t_start, self.writer, self.bar = 0, None, None, None

    def model_ready(self, backend, implementation) -> None:
        """After backend.prepare: the model is loaded and wrapped on every path. Versions, command and optimizer
        (`implementation(torch_optimizer) -> str`) are gathered here, never inside the loop (no import stalls a
        step)."""
        self.backend = backend
        self.rss_after_load = M.host_peak_rss_bytes()
        self.run_meta = M.run_metadata(backend.optimizer, implementation)

    # ------------------------------------------------------------------ the loop
    def start(self, start_step: int) -> None:
        """metrics.jsonl from start_step (a resumed run drops the records written after its checkpoint)."""
        self.start_step, self.t_start = start_step, time.perf_counter()
        main = self.acc.is_main_process
        if start_step > 0 and main:
            truncate_metrics(self.out / "metrics.jsonl", start_step)
        self.writer = M.MetricsWriter(self.out / "metrics.jsonl", main, append=start_step > 0)
        self.bar = tqdm(
            total=self.total_steps,
            initial=start_step,
            disable=not self.acc.is_local_main_process,
            desc=f"hfpar {self.backend.strategy}",
            dynamic_ncols=True,
        )

    def step(self, rec: dict) -> None:
        """Collective on the first step of this launch (run_info.json gathers every rank's bytes)."""
        done = rec["step"]
        self.writer.write(rec)
        if done == self.start_step + 1:  # after the first step, so optimizer state exists and is counted
            self.write_run_info()
        if self.trackers:
            self.acc.log({k: v for k, v in rec.items() if k != "step"}, step=done)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}")
        if (done % self.logging_steps == 0 or done == self.total_steps) and self.acc.is_local_main_process:
            self.bar.write(
                f"step {done}/{self.total_steps} loss {rec['loss']:.4f} grad_norm {rec['grad_norm']:.3f} "
                f"lr {rec['lr']:.3e} tok/s {rec['tokens_per_s']:.0f}"
            )

    def eval(self, step: int, ev: dict) -> None:
        if not ev:
            return
        self.writer.write({"step": step, **ev})
        if self.trackers:
            self.acc.log(ev, step=step)
        self.acc.print(f"[hfpar] step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in ev.items()))

    def end_loop(self) -> None:
        self.bar.close()

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Collective: run_info.json with the whole run's peaks and wall time, report.png and the summary table,
        then the trackers closed."""
        self.write_run_info(wall_time_s=round(time.perf_counter() - self.t_start, 2))
        if self.acc.is_main_process:
            self.report()
        # no rank tears its process groups down while another still uses them; before end_training, which
        # (Accelerate >= 1.x) destroys the default process group when trackers are on
        self.acc.wait_for_everyone()
        if self.trackers:
            self.acc.end_training()

    def write_run_info(self, **final) -> None:
        """Collective. After the first step (optimizer state exists) and again at the end (peak memory, wall time)."""
        acc, backend = self.acc, self.backend
        opt_bytes = M.optimizer_state_bytes(backend.optimizer) + backend.other_optimizer_state_bytes()
        local = torch.tensor(
            [
                M.param_bytes(backend.model),
                opt_bytes,
                M.grad_bytes(backend.optimizer),
                M.peak_memory_bytes(acc.device),
                self.rss_after_load,
                M.host_peak_rss_bytes(),
            ],
            dtype=torch.float64,
        )
        gathered = acc.gather(local.to(acc.device)).view(-1, 6).cpu()
        info = {
            "strategy": backend.strategy,
            "backend": backend.name,
            "distributed_type": str(acc.distributed_type).split(".")[-1],
            "mixed_precision": acc.mixed_precision,
            "device": str(acc.device),
            **self.ctx.as_dict(),
            "num_parameters": self.n_params,
            "param_bytes_per_rank": [int(x) for x in gathered[:, 0]],
            "optimizer_state_bytes_per_rank": [int(x) for x in gathered[:, 1]],
            "grad_bytes_per_rank": [int(x) for x in gathered[:, 2]],
            "peak_mem_bytes_per_rank": [int(x) for x in gathered[:, 3]],
            # host memory of each rank's process: peak RSS once the model was loaded and wrapped, and so far (the
            # final write: the whole run)
            "host_peak_rss_after_load_bytes_per_rank": [int(x) for x in gathered[:, 4]],
            "host_peak_rss_bytes_per_rank": [int(x) for x in gathered[:, 5]],
            "global_batch_size": self.global_batch,
            "total_steps": self.total_steps,
            **self.run_meta,
            **self.run_extra,
            **final,
        }
        if acc.is_main_process:
            M.write_json(self.out / "run_info.json", info)

    def report(self) -> None:
        """report.png (loss, eval loss, lr, tokens/s) and a summary table at the end of the run."""
        try:
            print(f"[hfpar] report: {plot.write_report(self.out)}")
        except plot.PlotError as exc:  # matplotlib absent: the run itself is fine
            print(f"[hfpar] no report.png: {exc}")
        print(plot.summary_table(self.out))


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records the interrupted run wrote after the checkpoint step."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))
