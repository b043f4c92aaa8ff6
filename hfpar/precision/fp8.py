"""FP8 training through torchao's float8: Accelerate's `mixed_precision: fp8` with its torchao (AO) backend.

    accelerate launch --config_file accelerate_configs/fsdp2_fp8.yaml recipes/sft.py [--fp8_recipe rowwise]

    settings = fp8_settings(args)                # None unless the launch asked for fp8 (ACCELERATE_MIXED_PRECISION)
    handler = accelerate_handler(settings)       # Accelerator(kwargs_handlers=[...]) (hfpar.distributed)
    problems = fp8_problems(args, ctx, strategy, device)      # one line each, in the preflight
    info = convert_model(model, settings, blocks)             # hfpar.parallelize: after TP, before the wrap

What runs in fp8: the Linear layers inside the decoder's repeated blocks (q/k/v/o, the MLP's projections), as
torchao's `convert_to_float8_training` swaps them for its Float8Linear; a tensor-parallel layer's local shard through
the same float8 matmul (hfpar.parallel.tensor_parallel.fp8). Not the embeddings, the LM head / score head (outside the
blocks), the MoE routers (`gate` / `router`) or experts (3-D parameters), nor a Linear with a dimension that is not a
multiple of 16 (torchao's module-filter rule: the fp8 GEMM's constraint). The rest computes as under bf16: Accelerate
turns fp8 into bf16 autocast and FSDP2's bf16 parameter policy, and hfpar's bf16 paths follow it unchanged.

Recipes (torchao's `Float8LinearConfig.from_recipe_name`): tensorwise (one scale per tensor; under FSDP2 the weights
are all-gathered in fp8, Accelerate's `fp8_config: enable_fsdp_float8_all_gather`, their scales precomputed after
each optimizer step by Accelerate's hook) and rowwise (one scale per row, powers of two). Chosen by `--fp8_recipe`,
else the accelerate config's `fp8_config: recipe:` (the launcher exports it as ACCELERATE_FP8_RECIPE), else
tensorwise (torchao's default). On CPU the fp8 GEMMs exist only in torchao's emulation: HFPAR_FP8_EMULATE=1 (tests,
debugging) asks for it explicitly; without it a CPU run is refused, as is a GPU below compute capability 8.9.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch
from accelerate.utils import parse_flag_from_env
from torch import nn

RECIPES = ("tensorwise", "rowwise")
EMULATE_ENV = "HFPAR_FP8_EMULATE"
ROUTER_NAMES = frozenset({"gate", "router"})  # MoE routers stay in bf16 (torchtitan's filter_fqns do the same)
INSTALL = "pip install torchao (or pip install 'hfpar[fp8]')"


@dataclasses.dataclass(frozen=True)
class FP8Settings:
    recipe: str  # tensorwise | rowwise (validated by fp8_problems)
    recipe_from: str  # where it came from: --fp8_recipe, the accelerate config's fp8_config, torchao's default
    emulate: bool  # torchao's emulated fp8 GEMMs (HFPAR_FP8_EMULATE=1)
    fsdp_float8_all_gather: bool  # FSDP2 all-gathers the converted weights in fp8 (tensorwise only)
    pad_inner_dim: bool  # torchao pads GEMM dims to multiples of 16 (Accelerate's fp8_config default: true)
    backend: str  # the accelerate config's fp8_config backend (AO, or unset)


def requested() -> bool:
    """Whether the launch asked for fp8: the launcher's ACCELERATE_MIXED_PRECISION. Read from the environment,
    not from the Accelerator: on a GPU below compute capability 8.9 Accelerate replaces fp8 by fp16 (a warning
    only), and hfpar refuses that instead (fp8_problems)."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "fp8"


def fp8_settings(args, all_gather: bool = True) -> FP8Settings | None:
    """The run's fp8 settings (None: not fp8). all_gather: whether the data-parallel wrap all-gathers the converted
    weights (FSDP2 without TP: Strategy.fp8_all_gather); only then does torchao wrap them for it (elsewhere its
    weight subclass would only stand in the way of the checkpoint writers)."""
    if not requested():
        return None
    env_recipe = os.environ.get("ACCELERATE_FP8_RECIPE")
    if args.fp8_recipe:
        recipe, source = args.fp8_recipe, "--fp8_recipe"
    elif env_recipe:
        recipe, source = env_recipe, "the accelerate config's fp8_config: recipe"
    else:
        recipe, source = "tensorwise", "torchao's default"
    all_gather = all_gather and parse_flag_from_env("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", default=True)
    return FP8Settings(
        recipe=recipe,
        recipe_from=source,
        emulate=parse_flag_from_env(EMULATE_ENV, default=False),
        fsdp_float8_all_gather=all_gather and recipe == "tensorwise",  # torchao: tensorwise scales only
        pad_inner_dim=parse_flag_from_env("ACCELERATE_FP8_PAD_INNER_DIM", default=True),
        backend=os.environ.get("ACCELERATE_FP8_BACKEND", "AO").upper(),
    )


def torchao_problem() -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return f"mixed_precision fp8 trains through torchao's float8, which is not installed: {INSTALL}"
    return None


