"""hfpar's benchmarks, one folder per topic, each script a module: `python -m benchmarks.<topic>.<name> --help`.

Shared pieces live in benchmarks/common/ (the launcher every benchmark starts processes with, the saved-tensor
byte counter); results go to benchmarks/results/<topic>/ (docs/benchmarks.md lists them)."""
