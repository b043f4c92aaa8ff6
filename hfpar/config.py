"""Typed recipe configuration with HF TrainingArguments / TRL option names.

    from hfpar.config import parse_args
    args = parse_args(["--max_steps", "20", "--learning_rate", "3e-4"], recipe="sft")

Sources, later wins: dataclass defaults < recipe defaults < the embedded run's options < `--config recipe.yaml` <
CLI flags. The embedded run's options (a recipe's `demo`: its tiny model's steps, learning rate, lengths) apply only
to a run that names no model (no --model_name_or_path, on the command line or in --config): a user's model trains
with the defaults `--help` shows, never with the demo's (HFPAR_DEMO_OPTIONS=always: every run, as the test suite and
the benchmarks run their tiny models).
Every problem (unknown key, bad value, inconsistent combination) is collected and raised once,
as a `ConfigError` whose message lists one problem per line, before any expensive work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, get_type_hints

import yaml

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr")
REPORT_TO = ("none", "all", "tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "trackio")
TRUNCATION = ("truncate", "drop")
PREEMPT_SIGNALS = ("TERM", "USR1", "USR2", "INT", "HUP")
NONFINITE = ("error", "skip")
# "always": every run takes its recipe's embedded-run options beneath its own (the test suite and the benchmarks set
# it: their tiny and random-init models train as the demo does); "auto" (unset): only a run that names no model
DEMO_ENV = "HFPAR_DEMO_OPTIONS"
# list options (TRL / TrainingArguments take them space-separated: `--reward_weights 1 0.5`): either form, joined by ","
LISTS = ("reward_funcs", "reward_weights", "lora_target_modules", "loss_type", "loss_weights", "report_to")
CP_MODES = ("auto", "ring", "ulysses")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # hfpar.parallel.pipeline.SCHEDULES (a test keeps them equal)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # --torch_compile_backend: torch.compile's backends
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # inductor's modes
OPTIMIZERS = (
    "adamw_torch_fused",
    "adamw_torch",
)  # HF TrainingArguments' --optim names; hfpar.backends.optim builds them


class ConfigError(ValueError):
    """Invalid configuration. The message has one line per problem."""


@dataclass
class RecipeArgs:
    # --- model / data -------------------------------------------------------------------------
    model_name_or_path: str = "hfpar-tiny"  # hub id or local dir; "hfpar-tiny" = the embedded tiny Llama
    tokenizer_name_or_path: str | None = None  # defaults to model_name_or_path
    dataset_name: str | None = None  # hub id or local json/jsonl/csv/parquet/txt file or dir; None = embedded
    max_seq_length: int = 128
    packing: bool = False
    padding_free: bool | None = (
        None  # pack each batch's samples into rows (no compute on padding); unset = where it applies, false = padded
    )
    completion_only_loss: bool = True  # SFT: loss on assistant/completion tokens only
    truncation: str = "truncate"  # what to do with samples longer than max_seq_length: truncate | drop
    eval_split_fraction: float = 0.05  # carved from train when the dataset has no eval split
    attn_implementation: str | None = None  # e.g. sdpa, eager, flash_attention_2
    # run the Python files of a model / tokenizer dir whose config has auto_map (transformers' name); without it such
    # a model is refused
    trust_remote_code: bool = False
    # --- HF TrainingArguments names -------------------------------------------------------------
    output_dir: str = "outputs/run"
    overwrite_output_dir: bool = False
    per_device_train_batch_size: int = 8  # per data-parallel replica
    per_device_eval_batch_size: int = 16
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    # tokens per chunk of the fused LM head + cross-entropy (full logits never exist); unset: auto where checked; 0: off
    loss_chunk_size: int | None = None
    optim: str = (
        "adamw_torch_fused"  # adamw_torch_fused (fused kernel where the device has it, else foreach) | adamw_torch
    )
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # <= 0 disables clipping (the norm is still logged)
    num_train_epochs: float = 1.0
    max_steps: int = -1  # > 0 overrides num_train_epochs
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    logging_steps: int = 10
    eval_steps: int | None = None  # None = evaluate at the end only; 0 disables eval
    save_steps: int | None = None  # None = no intermediate checkpoints
    save_total_limit: int | None = None
    seed: int = 42
    gradient_checkpointing: bool = False
    torch_compile: bool = False  # compile each decoder block with torch.compile (regional, in place)
    torch_compile_backend: str = "inductor"  # inductor | aot_eager | eager (torch.compile's backend)
    torch_compile_mode: str = "default"  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    use_liger_kernel: bool = False  # Liger's RMSNorm / SwiGLU / RoPE kernels in the model's modules (CUDA)
    fp8_recipe: str | None = None  # tensorwise | rowwise under mixed_precision fp8; unset: the accelerate config's
    resume_from_checkpoint: str | None = None  # "latest" or a checkpoint path
    report_to: str = "none"  # trackers via Accelerate's log_with, comma separated
    run_name: str | None = None
    max_eval_samples: int | None = None
    log_comm_bytes: bool = False  # count the bytes each rank sends per step, by collective type (metrics.jsonl "comm")
    # optimizer steps whose batches a background thread reads, collates and copies to the device (pinned, on CUDA)
    # while earlier steps train; 0: loaded in the step (the rows and their order are the same either way)
    dataloader_prefetch_factor: int = 2
    save_final_model: bool = True  # false: skip the final HF-format export (benchmarks, throwaway runs)
    sharded_loading: bool = (
        True  # false: every rank loads the whole checkpoint with from_pretrained (the reference / a fallback)
    )
    # --- hfpar -----------------------------------------------------------------------------------
    tp_size: int = 1
    ep_size: int = 1
    sequence_parallel: bool = False
    cp_size: int = (
        1  # context parallelism: shard every row's sequence over this many ranks (attention exact over the row)
    )
    cp_mode: str = "auto"  # ring | ulysses | auto (ulysses when heads and kv heads divide by cp_size, else ring)
    pp_size: int = 1  # pipeline parallelism: cut the decoder's layers into this many stages (one per rank)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b (each rank holds --pp_virtual_stages chunks of layers)
    pp_virtual_stages: int = 2  # interleaved_1f1b: chunks of layers per rank (virtual stages r, r + pp_size, ..)
    pp_microbatches: int = (
        0  # micro-batches per accumulation step through the pipeline; 0 = 2 x pp_size (capped by the batch)
    )
    pp_split: str = ""  # first layer of each stage, e.g. 0,10,20 (default: balanced by parameter count)
    upcycle_experts: int = 0  # > 0: turn every dense MLP into an MoE of this many copies (then --ep_size works)
    moe_top_k: int = 2  # experts per token for upcycled MoE layers
    moe_aux_loss_coef: float = 0.01  # load-balancing loss coefficient (upcycled layers)
    moe_z_loss_coef: float = 0.0  # router z-loss coefficient (upcycled layers)
    on_nonfinite: str = "error"  # non-finite loss / grad norm: error | skip (the step, on all ranks)
    dist_timeout_s: int = 1800  # process-group timeout (hangs end with a clear message)
    # preemption: on these signals every rank saves a checkpoint at the next step boundary and exits with code 75
    # (SLURM / Kubernetes send SIGTERM before the kill; scripts/slurm asks for SIGUSR1 ahead of the time limit)
    preempt_signals: str = "TERM,USR1"  # comma-separated signal names without SIG; "" leaves the signals alone
    # --- LoRA via PEFT (TRL's names) -------------------------------------------------------------
    use_peft: bool = False  # train LoRA adapters (pip install peft) instead of all weights
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scale = lora_alpha / lora_r)
    lora_dropout: float = 0.05  # dropout on the LoRA input (0 for exact parity between strategies)
    lora_target_modules: str = (
        "all-linear"  # comma-separated module names, or all-linear (every linear but the output head)
    )
    merge_adapter: bool = False  # final export: the merged full model instead of the adapter

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_name_or_path or self.model_name_or_path


def _parse_bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _coerce(name: str, typ: Any, value: Any) -> Any:
    """Convert a YAML/CLI value to the field's type; raise ValueError with a readable reason."""
    text = typ if isinstance(typ, str) else repr(typ)
    optional = "None" in text
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError("must not be empty")
    if "bool" in text:
        return value if isinstance(value, bool) else _parse_bool(value)
    if "int" in text:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
    if "float" in text:
        return float(value)
    return str(value)


