"""LoRA fine-tuning through PEFT: apply adapters before the data-parallel wrap, export after training.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 recipes/sft.py \
        --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear [--merge_adapter]

    from hfpar.loading.lora import apply_lora
    model = apply_lora(model, args, task="lm")     # PeftModel; only LoRA (and a classifier head) trainable

Options carry TRL's names (--use_peft, --lora_r, --lora_alpha, --lora_dropout, --lora_target_modules).
The LoRA init is drawn right after `torch.manual_seed(args.seed)`, so it is the same on every rank and
in a single-process run; on a meta skeleton (hfpar.loading.sharded: base weights read later, this rank's part only) the
adapters are drawn on CPU exactly as on a loaded model (PEFT's moves to the base layer's meta device are skipped).
The final export (hfpar/checkpoint/final_model.py, with full_peft_model / merged_state_model from here) works
under every data-parallel strategy: it gathers the full state dict (collective; FSDP2 / ZeRO-3 shards included)
and, on the main process, writes either the adapter (adapter_config.json + adapter_model.safetensors,
`PeftModel.from_pretrained`)
or, with --merge_adapter, the merged model as a plain HF checkpoint (`from_pretrained`).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from hfpar.distributed import swapped
from hfpar.loading.lora_targets import resolve_lora_config, saved_whole
from hfpar.parallel.sharding import shard_spec
from hfpar.parallel.tensor_parallel.lora import TPLoraRefusal, get_tp_peft_model

ADAPTER = "default"


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def target_modules(spec: str) -> str | list[str]:
    """'all-linear' (PEFT's own value) or a comma-separated list of module names."""
    spec = spec.strip()
    return spec if spec == "all-linear" else [m.strip() for m in spec.split(",") if m.strip()]


def lora_config(args, task: str):
    """The LoraConfig of a recipe: CAUSAL_LM for sft / clm, SEQ_CLS for classify (head saved whole)."""
    # peft is imported on use: an optional extra, and importing it costs ~2.8 s per process (measured)
    from peft import LoraConfig, TaskType  # noqa: PLC0415

    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=target_modules(args.lora_target_modules),
        task_type=TaskType.CAUSAL_LM if task == "lm" else TaskType.SEQ_CLS,
    )


def lora_targets(model: torch.nn.Module, args, task: str):
    """The recipe's LoraConfig, its targets resolved on `model` as PEFT's get_peft_model resolves them ("all-linear":
    the model's Linear layers, the output head left out; on a MoE model, also the experts' and routers' weights).
    Called on the model BEFORE tensor parallelism: its parallel layers are no nn.Linear to PEFT."""
    try:
        return resolve_lora_config(lora_config(args, task), model)
    except ValueError as exc:  # e.g. Mixtral's w1 named without w3 (fused into one expert weight)
        raise _targets_error(args, exc) from None


def apply_lora(model: torch.nn.Module, args, task: str, tp_targets=None) -> torch.nn.Module:
    """Wrap `model` with LoRA adapters; raises ValueError (one line) when no module matches the targets.
    tp_targets (lora_targets of the model before TP: a resolved LoraConfig): `model` is tensor-parallel; its parallel
    layers get hfpar's split adapters (hfpar.parallel.tensor_parallel.lora), drawn as on the unsplit model."""
    from peft import get_peft_model

    config = lora_targets(model, args, task) if tp_targets is None else copy.deepcopy(tp_targets)
    torch.manual_seed(args.seed)  # the same LoRA init on every rank and in the single-process reference
    meta = any(p.is_meta for p in model.parameters())
    try:
        with swapped(torch.nn.Module, "to", _not_to_meta) if meta else contextlib.nullcontext():
            model = get_peft_model(model, config) if tp_targets is None else get_tp_peft_model(model, config)
    except TPLoraRefusal:  # its own line: not about the targets
        raise
    except ValueError as exc:  # e.g. target modules not found in the base model
        raise _targets_error(args, exc) from None
    except TypeError as exc:  # a named target PEFT also saves whole (modules_to_save): a TypeError in PEFT 0.21
        if "modules_to_save" not in str(exc):
            raise
        raise ValueError(
            f"--lora_target_modules {args.lora_target_modules}: names a module PEFT trains whole as part of the "
            f"head ({', '.join(saved_whole(config))}: modules_to_save), which cannot hold LoRA too; leave it out"
        ) from None
    if odd := _not_their_product(model):
        path, cls = odd[0]
        raise ValueError(
            f"--lora_target_modules {args.lora_target_modules}: {path} ({cls}) is an nn.Linear whose forward returns "
            "something other than its product x W^T + b (PEFT would add the adapter to it); name "
            "--lora_target_modules without it"
        )
    return model


