"""What hfpar checks of a model / tokenizer / checkpoint directory before transformers reads it: no code runs
from it unless the user passes --trust_remote_code, and its JSON files are bounded and parse, each problem one line.

    problems = source_problems("path/to/model", trust_remote_code=False, option="--model_name_or_path")

A config (or tokenizer_config) with `auto_map` names Python files of the directory (configuration_*.py,
modeling_*.py, tokenization_*.py) that transformers imports, i.e. runs, when trust_remote_code=True; with the
argument unset it asks `Do you wish to run the custom code? [y/N]` on a terminal. hfpar passes the flag
explicitly everywhere it loads (never the prompt) and refuses such a directory without --trust_remote_code, naming
the files. A hub id is not read here (no download before the preflight): transformers refuses its custom code
itself, since trust_remote_code=False is passed.
"""

from __future__ import annotations

from pathlib import Path

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hfpar.loading.contained import escape_problems
from hfpar.loading.json_limits import MAX_CONFIG_BYTES, MAX_JSON_DEPTH, read_json  # noqa: F401  (also this module's API)
from hfpar.loading.json_limits import json_depth as _depth
from hfpar.parallel.language_model import is_nested, text_config

CONFIG_FILES = ("config.json", "tokenizer_config.json", "adapter_config.json")
MAX_TOKENIZER_BYTES = 1 << 30  # tokenizer.json of the largest vocabularies is ~35 MB; 1 GiB bounds the parser's memory


def source_problems(path: str | None, *, trust_remote_code: bool, option: str) -> list[str]:
    """One line per problem of a local model / tokenizer / checkpoint directory (nothing for a hub id)."""
    if not path:
        return []
    root = Path(path).expanduser()
    if not root.is_dir():
        return []
    escapes = escape_problems(path, option=option)  # links / index entries out of the dir: nothing else is read
    if escapes:
        return escapes
    problems = []
    for name in CONFIG_FILES:
        f = root / name
        if not f.is_file():
            continue
        data, problem = read_json(f)
        if problem:
            problems.append(f"{option} {path}: {problem}")
            continue
        if isinstance(data, dict) and data.get("auto_map") and not trust_remote_code:
            code = sorted(p.name for p in root.glob("*.py"))
            problems.append(
                f"{option} {path}: {name} has auto_map (custom code{': ' + ', '.join(code[:4]) if code else ''}),"
                " which transformers would run; hfpar runs no code from a model directory unless you pass "
                "--trust_remote_code (read that code first)"
            )
    tok = root / "tokenizer.json"
    if tok.is_file():
        try:
            size = tok.stat().st_size
            head = tok.open("rb").read(1 << 20).decode("utf-8", errors="replace")
        except OSError as exc:
            problems.append(f"{option} {path}: {tok.name} unreadable ({exc.strerror})")
        else:
            if size > MAX_TOKENIZER_BYTES:
                problems.append(
                    f"{option} {path}: {tok.name} has {size:,} bytes, over the {MAX_TOKENIZER_BYTES:,} "
                    "hfpar reads for a tokenizer"
                )
            elif _depth(head) > MAX_JSON_DEPTH:
                problems.append(
                    f"{option} {path}: {tok.name} is nested deeper than {MAX_JSON_DEPTH} levels, not a "
                    "tokenizer transformers writes"
                )
    return problems


def adapter_problem(path: str | None, *, option: str) -> str | None:
    """Why a model directory holding a PEFT adapter (adapter_config.json) is refused, or None. transformers'
    from_pretrained loads such a directory as a base model plus that adapter, frozen (its adapter is not trainable,
    the base is frozen: hfpar's optimizer would get no parameter), and with no config.json beside it, loads the base
    from the adapter's base_model_name_or_path, a path or hub id outside the directory named. hfpar starts a run from
    a whole model only; what to do instead is said."""
    root = Path(path).expanduser() if path else None
    if root is None or not (root / "adapter_config.json").is_file():
        return None
    if (root / "config.json").is_file():
        return (
            f"{option} {path}: holds a model (config.json) and a PEFT adapter (adapter_config.json), which "
            "transformers would load frozen onto it; hfpar starts from a whole model only: merge the adapter into it "
            "first (peft: PeftModel.from_pretrained(model, dir).merge_and_unload().save_pretrained(new_dir)) and name "
            "new_dir, or move adapter_config.json and adapter_model.* out to train the model alone"
        )
    data, _ = read_json(root / "adapter_config.json")
    base = data.get("base_model_name_or_path") if isinstance(data, dict) else None
    return (
        f"{option} {path}: a PEFT adapter (adapter_config.json) with no config.json; transformers would load its base "
        f"model from {base!r}, outside this directory; hfpar starts from a whole model only: name the base with "
        "--model_name_or_path (with --use_peft for a new adapter), or merge the adapter into it first"
    )


def run_source_problems(args) -> list[str]:
    """The recipe's model and tokenizer directories, the checkpoint it resumes from (its config.json), and its
    dataset directory (no file of it may lead outside it)."""
    trust = bool(getattr(args, "trust_remote_code", False))
    p = source_problems(args.model_name_or_path, trust_remote_code=trust, option="--model_name_or_path")
    if not p and (adapter := adapter_problem(args.model_name_or_path, option="--model_name_or_path")):
        p.append(adapter)
    p += escape_problems(getattr(args, "dataset_name", None), option="--dataset_name", walk=True)
    if args.tokenizer_name_or_path and args.tokenizer_name_or_path != args.model_name_or_path:
        p += source_problems(args.tokenizer_name_or_path, trust_remote_code=trust, option="--tokenizer_name_or_path")
    resume = args.resume_from_checkpoint
    if resume and resume != "latest":
        p += source_problems(resume, trust_remote_code=trust, option="--resume_from_checkpoint")
    return p


def check_sources(args) -> None:
    """run_source_problems as a ConfigError (one line each), before the accelerator exists."""
    problems = run_source_problems(args)
    if problems:
        from hfpar.config import ConfigError  # noqa: PLC0415  (hfpar.cli imports this module for plan, without the recipe stack)

        raise ConfigError("\n".join(problems))


def causal_lm_problem(config) -> str | None:
    """Why hfpar's causal-LM recipes (AutoModelForCausalLM) cannot build this config's model, in one line, or None.
    A multimodal wrapper whose type only AutoModelForImageTextToText builds (LLaVA, Qwen2-VL, SmolVLM) names its
    text model, which does build. A config of custom code (auto_map) is left to transformers."""
    mt = getattr(config, "model_type", None)
    if config is None or mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "auto_map", None):
        return None
    arch = (getattr(config, "architectures", None) or [None])[0]
    named = f"model_type {mt!r}" + (f" ({arch})" if arch else "")
    text = text_config(config).model_type
    alt = f"; its language model alone (model_type {text!r}) does" if is_nested(config) else ""
    return (
        f"{named} has no causal-LM class in transformers (AutoModelForCausalLM), which hfpar's causal-LM recipes "
        f"load{alt}"
    )
