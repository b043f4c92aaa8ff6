"""Print one of the README's two Quickstart commands: `python .ci/quickstart.py train|test`.

.ci/run executes the README's test command through this, so the two can never drift apart.
"""

import re
import sys
from pathlib import Path

text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", section, flags=re.S)
commands = [b.strip() for b in blocks]
if len(commands) != 2 or any("\n" in c for c in commands):
    sys.exit("README Quickstart must hold exactly two one-line shell commands")
print(commands[{"train": 0, "test": 1}[sys.argv[1]]])
