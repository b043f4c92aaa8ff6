"""The checkpoint preflight: what a resumed checkpoint's own files say about it, before the model loads (every rank).

    problems = checkpoint_problems(path, args, model_config)    # one line each, naming the file

Every file of a checkpoint is untrusted (a copied or shared one): read here as headers and JSON only, never a tensor.
  - files hfpar never writes that a library would unpickle or count (Accelerate's custom_checkpoint_<i>.pkl and
    random_states_<i>.pkl): refused, never read;
  - a DeepSpeed `latest` naming anything but a folder inside the checkpoint (layout.deepspeed_tag);
  - each rank's RNG file holding hfpar's generator state (rank_state.rng_problem): checked by every rank for all
    ranks, so that one bad file stops every rank with the same line instead of one rank's traceback;
  - the checkpoint's config.json against the model's config: a checkpoint of another model (its type, or a field
    that sets a weight's shape) is refused here, not by a size mismatch after the model loaded.
"""

from __future__ import annotations

from pathlib import Path

from hfpar.checkpoint.layout import deepspeed_tag
from hfpar.checkpoint.rank_state import rng_problem
from hfpar.config import ConfigError
from hfpar.loading.json_limits import read_json

# fields of a (text) config that set some weight's shape; compared where both configs have them
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "n_shared_experts",
    "kv_lora_rank",
    "q_lora_rank",
)


def checkpoint_problems(path: Path, args, config) -> list[str]:
    path = Path(path)
    pickles = sorted(p.name for p in path.glob("*.pkl"))
    if pickles:
        return [
            f"checkpoint {path} holds {', '.join(pickles[:4])}: pickle files hfpar never writes (Accelerate would "
            "unpickle or count them); refused, nothing read: remove them, or resume an untouched checkpoint"
        ]
    p = []
    if (path / "latest").exists() or (path / "latest").is_symlink():
        try:
            deepspeed_tag(path)
        except ConfigError as exc:
            p.append(str(exc))
    p += [x for f in sorted(path.glob("rng_state_*.safetensors")) if (x := rng_problem(f))]
    if config is not None and not getattr(args, "upcycle_experts", 0):  # an upcycled run's checkpoint is its MoE
        p += [x for x in [config_problem(path, args, config)] if x]
    return p


def _text(d: dict) -> dict:
    sub = d.get("text_config")
    return sub if isinstance(sub, dict) else d


def config_problem(path: Path, args, config) -> str | None:
    """The checkpoint's config.json against the model's: model_type, then each shape-setting field."""
    f = path / "config.json"
    if not f.is_file():
        return None  # a checkpoint that keeps none (older ones): Accelerate's own shape check stays
    if f.is_symlink():
        return f"{f}: a symlink: not hfpar's config"
    theirs, problem = read_json(f)  # size, nesting and syntax bounded
    if problem:
        return problem
    if not isinstance(theirs, dict):
        return f"{f}: not a JSON object"
    mine = config.to_dict()
    model = args.model_name_or_path
    if theirs.get("model_type") != mine.get("model_type"):
        return (
            f"checkpoint {path} is of another model (model_type {theirs.get('model_type')!r}; --model_name_or_path "
            f"{model} is {mine.get('model_type')!r}): resume a checkpoint of this model"
        )
    a, b = _text(theirs), _text(mine)
    differ = [k for k in SHAPE_FIELDS if a.get(k) is not None and b.get(k) is not None and a[k] != b[k]]
    if differ:
        return (
            f"checkpoint {path} is of another model ({', '.join(f'{k} {a[k]}' for k in differ[:4])}; "
            f"--model_name_or_path {model} has {', '.join(f'{k} {b[k]}' for k in differ[:4])}): resume a checkpoint "
            "of this model"
        )
    return None
