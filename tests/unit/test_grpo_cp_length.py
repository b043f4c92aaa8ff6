"""benchmarks/grpo/cp_length.py's pieces that its figures rest on, without running it (it takes minutes): a group of
length L is a prompt of L/8 tokens and completions forced to 7L/8; the memory of a step is split into its phases
(generation apart from the training the budget counts) as benchmarks/common/cp_length.py says; the same-training
comparison holds GRPO's near-zero losses to a floor, not to themselves."""

from __future__ import annotations

import json

import pytest

from benchmarks.common.cp_length import phase_peaks
from benchmarks.common.cp_length_report import parity
from benchmarks.grpo import cp_length_spec as spec
from hfpar.data import load_tokenizer


def test_a_group_of_length_l_is_a_prompt_and_forced_completions(tmp_path):
    tok = load_tokenizer(None)
    for length in (32, 448, 1000):
        p, c = spec.split(length)
        assert p + c == length and p == length // 8
        for row in spec.prompts(length):
            assert len(tok(row["prompt"]).input_ids) == p
        argv = spec.argv(tmp_path, length)
        assert argv[argv.index("--max_completion_length") + 1] == str(c)
        assert json.loads(argv[argv.index("--generation_kwargs") + 1]) == {"min_new_tokens": c}


def test_phase_peaks_split_the_step():
    # +4 before, generation allocates 10 and frees 9 (1 left), training allocates 6 and frees it
    memory = [(1, 4), (3, 10), (4, -9), (6, 6), (7, -6)]
    spans = [(2, 5, "generation"), (5.5, 8, "logps")]
    step, rest, phases = phase_peaks(memory, spans, excluded=("generation",))
    assert step == 14  # 4 + 10
    assert rest == 11  # outside the generation: 4 + 1 + 6
    assert phases == {"generation": 10, "logps": 6}


def test_near_zero_losses_are_compared_to_the_runs_scale():
    def row(run, losses):
        return {"run": run, "length": 64, "fits": True, "losses": losses, "grad_norms": [0.7, 0.6, 0.8]}

    ref = row("cp1", [6e-9, -0.1079, 1.257e-5])
    same = row("cp2_ring", [0.0, -0.1079 * (1 + 3e-6), 1.2575e-5])
    other = row("cp4_ring", [0.0, -0.1079, 2e-5])
    par = {p["run"]: p["max_rel_diff"] for p in parity([ref, same, other])}
    assert par["cp2_ring"] < 1e-4  # 6e-9 and 5e-9 apart: against 1e-2 of 0.1079
    assert par["cp4_ring"] == pytest.approx((2e-5 - 1.257e-5) / (1e-2 * 0.1079))
