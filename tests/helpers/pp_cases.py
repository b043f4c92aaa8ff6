"""The launches of tests/launch/test_pp_parity.py, case name -> (accelerate config, processes, per-device batch, flags):
CASES the suite's pipeline cases, MOE_CASES EP x PP against moe_single, EXTENDED the extended tier (-m extended),
MULTI the 1F1B cases with two or three more parallelisms.
"""

from __future__ import annotations

INTERLEAVED = ["--pp_size", "2", "--pp_schedule", "interleaved_1f1b"]  # 2 chunks of 1 layer per rank
CASES = {  # name: (accelerate config, processes, per-device batch, extra flags)
    "pp2_gpipe": ("ddp", 2, "4", ["--pp_size", "2", "--pp_schedule", "gpipe"]),
    "pp2_1f1b": ("ddp", 2, "4", ["--pp_size", "2", "--pp_schedule", "1f1b"]),
    "pp2_checkpointing_split": (
        "ddp",
        2,
        "4",
        ["--pp_size", "2", "--gradient_checkpointing", "--pp_split", "0,1", "--pp_microbatches", "2"],
    ),
    # interleaved 1F1B (2 chunks per rank), each chunk tensor-parallel with sequence parallelism, dp 1
    "pp2_interleaved_tp2_sp": (
        "ddp",
        4,
        "4",
        [*INTERLEAVED, "--pp_microbatches", "4", "--tp_size", "2", "--sequence_parallel"],
    ),
    "pp2_dp2": ("ddp", 4, "2", ["--pp_size", "2"]),
    # each stage tensor-parallel (sequence-parallel: boundary activations are (B, T/tp, H) per TP rank), dp 1
    "pp2_tp2_sp": ("ddp", 4, "4", ["--pp_size", "2", "--tp_size", "2", "--sequence_parallel"]),
    # each rank's chunks (interleaved) fully_shard-ed over its dp group of 2 (1F1B stages: pp2_tp2_dp2_fsdp2 below)
    "pp2_interleaved_dp2_fsdp2": ("fsdp2", 4, "2", [*INTERLEAVED, "--pp_microbatches", "2"]),
    # each rank's chunks' optimizer state partitioned by DeepSpeed ZeRO-1 over its dp group of 2 (fp32 only)
    "pp2_interleaved_dp2_zero1": ("zero1", 4, "2", [*INTERLEAVED, "--pp_microbatches", "2"]),
}
MOE = ["--upcycle_experts", "4", "--moe_top_k", "2", "--moe_aux_loss_coef", "0.1"]
MOE_CASES = {  # EP x PP against their own one-process reference (micro-steps of one pipeline micro-batch's rows)
    "moe_single": ("single", 1, "2", [*MOE, "--gradient_accumulation_steps", "4"]),
    "ep2_pp2_interleaved_fsdp2": ("fsdp2", 4, "2", [*MOE, "--ep_size", "2", *INTERLEAVED, "--pp_microbatches", "2"]),
}
# on demand (-m extended): EP x PP under 1F1B over hfpar's DDP; PP x CP with Ulysses and the other backends
EXTENDED = {
    "ep2_pp2_1f1b": ("ddp", 4, "2", [*MOE, "--ep_size", "2", "--pp_size", "2", "--pp_schedule", "1f1b"]),
    "moe_single": MOE_CASES["moe_single"],  # its own reference: -m extended runs without the CI tier's launches
    # in CASES until 2026-11-28, moved here for the CI time budget (CI ran 2406 s): 4 stages (4 processes), and
    # pp 2 x dp 2 x tp 2 under fsdp2.yaml (8 processes on 2 cores, the suite's costliest launch)
    "pp4": ("ddp", 4, "4", ["--pp_size", "4", "--pp_microbatches", "4"]),
    # both: each stage tensor-parallel (no SP: the full-length boundary states), its TP shards fully_shard-ed over dp
    "pp2_tp2_dp2_fsdp2": ("fsdp2", 8, "2", ["--pp_size", "2", "--tp_size", "2"]),
    # each stage's attention context-parallel over its cp group of 2, every micro-batch with its rows' layout
    "pp2_cp2_ring": ("ddp", 4, "4", ["--pp_size", "2", "--cp_size", "2", "--cp_mode", "ring"]),
    "pp2_cp2_ulysses_zero1": ("zero1", 4, "4", ["--pp_size", "2", "--cp_size", "2", "--cp_mode", "ulysses"]),
    "pp2_cp2_ring_fsdp2": ("fsdp2", 4, "4", ["--pp_size", "2", "--cp_size", "2", "--cp_mode", "ring"]),
    # ZeRO-1 with TP: DeepSpeed's norm over the stages x TP ranks (TP shards summed, replicated parameters counted on
    # TP rank 0), each stage's TP shards' optimizer state partitioned over dp (8 processes: pp 2 x dp 2 x tp 2)
    "pp2_tp2_sp_zero1": ("zero1", 4, "4", ["--pp_size", "2", "--tp_size", "2", "--sequence_parallel"]),
    "pp2_tp2_dp2_zero1": ("zero1", 8, "2", ["--pp_size", "2", "--tp_size", "2"]),
    # ZeRO-1 with EP: the dense parameters' optimizer state over each stage's dp group, the experts beside DeepSpeed
    # (reduced over the ranks holding the same ones, their norm joined to DeepSpeed's, an AdamW of their own)
    "ep2_pp2_zero1": ("zero1", 4, "2", [*MOE, "--ep_size", "2", "--pp_size", "2", "--pp_schedule", "1f1b"]),
    # a pipeline with two or three other model parallelisms, one case per key (dp 1 unless said; MoE ones against
    # moe_single: micro-batches of 2 rows over the dp ranks): each stage tensor-parallel (sequence-parallel) and
    # context-parallel (8 processes)
    "tp2_cp2_pp2_sp": (
        "ddp",
        8,
        "4",
        ["--pp_size", "2", "--tp_size", "2", "--sequence_parallel", "--cp_size", "2", "--cp_mode", "ring"],
    ),
    # experts drawn from each rank's 2 cp ranks, Ulysses attention, interleaved 1F1B (2 chunks per rank)
    "ep2_cp2_pp2_ulysses_interleaved": (
        "ddp",
        4,
        "4",
        [*MOE, "--ep_size", "2", "--cp_size", "2", "--cp_mode", "ulysses", *INTERLEAVED, "--pp_microbatches", "2"],
    ),
    # dp 2 x cp 2 per stage, one expert per rank of the 4 (experts drawn from dp x cp), FSDP2 over dp (8 processes)
    "ep4_cp2_pp2_fsdp2": (
        "fsdp2",
        8,
        "2",
        [*MOE, "--ep_size", "4", "--cp_size", "2", "--cp_mode", "ring", "--pp_size", "2"],
    ),
    # each stage tensor-parallel, experts over its 2 dp ranks, FSDP2 over dp (8 processes)
    "tp2_ep2_pp2_fsdp2": ("fsdp2", 8, "2", [*MOE, "--tp_size", "2", "--ep_size", "2", "--pp_size", "2"]),
    # all four: each stage tensor-parallel, experts drawn from its 2 cp ranks (8 processes)
    "tp2_ep2_cp2_pp2": (
        "ddp",
        8,
        "4",
        [
            *MOE,
            "--tp_size",
            "2",
            "--ep_size",
            "2",
            "--cp_size",
            "2",
            "--cp_mode",
            "ring",
            "--pp_size",
            "2",
            "--pp_schedule",
            "1f1b",
            "--pp_microbatches",
            "2",
        ],
    ),
    # the keys under the pipeline ZeRO-1 backend: TP (sequence parallel) x CP ring, TP x EP at dp 2 (TP tags and
    # experts beside DeepSpeed together), experts drawn from the 2 cp ranks (DeepSpeed's dp group: the replica's
    # dp x cp ranks, holding different experts), and all four (8 processes but the third, 4); micro-batches of 2 rows
    # where dp is 1, as moe_single's routing statistics
    "tp2_cp2_pp2_sp_zero1": (
        "zero1",
        8,
        "4",
        ["--pp_size", "2", "--tp_size", "2", "--sequence_parallel", "--cp_size", "2", "--cp_mode", "ring"],
    ),
    "tp2_ep2_pp2_zero1": ("zero1", 8, "2", [*MOE, "--tp_size", "2", "--ep_size", "2", "--pp_size", "2"]),
    "ep2_cp2_pp2_zero1": (
        "zero1",
        4,
        "4",
        [*MOE, "--ep_size", "2", "--cp_size", "2", "--cp_mode", "ring", "--pp_size", "2", "--pp_microbatches", "2"],
    ),
    "tp2_ep2_cp2_pp2_zero1": (
        "zero1",
        8,
        "4",
        [
            *MOE,
            "--tp_size",
            "2",
            "--ep_size",
            "2",
            "--cp_size",
            "2",
            "--cp_mode",
            "ring",
            "--pp_size",
            "2",
            "--pp_microbatches",
            "2",
        ],
    ),
}
MULTI = [
    "tp2_cp2_pp2_sp",
    "ep2_cp2_pp2_ulysses_interleaved",
    "ep4_cp2_pp2_fsdp2",
    "tp2_ep2_pp2_fsdp2",
    "tp2_ep2_cp2_pp2",
    "tp2_cp2_pp2_sp_zero1",
    "tp2_ep2_pp2_zero1",
    "ep2_cp2_pp2_zero1",
    "tp2_ep2_cp2_pp2_zero1",
]
