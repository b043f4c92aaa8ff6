"""hfpar.observe.plot: the one-run report (PNG + text summary) and `hfpar plot`, on synthetic run directories.

python -m pytest -q tests/unit/test_plot.py
"""

from __future__ import annotations

import json

import pytest

from hfpar.cli import main as cli
from hfpar.observe.plot import PlotError, human_bytes, summary_table, write_report


def fake_run(root, name: str = "run", strategy: str = "fsdp2", steps: int = 20):
    d = root / name
    d.mkdir()
    rows = []
    for s in range(1, steps + 1):
        rows.append(
            {
                "step": s,
                "loss": 4.0 / s,
                "lr": 1e-3 * (1 - s / steps),
                "grad_norm": 1.0 / s,
                "tokens_per_s": 1000.0 + 10 * s,
                "step_time_s": 0.5,
                "peak_mem_bytes": 2**30 + s,
            }
        )
        if s % 10 == 0:
            rows.append({"step": s, "eval_loss": 5.0 / s})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "run_info.json").write_text(json.dumps({"strategy": strategy, "param_bytes_per_rank": [2**29, 2**29]}))
    return d


def is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_write_report(tmp_path):
    out = write_report(fake_run(tmp_path))
    assert out == tmp_path / "run" / "report.png" and is_png(out)


def test_summary_table(tmp_path):
    text = summary_table(fake_run(tmp_path))
    table = dict(line.split("  ", 1) for line in text.splitlines())
    table = {k.strip(): v.strip() for k, v in table.items()}
    assert table["run"] == "run (fsdp2)"
    assert table["final loss"] == "0.2000" and table["final eval loss"] == "0.2500"
    assert table["median tokens/s"] == "1,105"  # median of 1010..1200
    assert table["peak memory (rank 0)"] == "1.00 GiB"
    assert table["param bytes/rank"] == "512 MiB, 512 MiB"
    assert table["train step time (sum)"] == "10.0 s"


def test_summary_units_fit_the_size(tmp_path):
    """A tiny model's bytes read in KiB / MiB, never 0.00 GiB (the table once printed that below ~5 MB)."""
    d = fake_run(tmp_path)
    sizes = {
        "param_bytes_per_rank": [2_495_488, 1_247_744],
        "grad_bytes_per_rank": [1536, 812],
        "optimizer_state_bytes_per_rank": [0, 5 * 2**30],
        "peak_mem_bytes_per_rank": [987_654_321],
    }
    (d / "run_info.json").write_text(json.dumps({"strategy": "ddp", **sizes}))
    table = {k.strip(): v.strip() for k, v in (line.split("  ", 1) for line in summary_table(d).splitlines())}
    assert table["param bytes/rank"] == "2.38 MiB, 1.19 MiB"
    assert table["grad bytes/rank"] == "1.50 KiB, 812 B"
    assert table["optimizer bytes/rank"] == "0 B, 5.00 GiB"
    assert table["peak memory/rank"] == "942 MiB"


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (10239, "10.0 KiB"),
        (102399, "100 KiB"),
        (2**20 - 1, "1.00 MiB"),
        (18.3 * 2**20, "18.3 MiB"),
        (2**29, "512 MiB"),
        (2**30 + 20, "1.00 GiB"),
        (1.5 * 2**40, "1.50 TiB"),
    ],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_human_bytes_three_digits_never_zero():
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
    for n in sorted({int(1.37**k) for k in range(1, 125)}):  # 1 B .. ~1 PiB
        value, unit = human_bytes(n).split()
        assert 1 <= float(value) < 1024, (n, value, unit)  # never 0.00, never 1024 of a unit
        if unit != "B":  # three significant digits (1000-1023 keep their four)
            assert len(value.replace(".", "")) == 3 or ("." not in value and float(value) >= 1000), (n, value)
        assert abs(float(value) * units[unit] - n) <= 0.005 * n, (n, value, unit)


def test_summary_prefers_recorded_per_rank_peak_and_wall_time(tmp_path):
    d = fake_run(tmp_path)
    info = json.loads((d / "run_info.json").read_text())
    (d / "run_info.json").write_text(
        json.dumps({**info, "peak_mem_bytes_per_rank": [2**31, 2**30], "wall_time_s": 63.0})
    )
    text = summary_table(d)
    assert "peak memory/rank" in text and "2.00 GiB, 1.00 GiB" in text and "wall time" in text and "63.0 s" in text


def test_plot_cli_overlays_runs(tmp_path, capsys):
    a, b = fake_run(tmp_path, "a", "ddp"), fake_run(tmp_path, "b", "zero3", steps=10)
    cli(["plot", str(a), str(b), "-o", str(tmp_path / "x" / "both.png")])
    assert is_png(tmp_path / "x" / "both.png")


def test_missing_metrics_is_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        cli(["plot", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "empty: no metrics.jsonl" in err
    with pytest.raises(PlotError, match="no metrics.jsonl"):
        write_report(tmp_path / "empty")


def test_missing_matplotlib_is_one_line_error(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(SystemExit):
        cli(["plot", str(fake_run(tmp_path))])
    assert "matplotlib is not installed: pip install hfpar[plot]" in capsys.readouterr().err
