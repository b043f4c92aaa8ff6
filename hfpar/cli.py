"""The `hfpar` command.

    hfpar sft [options]         same as python recipes/sft.py (and clm, classify)
    accelerate launch --config_file accelerate_configs/fsdp2.yaml -m hfpar.cli sft [options]
    hfpar --version
"""

from __future__ import annotations

import sys

RECIPES = ("sft", "clm", "classify")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from hfpar import __version__

        print(f"hfpar {__version__}")
        return
    if not argv or argv[0] not in RECIPES:
        given = repr(argv[0]) if argv else "nothing"
        print(f"hfpar: error: expected a recipe ({', '.join(RECIPES)}), got {given}\n"
              f"usage: hfpar {{{','.join(RECIPES)}}} [options]   (hfpar sft --help lists the options)", file=sys.stderr)
        sys.exit(2)
    from hfpar.recipe import main as run

    run(argv[0], argv[1:])


if __name__ == "__main__":
    main()
