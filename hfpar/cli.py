"""The `hfpar` command.

hfpar RECIPE [options]      same as python recipes/RECIPE.py; RECIPE is one of: {recipes}
accelerate launch --config_file accelerate_configs/fsdp2.yaml -m hfpar.cli sft [options]
hfpar plan --model ID_OR_DIR --num_gpus 8 --gpu_memory_gb 80     memory per GPU of every strategy
hfpar plot RUN_DIR [RUN_DIR ...] -o runs.png                     loss / lr / tokens/s of runs overlaid
hfpar export CHECKPOINT_DIR OUT_DIR [--overwrite]                a checkpoint-<step> as an HF model
hfpar launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py ...   accelerate launch, with the
                                                                 workers' exit code (2 refused, 75 preempted)
hfpar --version
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import hfpar

TOOLS = ("plan", "plot", "export", "launch")


def recipe_names() -> tuple[str, ...]:
    """The recipes `hfpar RECIPE` runs: the modules of hfpar/recipes/, as hfpar.recipes.builtin() lists them.

    Read from the folder without importing the package (hfpar.recipes imports torch: seconds at every CLI start;
    pkgutil imports inspect).
    """
    folder = Path(hfpar.__file__).with_name("recipes")
    found = {p.stem for p in folder.glob("*.py")} | {p.parent.name for p in folder.glob("*/__init__.py")}
    return tuple(sorted(n for n in found if not n.startswith("_") and n.isidentifier()))


def fail(message: str) -> None:
    print(f"hfpar: error: {message}", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        fail(f"{self.prog}: {message}")


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return v

    return parse


def _plan_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hfpar plan",
        description="Memory per GPU of every strategy (DDP, FSDP2, ZeRO-1/2/3, offload, "
        "TP, EP, CP, PP) for a model, from its config only, and the strategy to use with its launch command.",
    )
    p.add_argument("--model", required=True, help="hub id or local directory with config.json (no weights are read)")
    p.add_argument("--num_gpus", required=True, type=_positive(int), help="GPUs per node")
    p.add_argument("--num_nodes", type=_positive(int), default=1, help="nodes (default 1)")
    p.add_argument("--gpu_memory_gb", required=True, type=_positive(float), help="memory of one GPU in GiB, e.g. 80")
    p.add_argument("--seq_len", type=_positive(int), default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--batch_size", type=_positive(int), default=1, help="micro-batch per GPU (default 1)")
    p.add_argument(
        "--mixed_precision",
        choices=("bf16", "no"),
        default="bf16",
        help="bf16: 2+2+12 bytes/param; no (fp32): 4+4+8 (default bf16)",
    )
    p.add_argument("--lora", action="store_true", help="estimate a LoRA run (adapters on every linear layer)")
    p.add_argument("--lora_rank", type=_positive(int), default=16, help="LoRA rank with --lora (default 16)")
    p.add_argument("--tp_size", type=_positive(int), default=None, help="consider only this TP degree")
    p.add_argument("--ep_size", type=_positive(int), default=None, help="consider only this EP degree (MoE)")
    p.add_argument(
        "--cp_size",
        type=_positive(int),
        default=None,
        help="consider only this context-parallel degree (long sequences)",
    )
    p.add_argument(
        "--attn_implementation",
        choices=("sdpa", "eager"),
        default="sdpa",
        help="eager stores the s x s attention scores (default sdpa)",
    )
    p.add_argument(
        "--loss_chunk_size",
        type=int,
        default=None,
        help="the recipe's option: tokens per chunk of the fused LM head + cross-entropy; unset = auto "
        "where the recipe applies it, 0 = off (full fp32 logits)",
    )
    p.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="run the Python code a model's config names (auto_map), local or hub (default: never; a known "
        "model_type is planned with transformers' own class, an unknown one refused)",
    )
    return p


def load_config(model: str, trust_remote_code: bool = False):
    """A transformers config from a local directory (offline) or a hub id; one-line error otherwise. No code of
    the directory runs without trust_remote_code (hfpar.loading.sources)."""
    from transformers import AutoConfig  # noqa: PLC0415  (plan only; see main)

    from hfpar.loading.sources import source_problems  # noqa: PLC0415

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            fail(f"--model {model}: directory has no config.json")
        problems = source_problems(str(path), trust_remote_code=trust_remote_code, option="--model")
        if problems:
            fail(problems[0])
        try:
            return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - an unknown model_type, a bad value: the user's file, one line
            fail(
                f"--model {model}: cannot load its config "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            )
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1 or os.sep in model.replace("/", ""):
        fail(f"--model {model}: no such model directory (give a directory with config.json or a hub id)")
    if not trust_remote_code:  # a hub config whose model only exists as its auto_map code: refused, naming the flag
        from transformers import PretrainedConfig  # noqa: PLC0415

        from hfpar.planner.memory import PlannerError, untrusted_fields  # noqa: PLC0415

        try:
            fields, _ = PretrainedConfig.get_config_dict(model)  # config.json only: no code is fetched or run
        except Exception:  # noqa: BLE001 - AutoConfig below says why in one line
            fields = {}
        try:
            untrusted_fields(fields)
        except PlannerError as e:
            fail(f"--model {model}: {e}")
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as e:  # network, unknown id, gated repo: one line with the cause
        fail(
            f"--model {model}: cannot load its config ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        )


def plan_main(argv: list[str]) -> None:
    from hfpar.planner.table import PlannerError, memory_table  # noqa: PLC0415  (subcommands import on use: see main)

    a = _plan_parser().parse_args(argv)
    config = load_config(a.model, a.trust_remote_code)
    try:
        text, _ = memory_table(
            config,
            a.model,
            num_gpus=a.num_gpus,
            gpu_memory_gb=a.gpu_memory_gb,
            num_nodes=a.num_nodes,
            seq_len=a.seq_len,
            batch_size=a.batch_size,
            mixed_precision=a.mixed_precision,
            lora_rank=a.lora_rank if a.lora else 0,
            tp_size=a.tp_size,
            ep_size=a.ep_size,
            attn_implementation=a.attn_implementation,
            cp_size=a.cp_size,
            loss_chunk_size=a.loss_chunk_size,
            trust_remote_code=a.trust_remote_code,
        )
    except PlannerError as e:
        fail(str(e))
    except ValueError as e:  # transformers cannot build the config's model (e.g. custom code without a causal LM class)
        fail(f"--model {a.model}: cannot be planned ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    print(text)


def plot_main(argv: list[str]) -> None:
    p = _Parser(
        prog="hfpar plot",
        description="Loss (train and eval), lr and tokens/s of one or more runs overlaid "
        "in one PNG (2x2 plots), labelled by run directory and strategy.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="--output_dir of a run (holds metrics.jsonl)")
    p.add_argument("-o", "--output", default="runs.png", help="PNG to write (default runs.png)")
    a = p.parse_args(argv)
    from hfpar.observe.plot import PlotError, plot_runs  # noqa: PLC0415  (subcommands import on use: see main)

    try:
        print(plot_runs(a.run_dirs, a.output))
    except PlotError as e:
        fail(str(e))


def export_main(argv: list[str]) -> None:
    p = _Parser(
        prog="hfpar export",
        description="Turn a training checkpoint (checkpoint-<step>/ of a DDP, FSDP2 or "
        "ZeRO run) into a Hugging Face model directory that from_pretrained loads.",
    )
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="a checkpoint-<step> directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where to write config.json, model.safetensors, tokenizer")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into OUT_DIR even if it is not empty (files of the same names are replaced)",
    )
    p.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="a config with auto_map: run (and copy) its code (default: refused)",
    )
    a = p.parse_args(argv)
    from hfpar.checkpoint.export import ExportError, export_checkpoint  # noqa: PLC0415  (subcommands import on use: see main)

    ckpt = Path(a.checkpoint_dir).expanduser()
    for name, what in (("config.json", "the config"), ("tokenizer_config.json", "the tokenizer")):
        # export falls back to the run's output dir (the checkpoint's parent) for these: reading outside the
        # directory named is said (its files are checked as the checkpoint's are: no link out, no code)
        if ckpt.is_dir() and not (ckpt / name).is_file() and (ckpt.parent / name).is_file():
            print(f"[hfpar] {ckpt} has no {name}: {what} is read from {ckpt.parent} (the run's output dir)")

    try:
        print(
            export_checkpoint(a.checkpoint_dir, a.out_dir, overwrite=a.overwrite, trust_remote_code=a.trust_remote_code)
        )
    except ExportError as e:
        fail(str(e))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"hfpar {hfpar.__version__}")
        return
    if argv[:1] in (["--help"], ["-h"]):
        print(__doc__.strip().replace("{recipes}", ", ".join(recipe_names())))
        return
    if argv[:1] == ["launch"]:
        from hfpar.launch import main as launch  # noqa: PLC0415  (on use, as the other subcommands)

        launch(argv[1:])
        return
    if argv[:1] and argv[0] in TOOLS:
        {"plan": plan_main, "plot": plot_main, "export": export_main}[argv[0]](argv[1:])
        return
    recipes = recipe_names()
    if not argv or argv[0] not in recipes:
        given = repr(argv[0]) if argv else "nothing"
        print(
            f"hfpar: error: expected a recipe ({', '.join(recipes)}), got {given} (or a tool: {', '.join(TOOLS)})\n"
            f"usage: hfpar {{{','.join(recipes + TOOLS)}}} [options]   (hfpar sft --help lists the options)",
            file=sys.stderr,
        )
        sys.exit(2)
    # each subcommand imports its own stack on use: the recipe stack (torch, transformers, accelerate) takes
    # ~4.5 s (python -c "import hfpar.recipe"), which `hfpar plot` / `hfpar --version` do not need
    from hfpar.recipe import main as run  # noqa: PLC0415

    gc.freeze()  # as recipes/sft.py: the imported stack is never garbage; the collector stops walking it
    run(argv[0], argv[1:])


if __name__ == "__main__":
    main()
