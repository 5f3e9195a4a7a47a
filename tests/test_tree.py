"""The shape of csrc/: one folder per layer, each file including only headers of its own
layer or of the layers below it (docs/internals.md draws them), no file over 500 lines,
and setup.py building exactly the files the folders hold.  Reads files; builds nothing."""

import importlib.util
import os
import re

import pytest

from support import REPO_ROOT

CSRC = os.path.join(REPO_ROOT, "csrc")
CUDA = os.path.join(REPO_ROOT, "cuda")

# The layers, top to bottom.  A file may include a header of its own layer or of any layer
# below it, never one above.  Folders of one entry are one layer: csrc/gpu/ (the CUDA
# runtime) and csrc/host/ (host memory and the CPU copies) lean on each other (the pinned
# pool's registration is gpu.h's; the move kinds gpu.h declares are defined in
# host/cpu_copy.c beside their CPU twins).  cuda/'s headers, the kernels' C interface, lie
# below them all.
LAYERS = [
    ("api",),          # the module, its public functions and HostBuffer
    ("paged",),        # PagedKVCache: the type, its construction and calls, to_cache
    ("plan",),         # a call's run: aliasing, the route, the module state
    ("args",),         # reading arguments: arrays, address lists, options, streams, targets
    ("moves",),        # each kind of layout move: its descriptor, kernel side and CPU twin
    ("gpu", "host"),   # where the bytes move
    ("common",),       # arrays, argument paths and errors, protocols, locks, the debug log
]
CUDA_LAYER = len(LAYERS)
RANK = {folder: rank for rank, folders in enumerate(LAYERS) for folder in folders}

# Files over MAX_LINES, with their length when this list was made: splitting one is its own
# change.  None today.
MAX_LINES = 500
KNOWN_LONG = {}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def csrc_files():
    """Every file under csrc/, as paths relative to it ("api/module.c", ...)."""
    found = []
    for folder, _, names in os.walk(CSRC):
        found += [os.path.relpath(os.path.join(folder, name), CSRC) for name in names]
    return sorted(found)


def folder_of(path):
    return path.split(os.sep)[0] if os.sep in path else ""


def headers():
    """Header name -> its layer's rank, for csrc/'s headers and cuda/'s."""
    ranks = {name: CUDA_LAYER for name in os.listdir(CUDA) if name.endswith((".h", ".cuh"))}
    for path in csrc_files():
        if path.endswith(".h"):
            ranks[os.path.basename(path)] = RANK[folder_of(path)]
    return ranks


def read(path):
    with open(os.path.join(CSRC, path), encoding="utf-8") as f:
        return f.read()


