"""What a run records and shows: metrics.jsonl, run_info.json, the summary table, report.png, comm stats.

recorder.py    RunRecorder (what the trainer hands its records to): metrics.jsonl, run_info.json, trackers,
               the console step line, report.png and the summary table
metrics.py     per-rank bytes, peak memory, library versions, the JSONL writer
comm_stats.py  CommCounter: bytes and calls per collective (benchmarks, tests)
plot.py        report.png and `hfpar plot`
refusal.py     a refusal said once, in one line, by whichever rank finds it; its peers leave quietly
"""
