"""GRPO under context parallelism: per-rank memory of a training step against the group's length (prompt +
completion) at cp = 1, 2, 4, and the longest group that trains within a fixed per-rank memory budget (CPU, gloo,
fp32); the generation's memory measured apart.

    python -m benchmarks.grpo.cp_length          # -> benchmarks/results/grpo/cp_length_cpu.{json,md,png}
    python -m benchmarks.grpo.cp_length --budget_mib 24 --runs cp1,cp2_ring,cp4_ring
    python -m benchmarks.grpo.cp_length --report       # the .md and .png again from the .json

The grpo recipe (hfpar.recipe.main("grpo", argv), as recipes/grpo.py calls it) under `accelerate launch`, one launch
per configuration, every length of the search a recipe run in that launch (benchmarks.common.cp_length: the search,
the measurement, the relaunch of a launch that dies):
  cp1              single.yaml, 1 process, the completion log-probs chunked (--loss_chunk_size 64:
                   hfpar.parallel.chunked_logps; 64 x 8192 fp32 logits at a time)
  cp1_full_logits  the same with --loss_chunk_size 0: the head forms the completion targets' (N, V) logits
  cpN_ring         ddp.yaml, N processes, --cp_size N --cp_mode ring (dp = 1): each prompt + completion row cut
                   load-balanced over the N ranks for the training forward / backward and the log-prob forwards
  cpN_ulysses      the same with --cp_mode ulysses
Model: the DPO benchmark's Llama (hidden 64, 2 layers) with its vocabulary padded to 8192 rows (benchmarks/grpo/
cp_length_spec.py says why), random init, fp32, one thread per process. A group of length L: 4 completions of one
prompt; the prompt L/8 tokens of random letters, each completion exactly 7L/8 tokens: --max_completion_length 7L/8
and --generation_kwargs '{"min_new_tokens": 7L/8}' (TRL's GRPOConfig name; transformers' min_new_tokens masks the
EOS until then, so a random model's completions have the length the search asks for). Reward: a dense one
(benchmarks.grpo.trl_compare.letter_share), so the advantages are not zero. 3 optimizer steps (AdamW, lr 1e-3
constant, clipping at 1.0, --num_iterations 2, --beta 0.04): the third generates the second window, computes its
old and reference log-probs and trains on it, with the model, the reference copy and the AdamW state already live;
it is the step measured.

Memory: torch.profiler's memory events over the whole third step (benchmarks.common.cp_length); the generation
(hfpar.rollout.engine.InPlaceEngine.generate) and the log-prob forwards (hfpar.rollout.loop.Rollout._logps) are
marked as spans. The budget counts the training: the step's peak outside the generation span (old + reference
log-probs, the policy's forward and backward, clipping, the optimizer step). Generation under CP runs the whole
sequence on every rank (hfpar.parallel.context_parallel.whole_sequence), so its memory does not shrink with cp: its
own peak is reported beside, not in the budget. Budget --budget_mib per rank (default 12 MiB); the search as the DPO
benchmark's (doubling from --base 32, then 2 bisection steps), the parity check (losses and grad norms of the 3
steps against cp1 at the same length, 1e-4 relative; the same completions under every mesh) at the doubling's
lengths, which every configuration runs.
"""

from __future__ import annotations

from benchmarks.common.cp_length import LengthCase, main
from benchmarks.grpo.cp_length_report import plot, report
from benchmarks.grpo.cp_length_spec import CONFIG, FLAGS, MEASURED_STEP, PHASES, RUNS, argv

CASE = LengthCase(
    recipe="grpo",
    module="benchmarks.grpo.cp_length",
    topic="grpo",
    runs=RUNS,
    flags=FLAGS,
    config=CONFIG,
    measured_step=MEASURED_STEP,
    argv=argv,
    report=report,
    plot=plot,
    phases=PHASES,
    budget_excludes=("generation",),
    metrics=("completions/mean_length", "generation_time_s"),
    bisect=2,
    rerun_cp1_fits=False,  # compared at the doubling's lengths (every configuration runs them): half the runs
    defaults={"budget_mib": 12.0, "base": 32, "cap": 16384},
)

if __name__ == "__main__":
    main(CASE, __doc__)
