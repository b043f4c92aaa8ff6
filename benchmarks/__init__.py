"""hfpar's benchmarks, one folder per topic, each script a module: `python -m benchmarks.<topic>.<name> --help`.

Shared pieces live in benchmarks/common/ (the launcher every benchmark starts processes with, the saved-tensor
byte counter); results go to benchmarks/results/<topic>/ (docs/benchmarks.md lists them)."""

import os

# every benchmark run (its tiny / random-init models) takes its recipe's embedded-run options beneath its own flags,
# as before those options became the no-model run's only (hfpar.config.DEMO_ENV); a user's run names its model
os.environ.setdefault("HFPAR_DEMO_OPTIONS", "always")
