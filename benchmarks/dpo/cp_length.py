"""DPO under context parallelism: per-rank memory of a training step against the pair's length at cp = 1, 2, 4, and
the longest pair that trains within a fixed per-rank memory budget (CPU, gloo, fp32).

    python -m benchmarks.dpo.cp_length          # -> benchmarks/results/dpo/cp_length_cpu.{json,md,png}
    python -m benchmarks.dpo.cp_length --budget_mib 40 --runs cp1,cp2_ring,cp4_ring
    python -m benchmarks.dpo.cp_length --report       # the .md and .png again from the .json

The dpo recipe (its entry point hfpar.recipe.main("dpo", argv), as recipes/dpo.py calls it) under `accelerate
launch`, one launch per configuration, every length of the search a recipe run in that launch (the workers'
start-up paid once, Accelerate's state reset between runs, the process group kept: tests/helpers/recipe_runs.py):
  cp1          single.yaml, 1 process (the recipe's cp=1 rows: each pair's prompt computed once, a (1, 1, T, T)
               block mask; hfpar.data.preference.PairCollator share_prompt)
  cpN_ring     ddp.yaml, N processes, --cp_size N --cp_mode ring (dp = 1): the row prompt + chosen | prompt +
               rejected, the two sequences packed as documents, cut load-balanced over the N ranks
  cpN_ulysses  the same with --cp_mode ulysses
A small Llama built from a config (hidden 64, 2 layers, 4 heads / 2 kv heads of 16, the embedded 128-token
character tokenizer; nothing downloaded), fp32, one thread per process (a process stands for a device), 2 pairs of
the same length L (prompt L/4, chosen and rejected 3L/8 tokens each; standard-format text of random letters, the
eos appended), batch 1, 2 optimizer steps (AdamW, lr 1e-3 constant, clipping at 1.0), reference = the frozen copy.

Memory (per rank, of the second step, whose start already holds the model, the reference copy, the AdamW state):
torch.profiler's memory events (profile_memory=True) over the whole step, collation, reference forward, policy
forward and backward, clipping and the optimizer step included: the peak of the running sum of the bytes the CPU
allocator hands out during the step minus those of them it takes back (the profiler reports no free of a block
allocated before it started), i.e. the step's peak of live tensor bytes above what it started with. Exact, and
for cp1 and ring the same bytes at the same length whatever else runs on the machine (Ulysses' peaks differ
between ranks by up to a quarter and from run to run, timing-dependent around its all-to-alls), which RSS is not: glibc
keeps freed blocks for reuse, so RSS after the first step already holds the first step's free space and a later step's
growth hides in it. As a cross-check the process's RSS high-water mark over the same step (reset before it through
/proc/self/clear_refs, minus the RSS at its start; glibc's mmap threshold fixed at 64 KiB so that tensor buffers
are returned at free) is recorded too; it differs both ways: it adds the allocator's, gloo's and the profiler's
own memory (a few MiB) and misses zeroed pages never touched.
The figure of a (configuration, length) is the largest over its ranks (every rank's is in the JSON).

Budget: --budget_mib per rank (default 12 MiB of step memory); for each configuration the lengths double from
--base until one exceeds it (or --cap), then 3 bisection steps between the last that fits and the first that does
not: the limit to 1/8 of that doubling bracket (lengths rounded to 16 tokens). Configurations after cp1 also run
cp1's lengths that fit, so that every length cp1 fits is compared: each (configuration, length) the losses and grad
norms of both steps against cp1's at the same length (1e-4 relative: the contract, the same training), asserted at
the end, after the results are written.
"""

from __future__ import annotations

from benchmarks.common.cp_length import LengthCase, main
from benchmarks.common.cp_length_report import limits, parity  # noqa: F401  (tests/unit/test_dpo_cp_length.py)
from benchmarks.dpo.cp_length_report import plot, report
from benchmarks.dpo.cp_length_spec import (
    CONFIG,
    FLAGS,
    MEASURED_STEP,
    RUNS,
    data_file,
    pairs,  # noqa: F401  (tests/unit/test_dpo_cp_length.py reads it here)
)

CASE = LengthCase(
    recipe="dpo",
    module="benchmarks.dpo.cp_length",
    topic="dpo",
    runs=RUNS,
    flags=FLAGS,
    config=CONFIG,
    measured_step=MEASURED_STEP,
    argv=lambda root, length: ["--dataset_name", data_file(root, length)],
    report=report,
    plot=plot,
)

if __name__ == "__main__":
    main(CASE, __doc__)