def fp8_problems(args, ctx, strategy, device: torch.device) -> list[str]:
    """The preflight's fp8 checks, one line each: the option values, the hardware, the compositions."""
    s = fp8_settings(args)
    if s is None and args.fp8_recipe:
        need = "needs mixed_precision fp8 (the accelerate config's or the launcher's); drop it"
        return [f"--fp8_recipe {args.fp8_recipe}: {need}"]
    if s is None:
        return []
    p = [x for x in (torchao_problem(),) if x]
    if s.recipe not in RECIPES:
        p.append(f"fp8 recipe {s.recipe!r} (from {s.recipe_from}): valid values are {', '.join(RECIPES)}")
    if s.backend not in ("AO", "NO"):
        p.append(f"fp8_config backend {s.backend}: hfpar trains fp8 through torchao only; set backend: AO")
    if device.type == "cuda" and not s.emulate and torch.cuda.get_device_capability(device) < (8, 9):
        name, cc = torch.cuda.get_device_name(device), ".".join(map(str, torch.cuda.get_device_capability(device)))
        p.append(
            f"mixed_precision fp8 on {name} (compute capability {cc}): fp8 matmuls need 8.9 or higher (Ada, Hopper; "
            "Accelerate would train in fp16 instead); use --mixed_precision bf16"
        )
    elif device.type != "cuda" and not s.emulate:
        p.append(
            f"mixed_precision fp8 on {device.type.upper()}: fp8 matmuls need a CUDA GPU of compute capability 8.9 or "
            f"higher; {EMULATE_ENV}=1 runs torchao's emulation instead (tests, debugging), else use --mixed_precision "
            "bf16"
        )
    unsupported = [f"--{k} {getattr(args, k)}" for k in ("ep_size", "cp_size", "pp_size") if getattr(args, k) > 1]
    unsupported += ["--use_peft"] if args.use_peft else []
    unsupported += [f"{strategy.name} (DeepSpeed)"] if strategy is not None and strategy.deepspeed else []
    for what in unsupported:
        p.append(
            f"mixed_precision fp8 with {what}: not supported (fp8 runs single, DDP, FSDP2 and --tp_size, with or "
            "without FSDP2); use --mixed_precision bf16 for this composition"
        )
    return p


def float8_config(s: FP8Settings):
    """torchao's recipe with the run's switches (emulation; FSDP2's fp8 all-gather; padding)."""
    from torchao.float8 import Float8LinearConfig  # noqa: PLC0415  (an optional dependency; checked before)

    return dataclasses.replace(
        Float8LinearConfig.from_recipe_name(s.recipe),
        emulate=s.emulate,
        enable_fsdp_float8_all_gather=s.fsdp_float8_all_gather,
        pad_inner_dim=s.pad_inner_dim,
    )


def _accelerate_converts_nothing(module: nn.Module, fqn: str) -> bool:  # noqa: ARG001
    return False


def accelerate_handler(s: FP8Settings):
    """Accelerate's AORecipeKwargs for this run. Its prepare() would convert the model itself (skipping the first
    and last Linear: the first decoder projection, not only the LM head) and cannot reach hfpar's TP layers or the
    models hfpar wraps itself, so hfpar converts in parallelize and Accelerate's pass converts nothing; the config
    still tells Accelerate's FSDP2 prepare to register torchao's scale precompute after each optimizer step."""
    from accelerate.utils import AORecipeKwargs  # noqa: PLC0415  (its __post_init__ imports torchao)

    config = float8_config(s) if s.recipe in RECIPES else None  # a bad name: refused by the preflight
    return AORecipeKwargs(config=config, module_filter_func=_accelerate_converts_nothing)


def _linear_eligible(module: nn.Module, fqn: str) -> bool:
    """torchao's module filter for the blocks: a plain Linear (no subclass, e.g. PEFT's), dims multiples of 16, not
    a router."""
    if type(module) is not nn.Linear or ROUTER_NAMES & set(fqn.split(".")):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_model(model: nn.Module, s: FP8Settings, blocks: list[nn.Module]) -> dict:
    """In place: the Linear layers of `blocks` (the decoder's: hfpar.train.compile.repeated_blocks) to torchao's
    Float8Linear, TP layers' local matmuls to fp8. Returns what run_info.json records; ValueError (one line) when no
    layer qualifies. (torchao is imported here, as the preflight and the Accelerator import this module first.)"""
    from torchao.float8 import convert_to_float8_training  # noqa: PLC0415

    # imported on use: hfpar.distributed imports this module at start-up, before the model stack is needed
    from hfpar.parallel.tensor_parallel.fp8 import float8_shard_layers  # noqa: PLC0415

    config = float8_config(s)
    skipped = sorted(
        {
            f"{n} {tuple(m.weight.shape)}"
            for b in blocks
            for n, m in b.named_modules()
            if type(m) is nn.Linear and not _linear_eligible(m, n) and not ROUTER_NAMES & set(n.split("."))
        }
    )
    for block in blocks:
        convert_to_float8_training(block, module_filter_fn=_linear_eligible, config=config)
    n_linear = sum(type(m).__name__ == "Float8Linear" for b in blocks for m in b.modules())
    n_shard, shard_skipped = float8_shard_layers(blocks, config)
    if not n_linear + n_shard:
        raise ValueError(
            f"mixed_precision fp8: no Linear layer of {type(model).__name__}'s decoder blocks can run in fp8 (plain "
            "nn.Linear or hfpar's TP layers with dims multiples of 16); use --mixed_precision bf16"
        )
    return {
        "recipe": s.recipe,
        "recipe_from": s.recipe_from,
        "emulate": s.emulate,
        "fsdp_float8_all_gather": s.fsdp_float8_all_gather,
        "layers": n_linear + n_shard,
        "per_block": (n_linear + n_shard) // max(len(blocks), 1),
        "skipped": skipped + shard_skipped,
    }
