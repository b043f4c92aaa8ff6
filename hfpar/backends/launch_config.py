"""The accelerate YAML a run was launched with: misspelt keys of its deepspeed_config / fsdp_config / fp8_config
refused.

    problems = launch_config_problems()      # [] or one line per unknown key, with a did-you-mean

Accelerate's launcher turns every key of these sections into a launcher attribute and ignores the ones it does not
know: `zero_stag: 3` silently runs ZeRO-2 (the default stage), `fsdp_versoin: 2` falls back to FSDP1, fp8_config's
`recipie: rowwise` trains tensorwise. The known keys are the launcher's own DeepSpeed / FSDP / FP8 arguments
(accelerate.commands.launch's parser), so this list follows the installed Accelerate, plus hfpar's fp8_config `recipe`
(exported by the launcher like any key of the section: ACCELERATE_FP8_RECIPE, read by hfpar.precision.fp8). The YAML is
found on the launcher's command line (`--config_file`, the parent process of every rank under `accelerate launch`),
else Accelerate's default config file; none found: nothing to check.
"""

from __future__ import annotations

import difflib
import os
import shlex
from pathlib import Path

import yaml

SECTIONS = {"deepspeed_config": "DeepSpeed Arguments", "fsdp_config": "FSDP Arguments", "fp8_config": "FP8 Arguments"}
PREFIX = {"fsdp_config": "fsdp_", "fp8_config": "fp8_"}  # Accelerate prefixes these sections' keys when they lack it
HFPAR_KEYS = {"fp8_config": {"fp8_recipe"}}


def known_keys() -> dict[str, set[str]]:
    """{section: the keys Accelerate's launcher reads from it}."""
    from accelerate.commands.launch import launch_command_parser  # noqa: PLC0415  (argparse only; a refusal path)

    groups = {g.title: {a.dest for a in g._group_actions} for g in launch_command_parser()._action_groups}
    return {section: groups.get(title, set()) | HFPAR_KEYS.get(section, set()) for section, title in SECTIONS.items()}


def launcher_config_file(pid: int | None = None) -> Path | None:
    """--config_file of the `accelerate launch` that started this process (Linux /proc; relative to the launcher's
    working dir), else Accelerate's default; None when this process was not started by `accelerate launch`."""
    proc = Path(f"/proc/{pid or os.getppid()}")
    try:
        argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any("accelerate" in a for a in argv[:3]):
        return None
    for i, arg in enumerate(argv):
        if arg.startswith("--config_file"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                return Path(os.readlink(proc / "cwd")) / value  # an absolute value stays itself
            except OSError:
                return Path(value)
    from accelerate.commands.config import default_config_file  # noqa: PLC0415  (as above)

    return Path(default_config_file) if Path(default_config_file).is_file() else None


def config_problems(path: Path) -> list[str]:
    """One line per unknown key of the file's deepspeed_config / fsdp_config."""
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []  # Accelerate's launcher read it already; nothing more to say here
    known, p = known_keys(), []
    for section in SECTIONS:
        for key in (config.get(section) or {}) if isinstance(config, dict) else {}:
            prefix = PREFIX.get(section, "")
            name = key if key.startswith(prefix) else f"{prefix}{key}"
            if name not in known[section]:
                close = difflib.get_close_matches(name, sorted(known[section]), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(known[section]))}"
                p.append(
                    f"accelerate config {shlex.quote(str(path))}: {section}: unknown key {key!r} (Accelerate would "
                    f"ignore it); {hint}"
                )
    return p


def launch_config_problems() -> list[str]:
    path = launcher_config_file()
    return config_problems(path) if path is not None and path.is_file() else []