def load_setup():
    """setup.py as a module: importing it defines the helpers and builds nothing."""
    spec = importlib.util.spec_from_file_location("kvbm_setup_tree", os.path.join(REPO_ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_file_lies_in_a_layer_folder():
    """No file on csrc/'s own floor, no folder the layers do not name, none nested deeper
    (setup.py looks one level down), only C sources and headers."""
    misplaced = [path for path in csrc_files()
                 if path.count(os.sep) != 1 or folder_of(path) not in RANK or not path.endswith((".c", ".h"))]
    assert misplaced == [], f"not csrc/<layer>/<name>.c or .h with a layer of LAYERS: {misplaced}"
    assert sorted(RANK) == sorted(name for name in os.listdir(CSRC)), "a layer of LAYERS has no folder"


def test_header_names_are_unique():
    """Headers are included by name, every folder on the include path: one name, one file."""
    names = [os.path.basename(path) for path in csrc_files() if path.endswith(".h")]
    cuda = [name for name in os.listdir(CUDA) if name.endswith((".h", ".cuh"))]
    repeated = sorted({name for name in names + cuda if (names + cuda).count(name) > 1})
    assert repeated == []


def include_problems(path, text, ranks):
    """(upward includes, includes of no known header) of csrc/`path` holding `text`."""
    own = RANK[folder_of(path)]
    upward, unknown = [], []
    for name in INCLUDE.findall(text):
        if name not in ranks:
            unknown.append(f"{path}: {name}")
        elif ranks[name] < own:
            upward.append(f"{path} ({'/'.join(LAYERS[own])}) includes {name} ({'/'.join(LAYERS[ranks[name]])})")
    return upward, unknown


def test_no_file_includes_a_header_of_a_layer_above_its_own():
    ranks = headers()
    upward, unknown = [], []
    for path in csrc_files():
        up, missing = include_problems(path, read(path), ranks)
        upward += up
        unknown += missing
    assert unknown == [], f"includes of no header in csrc/ or cuda/: {unknown}"
    assert upward == [], "\n".join(upward)


def test_the_layer_rule_can_fail():
    """An include of api/'s header from plan/ is named; plan/ including args/, gpu/ or cuda/'s
    headers and gpu/ including host/'s are not; a header nowhere is."""
    ranks = headers()
    text = '#include "route.h"\n#include "convert.h"\n#include "target.h"\n#include "gpu.h"\n'
    text += '#include "kvbm_layout.h"\n#include "nowhere.h"\n'
    upward, unknown = include_problems(os.path.join("plan", "x.c"), text, ranks)
    assert upward == ["plan/x.c (plan) includes convert.h (api)"]
    assert unknown == ["plan/x.c: nowhere.h"]
    assert include_problems(os.path.join("gpu", "x.c"), '#include "host_pool.h"\n', ranks) == ([], [])
    assert include_problems(os.path.join("common", "x.h"), '#include "gpu.h"\n', ranks)[0] != []


def unguarded_includes(text, name):
    """The lines of `text` that include `name` outside #ifdef KVBM_CUDA_VERSION (set in CUDA
    builds alone)."""
    guarded, found = [], []
    for number, line in enumerate(text.splitlines(), 1):
        directive = line.strip().replace(" ", "")
        if directive.startswith("#if"):
            guarded.append(directive == "#ifdefKVBM_CUDA_VERSION")
        elif directive.startswith("#else"):
            guarded[-1] = False
        elif directive.startswith("#endif"):
            guarded.pop()
        elif INCLUDE.findall(line) == [name] and not any(guarded):
            found.append(number)
    return found


def test_only_the_gpu_folder_includes_the_cuda_runtime():
    """The CPU-only build compiles every folder but gpu/ (and gpu/gpu_stub.c) without a CUDA
    header in reach: elsewhere the kernels' C ABI (kvbm_kernels.h, which includes the runtime)
    only where KVBM_CUDA_VERSION is defined, as a descriptor's kernel side (csrc/moves/)."""
    cuda_headers = re.compile(r"^\s*#\s*include\s+<(cuda\w*|driver_types|vector_types)\.h>", re.MULTILINE)
    cpu_built = [path for path in csrc_files() if folder_of(path) != "gpu" or path.endswith("gpu_stub.c")]
    assert [path for path in cpu_built if cuda_headers.search(read(path))] == []
    unguarded = {path: unguarded_includes(read(path), "kvbm_kernels.h") for path in cpu_built}
    assert {path: lines for path, lines in unguarded.items() if lines} == {}
    assert unguarded_includes('#include "kvbm_kernels.h"\n', "kvbm_kernels.h") == [1]
    guarded = '#ifdef KVBM_CUDA_VERSION\n#include "kvbm_kernels.h"\n#else\n#include "kvbm_kernels.h"\n#endif\n'
    assert unguarded_includes(guarded, "kvbm_kernels.h") == [4]


def test_kernel_files_read_only_cuda_and_the_kinds_headers():
    """nvcc compiles cuda/*.cu with cuda/ and csrc/moves/ on its include path (setup.py): a
    kernel file reads cuda/'s headers and its kind's header (move_<kind>.h, where its launch
    is declared), and moves/' headers read nothing of csrc/ but moves/ (no Python, no gpu.h),
    so that nvcc and the C compiler read the same declarations."""
    cuda = {name for name in os.listdir(CUDA) if name.endswith((".h", ".cuh"))}
    moves = {name for name in os.listdir(os.path.join(CSRC, "moves")) if name.endswith(".h")}
    kernels = {name: open(os.path.join(CUDA, name), encoding="utf-8").read()
               for name in os.listdir(CUDA) if name.endswith(".cu")}
    kinds = {name: read(os.path.join("moves", name)) for name in moves}
    outside = {name: sorted(set(INCLUDE.findall(text)) - cuda - moves) for name, text in {**kernels, **kinds}.items()}
    assert {name: found for name, found in outside.items() if found} == {}


def test_no_file_is_over_500_lines():
    lengths = {path: read(path).count("\n") for path in csrc_files()}
    long = {path: n for path, n in lengths.items() if n > MAX_LINES and KNOWN_LONG.get(path) != n}
    assert long == {}, f"over {MAX_LINES} lines (split the file, or list it in KNOWN_LONG): {long}"
    stale = sorted(path for path in KNOWN_LONG if lengths.get(path, 0) <= MAX_LINES)
    assert stale == [], f"KNOWN_LONG lists files no longer over {MAX_LINES} lines: {stale}"


def test_setup_builds_the_files_of_the_folders():
    """Every .c under csrc/ is compiled by exactly one variant rule: every build's, the CUDA
    build's (csrc/gpu/) or the CPU-only build's (csrc/gpu/gpu_stub.c alone)."""
    setup_py = load_setup()
    found = sorted(os.path.join("csrc", path).replace(os.sep, "/") for path in csrc_files() if path.endswith(".c"))
    every, cuda, stub = setup_py.layer_sources(), setup_py.gpu_sources(cuda=True), setup_py.gpu_sources(cuda=False)
    assert stub == ["csrc/gpu/gpu_stub.c"]
    assert sorted(every + cuda + stub) == found
    assert len(set(every + cuda + stub)) == len(found)
    assert all(path.startswith("csrc/gpu/") for path in cuda)
    assert not any(path.startswith("csrc/gpu/") for path in every)
    assert setup_py.csrc_folders() == sorted(f"csrc/{folder}" for folder in RANK)


@pytest.mark.parametrize("folder", sorted(RANK))
def test_every_layer_has_sources(folder):
    assert any(name.endswith(".c") for name in os.listdir(os.path.join(CSRC, folder)))
