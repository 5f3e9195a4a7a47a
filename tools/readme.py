#!/usr/bin/env python3
"""The README's runnable parts, taken from README.md itself so that they cannot drift:
the install and test commands (the bash block under "## Install and run") and the
examples (each python block after a line "<!-- example: NAME ... -->"); and the README's
signatures, generated from the stubs (kvbm_ext/__init__.pyi, which stubtest checks
against the built module) into the python block after the line API_MARKER.

  tools/readme.py commands        # the commands, one a line
  tools/readme.py example cpu     # an example's code
  tools/readme.py api             # the signatures, as the README should show them
  tools/readme.py api --write     # ... written into README.md
  tools/readme.py fresh-venv      # the commands, verbatim, in a fresh venv on a copy of this tree

fresh-venv copies the tracked and untracked (not ignored) files to a temporary
directory, makes a venv there, installs torch==2.13.0 first (the CPU build on a
machine without a GPU: never the default CUDA wheels), then runs each command with
bash, in order, and reports the time from the empty venv to the end."""

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
STUBS = os.path.join(ROOT, "kvbm_ext", "__init__.pyi")
API_MARKER = "<!-- api: generated from kvbm_ext/__init__.pyi by tools/readme.py api --write -->"
WIDTH = 100             # a signature longer than this wraps its parameters
# The README's groups of public names, in order; every name of the stubs' __all__ is in one.
API_GROUPS = (
    ("Conversions, every chunk its own array (the list API)",
     ("block_to_universal", "universal_to_block", "block_to_operational", "operational_to_block",
      "universal_to_operational", "operational_to_universal")),
    ("A paged cache, described once: blocks moved by id", ("PagedKVCache", "Deferred")),
    ("Pinned host pools (docs/host_pools.md)", ("pinned_empty", "HostBuffer", "unlink_shared")),
    ("Device staging memory of the copy-engine path", ("set_staging", "reserve_staging", "staging_info")),
    ("Raw batched copies: address lists, sizes in bytes", ("vectorized_copy", "memcpy_batch",
                                                          "is_memcpy_batch_available")),
    ("The build and the devices", ("build_info", "cuda_devices", "is_using_stubs", "__version__")),
    ("Checksums of host bytes", ("crc32c",)),
    ("Resharding between engines (docs/resharding.md)",
     ("EngineLayout", "plan_reshard", "Resharder", "reshard", "ReshardStats", "ReshardHandle", "ReshardTransfer",
      "Transport", "TorchTransport")),
)
# How the README names an instance of a class whose methods it lists.
# (Classes the library returns keep their own name.)
INSTANCE = {"PagedKVCache": "cache", "Resharder": "resharder", "EngineLayout": "layout",
            "TorchTransport": "transport", "Transport": "transport", "HostBuffer": "buf", "ReshardHandle": "handle",
            "Deferred": "deferred"}
USER_MADE_DATACLASSES = ("EngineLayout",)
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


