"""Plots and a text summary of runs, from their metrics.jsonl and run_info.json.

hfpar plot out/ddp out/fsdp2 -o runs.png      curves of several runs overlaid (2x2: loss, eval loss, lr, tokens/s)
python -c "from hfpar.observe.plot import write_report, summary_table; write_report('out'); print(summary_table('out'))"
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


class PlotError(ValueError):
    """A run directory or plotting problem; the message is one line."""


def read_run(run_dir: str | Path) -> tuple[list[dict], list[dict], dict]:
    """(train records, eval records, run_info) of a run directory."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no metrics.jsonl (is it the --output_dir of a run?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    info_path = Path(run_dir) / "run_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    evals = [r for r in rows if "loss" not in r and any(k.startswith("eval_") for k in r)]
    return [r for r in rows if "loss" in r], evals, info


def _figure(**kw):
    """A matplotlib Figure drawn by Agg without pyplot; PlotError if matplotlib is not installed.
    why: docs/architecture.md#why-start-up-time"""
    try:
        import matplotlib  # noqa: F401  (the package itself first: a submodule already imported would not tell)
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install hfpar[plot]") from None
    return Figure(**kw)


# online RL runs (a `reward` in their records): what people watch there, in place of the eval loss
# (with --beta 0, TRL's default, there is no reference and no KL: the policy's entropy is shown in its place)
RL_PANELS = [
    ("reward", "mean reward"),
    ("kl", "KL to the reference"),
    ("entropy", "entropy (no reference: --beta 0)"),
    ("completions/mean_length", "completion length"),
]


def _draw(runs: list[tuple[str, list[dict], list[dict]]], out: str | Path, title: str) -> Path:
    rl = [(k, name) for k, name in RL_PANELS if any(k in r for _, train, _ in runs for r in train)]
    rl = [(k, name) for k, name in rl if not (k == "entropy" and any(x == "kl" for x, _ in rl))]
    keys = [("loss", "train loss"), *(rl if rl else [("eval_loss", "eval loss")])]
    keys += [("lr", "learning rate"), ("tokens_per_s", "tokens / s")]
    cols = 2 if len(keys) <= 4 else 3
    fig = _figure(figsize=(5.5 * cols, 7.5))
    axes = fig.subplots(2, cols).reshape(-1)
    panels = [(axes[i], key, name) for i, (key, name) in enumerate(keys)]
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    for i, (label, train, evals) in enumerate(runs):
        color = f"C{i % 10}"
        for ax, key, _ in panels:
            rows = evals if key == "eval_loss" else train
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(
                    *zip(*pts),
                    color=color,
                    label=label,
                    marker="o" if key == "eval_loss" or len(pts) < 3 else None,
                    markersize=3,
                )
            ev = [(r["step"], r["eval_reward"]) for r in evals if key == "reward" and r.get("eval_reward") is not None]
            if ev:  # online RL: the eval prompts' mean reward beside the training batches'
                ax.plot(*zip(*ev), color=color, linestyle="--", marker="o", markersize=3, label=f"{label} (eval)")
    for ax, _, name in panels:
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(title)
    # fixed margins, not tight_layout(): the same layout for 2 or 3 columns, and a report drawn in 0.5 s instead of
    # 0.8 s (tight_layout measures every tick label first); every run's rank 0 draws one at its end
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.07, top=0.91, wspace=0.22, hspace=0.32)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _label(run_dir: str | Path, info: dict) -> str:
    name = Path(run_dir).resolve().name
    return f"{name} ({info['strategy']})" if info.get("strategy") else name


def plot_runs(run_dirs: list[str | Path], out: str | Path = "runs.png") -> Path:
    """One PNG with the runs' train loss, eval loss, lr and tokens/s overlaid; legend = dir name (strategy)."""
    runs = []
    for d in run_dirs:
        train, evals, info = read_run(d)
        runs.append((_label(d, info), train, evals))
    return _draw(runs, out, f"{len(runs)} run(s)")


def write_report(output_dir: str | Path) -> Path:
    """output_dir/report.png: loss and eval loss (online RL: reward, KL, completion length), lr, tokens/s over the
    steps of one run."""
    train, evals, info = read_run(output_dir)
    return _draw([(_label(output_dir, info), train, evals)], Path(output_dir) / "report.png", _label(output_dir, info))


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """A byte count in the largest binary unit that keeps the value >= 1, three significant digits: 0 B, 812 B,
    1.50 KiB, 18.3 MiB, 512 MiB, 1.00 GiB. A non-zero count never reads 0.00."""
    value, unit = float(n), 0
    while True:
        for digits in (2, 1, 0) if unit else (0,):  # 9.996 KiB rounds to 10.00: say 10.0 KiB
            text = f"{value:.{digits}f}"
            if abs(float(text)) < 10 ** (3 - digits):
                break
        if abs(float(text)) < 1024 or unit == len(_UNITS) - 1:  # 1023.7 KiB rounds to 1024: say 1.00 MiB
            return f"{text} {_UNITS[unit]}"
        value, unit = value / 1024, unit + 1


def summary_table(output_dir: str | Path) -> str:
    """A short text table: final loss, final eval loss, median tokens/s, peak memory per rank, wall time."""
    train, evals, info = read_run(output_dir)
    rows = [
        ("run", _label(output_dir, info)),
        ("steps", str(train[-1]["step"]) if train else "-"),
        ("final loss", f"{train[-1]['loss']:.4f}" if train else "-"),
    ]
    if evals and "eval_reward" in evals[-1] and "eval_loss" not in evals[-1]:
        rows.append(("final eval reward", f"{evals[-1]['eval_reward']:.4f}"))
    else:
        rows.append(("final eval loss", f"{evals[-1]['eval_loss']:.4f}" if evals else "-"))
    tps = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    rows.append(("median tokens/s", f"{statistics.median(tps):,.0f}" if tps else "-"))
    if info.get("peak_mem_bytes_per_rank"):
        rows.append(("peak memory/rank", ", ".join(human_bytes(b) for b in info["peak_mem_bytes_per_rank"])))
    elif any("peak_mem_bytes" in r for r in train):
        rows.append(("peak memory (rank 0)", human_bytes(max(r.get("peak_mem_bytes", 0) for r in train))))
    for key, name in (
        ("param_bytes_per_rank", "param bytes/rank"),
        ("grad_bytes_per_rank", "grad bytes/rank"),
        ("optimizer_state_bytes_per_rank", "optimizer bytes/rank"),
    ):
        if info.get(key):
            rows.append((name, ", ".join(human_bytes(b) for b in info[key])))
    wall = info.get("wall_time_s")
    if wall is None and train and all("step_time_s" in r for r in train):
        wall = sum(r["step_time_s"] for r in train)
        rows.append(("train step time (sum)", f"{wall:.1f} s"))
    elif wall is not None:
        rows.append(("wall time", f"{wall:.1f} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
