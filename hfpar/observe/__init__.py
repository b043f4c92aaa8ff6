"""What a run records and shows: metrics.jsonl, run_info.json, the summary table, report.png, comm stats.

    metrics.py     per-rank bytes, peak memory, library versions, the JSONL writer
    comm_stats.py  CommCounter: bytes and calls per collective (benchmarks, tests)
    plot.py        report.png and `hfpar plot`
"""