def relative_links(text):
    """The relative targets of a markdown text's links and images (code left out), with any
    #anchor: what must travel with the text (the sdist, tools/check_dist.py) and exist
    (tests/test_docs.py)."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", target)]


# ----------------------------------------------------------------------------- the API block

def default_text(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return f'"{node.value}"'
    return ast.unparse(node)


def parameters(args, skip_self):
    """The parameters of an ast.arguments as the README writes them: names, defaults, / and *."""
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    shown = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        if not (skip_self and i == 0):
            shown.append(arg.arg if default is None else f"{arg.arg}={default_text(default)}")
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            shown.append("/")
    if args.kwonlyargs:
        shown.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        if default is None and literal(arg.annotation) is not None:
            shown.append(f"{arg.arg}={literal(arg.annotation)}")     # an overload's required Literal[...]
        else:
            shown.append(arg.arg if default is None else f"{arg.arg}={default_text(default)}")
    return shown


def literal(annotation):
    """The value of a one-value Literal[...] annotation, as written; else None."""
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Literal" \
            and not isinstance(annotation.slice, ast.Tuple):
        return ast.unparse(annotation.slice)
    return None


def returns_text(node, typed_dicts):
    """" -> TYPE" for a function returning something, private TypedDicts shown as dict."""
    if node.returns is None or (isinstance(node.returns, ast.Constant) and node.returns.value is None):
        return ""
    text = ast.unparse(node.returns)
    for name in typed_dicts:
        text = re.sub(rf"\b{name}\b", "dict", text)
    return f" -> {text}"


def call_line(prefix, shown, suffix=""):
    """prefix(shown...)suffix, its parameters wrapped under the opening parenthesis's line
    when longer than WIDTH."""
    line = f"{prefix}({', '.join(shown)}){suffix}"
    if len(line) <= WIDTH:
        return [line]
    lines, current = [f"{prefix}("], "    "
    for i, part in enumerate(shown):
        piece = part + (", " if i < len(shown) - 1 else "")
        if len(current) + len(piece.rstrip()) > WIDTH and current.strip():
            lines.append(current.rstrip())
            current = "    "
        current += piece
    lines.append(current.rstrip())
    lines.append(f"){suffix}")
    return lines


def is_property(node):
    return any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)


def is_deprecated(node):
    """Marked @deprecated(...) in the stubs: an old name, left out of the README."""
    return any(isinstance(d, ast.Call) and ast.unparse(d.func) == "deprecated" for d in node.decorator_list)


def class_lines(node, typed_dicts, listed):
    """A class: how it is made (its __new__ or __init__, or a dataclass's fields) when the
    user makes it, its methods on an instance (those not listed already for an instance of
    that name, in `listed`), then its attributes and properties on one comment line."""
    instance = INSTANCE.get(node.name, node.name)
    overloads = {}      # every signature of a method, its @overload ones in order
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            overloads.setdefault(item.name, []).append(item)
    members = {name: items[-1] for name, items in overloads.items()}
    maker = members.get("__new__") or members.get("__init__")
    lines = []
    if maker is not None:
        lines += call_line(f"{instance} = kvbm_ext.{node.name}", parameters(maker.args, True))
    elif node.name in USER_MADE_DATACLASSES:
        shown = [f.target.id if f.value is None else f"{f.target.id}={default_text(f.value)}"
                 for f in node.body if isinstance(f, ast.AnnAssign)]
        lines += call_line(f"{instance} = kvbm_ext.{node.name}", shown)
    attributes = [item.target.id for item in node.body if isinstance(item, ast.AnnAssign)]
    for name, item in members.items():
        if is_deprecated(item):
            continue
        if is_property(item):
            attributes.append(name)
        elif (name == "__call__" or not name.startswith("_")) and (instance, name) not in listed:
            listed.add((instance, name))
            called = instance if name == "__call__" else f"{instance}.{name}"
            for signature in overloads[name]:
                lines += call_line(called, parameters(signature.args, True), returns_text(signature, typed_dicts))
    if attributes:
        owner = instance if instance != node.name else f"kvbm_ext.{node.name}"
        lines += textwrap.wrap(", ".join(attributes), WIDTH, initial_indent=f"# {owner}: ",
                               subsequent_indent="#     ")
    if any(ast.unparse(base) == "Protocol" for base in node.bases):
        lines.insert(0, f"# a kvbm_ext.{node.name} is any object with these members:")
    elif maker is None and node.name not in USER_MADE_DATACLASSES and instance != node.name:
        lines.insert(0, f"# {instance} is a kvbm_ext.{node.name}, which the library returns:")
    return lines


def api_block(stubs_text):
    """The README's signature block, from the stubs' text."""
    tree = ast.parse(stubs_text)
    exported = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    grouped = [name for _, names in API_GROUPS for name in names]
    if sorted(grouped) != sorted(exported):
        raise ValueError(f"tools/readme.py API_GROUPS and the stubs' __all__ differ: "
                         f"{sorted(set(grouped) ^ set(exported))}")
    typed_dicts = [node.name for node in tree.body if isinstance(node, ast.ClassDef)
                   and any(ast.unparse(base) == "TypedDict" for base in node.bases)]
    defined = {getattr(node, "name", None) or getattr(getattr(node, "target", None), "id", None): node
               for node in tree.body}
    lines, listed = ["import kvbm_ext"], set()
    for title, names in API_GROUPS:
        lines += ["", f"# {title}"]
        for name in names:
            node = defined[name]
            if isinstance(node, ast.FunctionDef):
                lines += call_line(f"kvbm_ext.{name}", parameters(node.args, False), returns_text(node, typed_dicts))
            elif isinstance(node, ast.ClassDef):
                lines += class_lines(node, typed_dicts, listed)
            else:
                lines.append(f"kvbm_ext.{name}  # {ast.unparse(node.annotation)}")
    return "\n".join(lines) + "\n"


API_BLOCK = re.compile(r"^" + re.escape(API_MARKER) + r"\n```python\n(.*?)```", re.DOTALL | re.MULTILINE)


def readme_api_block(text):
    """The python block after API_MARKER in the README's text."""
    match = API_BLOCK.search(text)
    if match is None:
        raise ValueError(f"README.md has no python block after the line {API_MARKER}")
    return match.group(1)


def with_api_block(text, block):
    readme_api_block(text)
    return API_BLOCK.sub(lambda _: f"{API_MARKER}\n```python\n{block}```", text)


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
    elif argv == ["api"]:
        print(api_block(read(STUBS)), end="")
    elif argv == ["api", "--write"]:
        text = with_api_block(read(), api_block(read(STUBS)))    # read before open("w") empties the file
        with open(README, "w") as f:
            f.write(text)
    elif argv == ["fresh-venv"]:
        fresh_venv()
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