def _targets_error(args, exc: ValueError) -> ValueError:
    """PEFT's error about the targets, in one line naming the option."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "ParamWrapper" in first and "lora_dropout" in first:  # PEFT's LoRA on 3-D expert weights (MoE)
        first += f" (the MoE experts' weights): pass --lora_dropout 0 (not {args.lora_dropout}), or name "
        first += "--lora_target_modules outside the experts"
    return ValueError(f"--lora_target_modules {args.lora_target_modules}: {first}")


def _not_their_product(model: torch.nn.Module) -> list[tuple[str, str]]:
    """LoRA layers whose base layer is an nn.Linear subclass with a forward of its own that does not return x W^T + b
    (Llama 4's and PhiMoE's routers return the top-k scores and the logits; DeepSeek-V4's grouped projection splits
    its input): PEFT's LoRA Linear adds B A x to whatever the base layer returns, as if it were W x (and fails there
    with a traceback). Falcon's FalconLinear computes its product its own way and passes."""
    return [
        (path, type(m.base_layer).__name__)
        for path, m in model.named_modules()
        if hasattr(m, "lora_A")
        and isinstance(getattr(m, "base_layer", None), torch.nn.Linear)
        and type(m.base_layer).forward is not torch.nn.Linear.forward
        and not _computes_its_product(m.base_layer)
    ]


def _computes_its_product(layer: torch.nn.Linear) -> bool:
    """Whether the layer's own forward returns x W^T + b: run on random weights of its shapes in float64 (through
    torch.func.functional_call, so a meta skeleton's layer is probed too; nothing of the model is changed)."""
    g = torch.Generator().manual_seed(0)
    params = {
        n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in layer.named_parameters(recurse=False)
    }
    x = torch.randn(3, layer.in_features, generator=g, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = torch.func.functional_call(layer, params, (x,))
    except Exception:  # noqa: BLE001  (a forward that cannot run on its own weights' shapes is not a plain product)
        return False
    want = torch.nn.functional.linear(x, params["weight"], params.get("bias"))
    return isinstance(out, torch.Tensor) and out.shape == want.shape and torch.allclose(out, want, rtol=1e-9, atol=1e-9)


_module_to = torch.nn.Module.to


def _not_to_meta(module: torch.nn.Module, *args, **kwargs) -> torch.nn.Module:
    """nn.Module.to, with a move to the meta device dropped (its dtype kept): PEFT moves each new adapter to its
    base layer's device, which on a meta skeleton would discard the adapter's initial values."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "meta":
        return _module_to(module, dtype=dtype) if dtype is not None else module
    return _module_to(module, *args, **kwargs)


def trainable_summary(model: torch.nn.Module) -> dict:
    """{"trainable_parameters", "all_parameters"} of the whole model (ZeRO-3 placeholders and TP shards counted by
    their full shape, as one process counts them)."""

    def numel(p: torch.nn.Parameter) -> int:
        if hasattr(p, "ds_numel"):
            return p.ds_numel
        spec = shard_spec(p)
        return p.numel() * (spec.size if spec is not None and spec.sharded else 1)

    params = list(model.parameters())
    return {
        "trainable_parameters": sum(numel(p) for p in params if p.requires_grad),
        "all_parameters": sum(numel(p) for p in params),
    }


def _hf_class(model: torch.nn.Module) -> type:
    """The transformers class of a base model (FSDP2 makes subclasses like FSDPLlamaForCausalLM)."""
    return next(c for c in type(model).__mro__ if c.__module__.startswith("transformers"))


def full_peft_model(peft_model: torch.nn.Module, full: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU copy of `peft_model` holding the tensors of `full` (its full state dict, every layer: a pipeline
    stage's PEFT model holds its own layers only). Built on the meta device and filled by assignment, so no
    extra copy of the weights is made."""
    from peft import get_peft_model

    base = peft_model.get_base_model()
    with torch.device("meta"):
        shell = _hf_class(base)(copy.deepcopy(base.config))
        shell = get_peft_model(shell, copy.deepcopy(peft_model.peft_config[ADAPTER]))
    _, unexpected = shell.load_state_dict(full, strict=False, assign=True)
    shell.get_base_model().tie_weights()  # tied embeddings: one tensor again, even if full named it once
    still_meta = [n for n, t in shell.state_dict().items() if t.is_meta]
    if unexpected or still_meta:
        raise RuntimeError(
            f"LoRA export: state dict does not fit the model (unexpected {unexpected[:3]}, missing {still_meta[:3]})"
        )
    return shell


def merged_state_model(peft_model: torch.nn.Module, full: dict[str, torch.Tensor]) -> torch.nn.Module:
    """full_peft_model, merged: W + B @ A * alpha / r in every LoRA layer, trained heads in place (the tensors
    of `full` are merged in place)."""
    with torch.no_grad():
        return full_peft_model(peft_model, full).merge_and_unload()