def _fields(args_class: type = RecipeArgs) -> dict[str, Any]:
    hints = get_type_hints(args_class)
    return {f.name: hints[f.name] for f in dataclasses.fields(args_class)}


def _field_help(args_class: type = RecipeArgs) -> dict[str, str]:
    """Help text for --help, taken from the comment after each field in RecipeArgs and a recipe's subclass of it
    (one source of truth)."""
    out = {}
    for cls in reversed(args_class.__mro__):
        if not dataclasses.is_dataclass(cls) or cls is object:
            continue
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): [^=]+= ([^#]+?)\s*(?:#\s*(.*))?$", line)
            if m:
                out[m.group(1)] = (m.group(3) or "") + f" (default: {m.group(2).strip()})"
    return out


def _build_parser(
    recipe: str, args_class: type = RecipeArgs, defaults: dict | None = None, demo: dict | None = None
) -> argparse.ArgumentParser:
    shown = ", ".join(f"--{k} {v}" for k, v in (demo or {}).items())
    p = argparse.ArgumentParser(
        prog=f"recipes/{recipe}.py",
        description=f"hfpar {recipe} recipe. Options use HF TrainingArguments names; "
        "launch with `accelerate launch --config_file accelerate_configs/<strategy>.yaml`.",
        epilog=f"With no --model_name_or_path (the embedded demo run) these apply too: {shown}." if shown else None,
        allow_abbrev=False,
    )
    p.add_argument("--config", help="YAML file with the same keys as the flags (flags override it)")
    helps = _field_help(args_class)
    for key, val in (defaults or {}).items():  # the recipe's own defaults, shown as the ones a run uses
        if key in helps:
            helps[key] = re.sub(r"\(default: .*\)$", f"(default: {val!r})", helps[key])
    for f in dataclasses.fields(args_class):
        # every option takes a value as text; booleans may also be given bare (`--packing`)
        is_bool = "bool" in str(f.type)
        p.add_argument(
            f"--{f.name}",
            nargs="?" if is_bool else ("+" if f.name in LISTS else None),
            const="true" if is_bool else None,
            default=None,
            metavar="BOOL" if is_bool else "VALUE",
            help=helps.get(f.name, "").strip(),
        )
    return p


def parse_args(
    argv: list[str] | None = None,
    *,
    recipe: str = "sft",
    defaults: dict | None = None,
    args_class: type = RecipeArgs,
    demo: dict | None = None,
    embedded: tuple = (),
) -> RecipeArgs:
    """Parse CLI + YAML into args_class (RecipeArgs, or a recipe's subclass with its own options: Recipe.args_class);
    raise ConfigError listing every problem. defaults: the recipe's own (every run); demo: the embedded run's
    options, applied only when no model is named (module docstring); embedded: model names that are the embedded
    run's own (hfpar-tiny, hfpar-tiny-vlm: naming one is still the demo)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser(recipe, args_class, defaults, demo)
    problems: list[str] = []
    known = _fields(args_class)
    # Unknown / misspelled flags: report them all with a suggestion instead of argparse's first-only exit.
    for tok in argv:
        if tok.startswith("--"):
            key = tok[2:].split("=", 1)[0]
            if key != "config" and key not in known and key not in ("help", "h"):
                hint = difflib.get_close_matches(key, list(known), n=1)
                problems.append(f"unknown option --{key}" + (f" (did you mean --{hint[0]}?)" if hint else ""))
    if problems:
        raise ConfigError("\n".join(problems))
    ns = parser.parse_args(argv)

    values: dict[str, Any] = dict(defaults or {})
    when = os.environ.get(DEMO_ENV, "auto")
    if when not in ("auto", "always"):
        raise ConfigError(f"{DEMO_ENV}={when}: valid values are auto (the default), always")
    named = ns.model_name_or_path not in (None, *embedded) or _config_names_model(ns.config, embedded)
    if not named or when == "always":  # the embedded run: its steps / learning rate / lengths, beneath --config and
        values.update(demo or {})  # the flags (always: the tests' and benchmarks' tiny models run as the demo)
    if ns.config:
        if not os.path.isfile(ns.config):
            raise ConfigError(f"--config {ns.config}: file not found")
        try:
            with open(ns.config) as fh:
                loaded = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {ns.config}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {ns.config}: expected a mapping of option: value, got {type(loaded).__name__}")
        for key, val in loaded.items():
            if key not in known:
                hint = difflib.get_close_matches(str(key), list(known), n=1)
                problems.append(
                    f"unknown key {key!r} in {ns.config}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                )
            else:
                values[key] = val
    for key in known:
        val = getattr(ns, key)
        if val is not None:
            values[key] = ",".join(val) if isinstance(val, list) else val

    kwargs: dict[str, Any] = {}
    for key, val in values.items():
        try:
            kwargs[key] = _coerce(key, known[key], val)
        except (ValueError, TypeError) as exc:
            problems.append(f"--{key} {val!r}: {exc}")
    if problems:
        raise ConfigError("\n".join(problems))
    args = args_class(**kwargs)
    problems += validate(args)
    if problems:
        raise ConfigError("\n".join(problems))
    return args


def _config_names_model(path: str | None, embedded: tuple) -> bool:
    """Whether a --config file names a model not in `embedded` (an unreadable file is refused by parse_args right
    after)."""
    try:
        with open(path) as fh:
            loaded = yaml.safe_load(fh)
    except (OSError, TypeError, yaml.YAMLError):
        return False
    return isinstance(loaded, dict) and loaded.get("model_name_or_path") not in (None, *embedded)


def validate(a: RecipeArgs) -> list[str]:
    """Return every problem with the values themselves (degrees against the world: hfpar.context; compositions:
    hfpar.backends.SUPPORT; both checked by hfpar.preflight)."""
    p = []
    for f in dataclasses.fields(a):  # nan / inf pass every comparison below as False: refused by name first
        v = getattr(a, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            p.append(f"--{f.name} {v}: must be a finite number")
    if p:
        return p
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "max_seq_length",
        "tp_size",
        "ep_size",
        "cp_size",
        "pp_size",
        "logging_steps",
        "dist_timeout_s",
    ):
        if getattr(a, name) <= 0:
            p.append(f"--{name} {getattr(a, name)}: must be a positive integer")
    if not 0 <= a.seed < 2**32:  # numpy's and torch's generators take seeds in [0, 2**32)
        p.append(f"--seed {a.seed}: must be an integer in [0, {2**32 - 1}]")
    if a.max_steps == 0 or a.max_steps < -1:
        p.append(f"--max_steps {a.max_steps}: must be > 0, or -1 to use num_train_epochs")
    if a.max_steps == -1 and a.num_train_epochs <= 0:
        p.append(f"--num_train_epochs {a.num_train_epochs}: must be > 0 when --max_steps is not set")
    if a.learning_rate <= 0:
        p.append(f"--learning_rate {a.learning_rate}: must be > 0")
    if a.weight_decay < 0:
        p.append(f"--weight_decay {a.weight_decay}: must be >= 0")
    if not 0 <= a.warmup_ratio < 1:
        p.append(f"--warmup_ratio {a.warmup_ratio}: must be in [0, 1)")
    if a.warmup_steps < 0:
        p.append(f"--warmup_steps {a.warmup_steps}: must be >= 0")
    if not 0 < a.eval_split_fraction < 1:
        p.append(f"--eval_split_fraction {a.eval_split_fraction}: must be in (0, 1)")
    for name in ("eval_steps", "save_steps", "save_total_limit", "max_eval_samples"):
        v = getattr(a, name)
        if v is not None and v < 0:
            p.append(f"--{name} {v}: must be >= 0")
    if a.save_total_limit == 0:
        p.append("--save_total_limit 0: must be >= 1 (or unset to keep every checkpoint)")
    if a.lr_scheduler_type not in SCHEDULERS:
        p.append(f"--lr_scheduler_type {a.lr_scheduler_type!r}: valid values are {', '.join(SCHEDULERS)}")
    if a.loss_chunk_size is not None and a.loss_chunk_size < 0:
        p.append(f"--loss_chunk_size {a.loss_chunk_size}: must be >= 1 token, 0 (off) or unset (auto)")
    if a.optim not in OPTIMIZERS:
        p.append(f"--optim {a.optim!r}: valid values are {', '.join(OPTIMIZERS)}")
    if a.truncation not in TRUNCATION:
        p.append(f"--truncation {a.truncation!r}: valid values are {', '.join(TRUNCATION)}")
    if a.cp_mode not in CP_MODES:
        p.append(f"--cp_mode {a.cp_mode!r}: valid values are {', '.join(CP_MODES)}")
    if a.pp_schedule not in PP_SCHEDULES:
        p.append(f"--pp_schedule {a.pp_schedule!r}: valid values are {', '.join(PP_SCHEDULES)}")
    if a.pp_schedule == "interleaved_1f1b" and a.pp_virtual_stages < 2:
        p.append(
            f"--pp_virtual_stages {a.pp_virtual_stages}: interleaved_1f1b needs >= 2 chunks per rank "
            "(one is --pp_schedule 1f1b)"
        )
    if a.torch_compile_backend not in COMPILE_BACKENDS:
        p.append(f"--torch_compile_backend {a.torch_compile_backend!r}: valid values are {', '.join(COMPILE_BACKENDS)}")
    if a.torch_compile_mode not in COMPILE_MODES:
        p.append(f"--torch_compile_mode {a.torch_compile_mode!r}: valid values are {', '.join(COMPILE_MODES)}")
    if a.dataloader_prefetch_factor < 0:
        p.append(f"--dataloader_prefetch_factor {a.dataloader_prefetch_factor}: must be >= 0 (0: no prefetch)")
    if a.pp_microbatches < 0:
        p.append(f"--pp_microbatches {a.pp_microbatches}: must be >= 1, or 0 for 2 x --pp_size")
    if a.on_nonfinite not in NONFINITE:
        p.append(f"--on_nonfinite {a.on_nonfinite!r}: valid values are {', '.join(NONFINITE)}")
    for sig in filter(None, (x.strip().upper().removeprefix("SIG") for x in a.preempt_signals.split(","))):
        if sig not in PREEMPT_SIGNALS:
            p.append(f"--preempt_signals {a.preempt_signals!r}: {sig!r} is not one of {', '.join(PREEMPT_SIGNALS)}")
    for tracker in a.report_to.split(","):
        if tracker.strip() not in REPORT_TO:
            p.append(f"--report_to {a.report_to!r}: {tracker.strip()!r} is not one of {', '.join(REPORT_TO)}")
    if a.sequence_parallel and a.tp_size == 1:
        p.append("--sequence_parallel needs --tp_size > 1")
    if a.upcycle_experts < 0 or a.upcycle_experts == 1:
        p.append(f"--upcycle_experts {a.upcycle_experts}: must be 0 (off) or >= 2 experts")
    if a.upcycle_experts and not 1 <= a.moe_top_k <= a.upcycle_experts:
        p.append(f"--moe_top_k {a.moe_top_k}: must be between 1 and --upcycle_experts {a.upcycle_experts}")
    if a.lora_r <= 0:
        p.append(f"--lora_r {a.lora_r}: must be a positive integer")
    if a.lora_alpha <= 0:
        p.append(f"--lora_alpha {a.lora_alpha}: must be a positive integer")
    if not 0 <= a.lora_dropout < 1:
        p.append(f"--lora_dropout {a.lora_dropout}: must be in [0, 1)")
    if not a.lora_target_modules.strip(" ,"):
        p.append(
            f"--lora_target_modules {a.lora_target_modules!r}: give module names (e.g. q_proj,v_proj) or all-linear"
        )
    if a.merge_adapter and not a.use_peft:
        p.append("--merge_adapter needs --use_peft")
    return p


def to_dict(a: RecipeArgs) -> dict[str, Any]:
    return dataclasses.asdict(a)
