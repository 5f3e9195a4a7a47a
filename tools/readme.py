#!/usr/bin/env python3
"""The README's runnable parts, taken from README.md itself so that they cannot drift:
the install and test commands (the bash block under "## Install and run") and the
examples (each python block after a line "<!-- example: NAME ... -->").

  tools/readme.py commands        # the commands, one a line
  tools/readme.py example cpu     # an example's code
  tools/readme.py fresh-venv      # the commands, verbatim, in a fresh venv on a copy of this tree

fresh-venv copies the tracked and untracked (not ignored) files to a temporary
directory, makes a venv there, installs torch==2.13.0 first (the CPU build on a
machine without a GPU: never the default CUDA wheels), then runs each command with
bash, in order, and reports the time from the empty venv to the end."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TORCH = "torch==2.13.0"
TARGET_S = 180          # fresh venv to passing tests on a CPU machine


def read(path=README):
    with open(path) as f:
        return f.read()


def commands(text):
    """The lines of the first bash block under "## Install and run"."""
    section = text.split("## Install and run", 1)
    if len(section) < 2:
        raise ValueError("README.md has no '## Install and run' section")
    block = re.search(r"```bash\n(.*?)```", section[1], re.DOTALL)
    if block is None:
        raise ValueError("README.md's '## Install and run' section has no ```bash block")
    return [line for line in block.group(1).splitlines() if line.strip()]


def examples(text):
    """{name: code} of the python blocks right after "<!-- example: NAME ... -->" lines."""
    found = {}
    for match in re.finditer(r"^<!-- example: (\w+)[^\n]*-->\n```python\n(.*?)```", text, re.DOTALL | re.MULTILINE):
        found[match.group(1)] = match.group(2)
    return found


def copy_tree(dest):
    """The files of this checkout that git knows or would add (not the ignored builds)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.splitlines()
    for path in listed:
        source = os.path.join(ROOT, path)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(dest, path)), exist_ok=True)
            shutil.copy2(source, os.path.join(dest, path))


def fresh_venv():
    lines = commands(read())
    with tempfile.TemporaryDirectory(prefix="readme-") as work:
        tree, venv = os.path.join(work, "kvbm_ext"), os.path.join(work, "venv")
        copy_tree(tree)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(VIRTUAL_ENV=venv, PATH=os.path.join(venv, "bin") + os.pathsep + env["PATH"])
        steps = [f"pip install {TORCH}"] + lines
        for step in steps:
            print(f"+ {step}", flush=True)
            subprocess.run(["bash", "-euo", "pipefail", "-c", step], cwd=tree, env=env, check=True)
        took = time.monotonic() - started
    print(f"README commands in a fresh venv: passed in {took:.0f} s (target {TARGET_S} s)")


def main(argv):
    if argv[:1] == ["commands"]:
        print("\n".join(commands(read())))
    elif argv[:1] == ["example"] and len(argv) == 2:
        print(examples(read())[argv[1]], end="")
    elif argv == ["fresh-venv"]:
        fresh_venv()
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
