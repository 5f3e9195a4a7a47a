"""Build metadata, documentation, and a from-scratch build without nvcc (stubs)."""

import os
import pydoc
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import kvbm_ext
from support import REPO_ROOT
from support.producers import FakeDeviceArray

PUBLIC_FUNCTIONS = [
    "block_to_universal",
    "universal_to_block",
    "block_to_operational",
    "operational_to_block",
    "universal_to_operational",
    "operational_to_universal",
    "vectorized_copy",
    "memcpy_batch",
    "is_memcpy_batch_available",
    "set_staging",
    "reserve_staging",
    "staging_info",
    "is_using_stubs",
    "build_info",
    "cuda_devices",
    "pinned_empty",
    "unlink_shared",
    "crc32c",
    "plan_reshard",
    "reshard",
]
PUBLIC_TYPES = ["PagedKVCache", "HostBuffer", "Deferred", "EngineLayout", "Resharder", "ReshardHandle", "ReshardStats",
                "ReshardTransfer", "TorchTransport", "Transport"]


def test_all_lists_every_public_function():
    assert sorted(kvbm_ext.__all__) == sorted(PUBLIC_FUNCTIONS + PUBLIC_TYPES + ["__version__"])


# --------------------------------------------------------------------------
# Metadata of the build under test.
# --------------------------------------------------------------------------


def test_build_info_keys_and_types():
    info = kvbm_ext.build_info()
    assert isinstance(info, dict)
    assert set(info) >= {"version", "cuda_version", "cuda_archs", "with_cuda"}
    assert isinstance(info["version"], str)
    assert isinstance(info["with_cuda"], bool)
    assert isinstance(info["cuda_archs"], list)
    assert all(isinstance(a, str) and re.fullmatch(r"(sm|compute)_\d+[a-z]?", a) for a in info["cuda_archs"]), info
    if info["with_cuda"]:
        assert isinstance(info["cuda_version"], str) and re.fullmatch(r"\d+\.\d+", info["cuda_version"]), info
        assert info["cuda_archs"], "a CUDA build should list its architectures"
    else:
        assert info["cuda_version"] is None


def setup_py_version():
    """setup.py's VERSION: the one place the version is written (a release changes it there
    and adds its CHANGELOG.md heading; no test names a version)."""
    with open(os.path.join(REPO_ROOT, "setup.py")) as f:
        return re.search(r'^VERSION = "([^"]+)"$', f.read(), re.M).group(1)


def test_version():
    """The module reports setup.py's version, and CHANGELOG.md's newest release heading,
    `## VERSION (YYYY-MM-DD)` under the `## Unreleased` section, names it."""
    version = setup_py_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert kvbm_ext.__version__ == version, "the built module is older than setup.py: rebuild it"
    assert kvbm_ext.build_info()["version"] == version
    with open(os.path.join(REPO_ROOT, "CHANGELOG.md")) as f:
        headings = re.findall(r"^## (.+)$", f.read(), re.M)
    assert headings[0] == "Unreleased", headings[:2]
    assert re.fullmatch(re.escape(version) + r" \(\d{4}-\d{2}-\d{2}\)", headings[1]), headings[:2]


def test_is_using_stubs_consistent_with_build_info():
    stubs = kvbm_ext.is_using_stubs()
    assert isinstance(stubs, bool)
    assert stubs is (not kvbm_ext.build_info()["with_cuda"])


def test_cuda_devices_is_a_list():
    devices = kvbm_ext.cuda_devices()
    assert isinstance(devices, list)
    assert all(isinstance(d, dict) for d in devices)
    if kvbm_ext.is_using_stubs():
        assert devices == []


def test_cuda_devices_empty_without_gpu():
    """No GPU visible to torch here: with a torch CUDA build that means no device/driver."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    if torch.version.cuda is None and shutil.which("nvidia-smi") and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True
    ).returncode == 0:
        pytest.skip("CPU-only torch on a machine that has a GPU: torch cannot tell")
    assert kvbm_ext.cuda_devices() == []


@pytest.mark.gpu
def test_cuda_devices_match_torch():
    if kvbm_ext.is_using_stubs():
        pytest.skip("stub build: no devices by design")
    devices = kvbm_ext.cuda_devices()
    assert len(devices) == torch.cuda.device_count()
    for i, d in enumerate(devices):
        props = torch.cuda.get_device_properties(i)
        assert d["index"] == i
        assert d["name"] == props.name
        assert isinstance(d["capability"], tuple) and d["capability"] == (props.major, props.minor)
        assert d["total_memory"] == props.total_memory
        assert d["multiprocessors"] == props.multi_processor_count


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_public_functions_have_docstrings(name):
    doc = getattr(kvbm_ext, name).__doc__
    assert doc and len(doc.strip()) > 20, f"{name} lacks a docstring"


@pytest.mark.parametrize("name", ["block_to_universal", "universal_to_block", "block_to_operational",
                                  "operational_to_block", "universal_to_operational", "operational_to_universal"])
def test_help_text_mentions_layouts_and_stream(name):
    text = pydoc.plain(pydoc.render_doc(getattr(kvbm_ext, name)))
    for word in ("NHD", "HND", "stream"):
        assert word in text, f"help({name}) should mention {word!r}"


@pytest.mark.skipif(not kvbm_ext.is_using_stubs(), reason="this build has CUDA")
@pytest.mark.parametrize("direction", ["b2u", "u2b"])
def test_device_array_rejected_by_stub_build_in_process(direction):
    nh, nl, no, nt, hd = 3, 2, 2, 4, 5
    blocks = [[FakeDeviceArray((nt, nh, hd)) for _ in range(nl * no)]]
    universals = [FakeDeviceArray((nh, nl, no, nt, hd))]
    with pytest.raises(RuntimeError, match="built without CUDA"):
        if direction == "b2u":
            kvbm_ext.block_to_universal(blocks, universals, "NHD")
        else:
            kvbm_ext.universal_to_block(universals, blocks, "NHD")


# --------------------------------------------------------------------------
# A build from scratch where nvcc cannot be found.
# --------------------------------------------------------------------------

REQUIRED_PARTS = ["setup.py", "csrc", "cuda", "kvbm_ext"]
OPTIONAL_PARTS = ["pyproject.toml", "README.md", "README.rst", "LICENSE", "MANIFEST.in", "setup.cfg"]

needs_repo_files = pytest.mark.skipif(
    not all(os.path.exists(os.path.join(REPO_ROOT, p)) for p in REQUIRED_PARTS),
    reason="setup.py / csrc / cuda / kvbm_ext not in the repository",
)


def _copy_repo(dest):
    ignore = shutil.ignore_patterns("*.so", "*.pyd", "*.o", "__pycache__", "build", "*.egg-info")
    for part in REQUIRED_PARTS + OPTIONAL_PARTS:
        src = os.path.join(REPO_ROOT, part)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, part), ignore=ignore)
        elif os.path.exists(src):
            shutil.copy2(src, os.path.join(dest, part))
    assert not any(f.endswith(".so") for _, _, files in os.walk(dest) for f in files)


def _env_without_nvcc(tmp_path):
    env = dict(os.environ)
    missing = str(tmp_path / "no-cuda-here")
    env["CUDA_HOME"] = missing
    env["CUDA_PATH"] = missing
    for var in ("CUDACXX", "CUDA_ROOT", "CUDA_TOOLKIT_ROOT_DIR", "NVCC", "KVBM_REQUIRE_CUDA", "PYTHONPATH"):
        env.pop(var, None)
    dirs = [d for d in env.get("PATH", "").split(os.pathsep) if d and not os.path.exists(os.path.join(d, "nvcc"))]
    env["PATH"] = os.pathsep.join(dirs)
    assert shutil.which("nvcc", path=env["PATH"]) is None
    return env


def _build(tmp_path, env):
    return subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )


STUB_CHECK = textwrap.dedent(
    """
    import os, sys
    sys.path.append(sys.argv[1])  # tests/ (for the support package), AFTER the cwd holding the stub build
    import numpy as np
    import kvbm_ext
    from support.asserts import assert_all_bitwise_equal, poison_
    from support.builders import make_case, to_numpy
    from support.producers import FakeDeviceArray
    from support.references import expected_blocks, expected_universals
    import torch

    assert os.path.dirname(os.path.abspath(kvbm_ext.__file__)) == os.path.join(os.getcwd(), "kvbm_ext"), kvbm_ext.__file__
    assert kvbm_ext.is_using_stubs() is True
    assert kvbm_ext.build_info()["with_cuda"] is False
    assert kvbm_ext.cuda_devices() == []

    for layout in ("NHD", "HND"):
        blocks, universals = make_case(3, 2, 2, 3, 4, 5, torch.float16, layout, generator=torch.Generator().manual_seed(7))
        blocks, universals = to_numpy(blocks), to_numpy(universals)
        poison_(universals)
        kvbm_ext.block_to_universal(blocks, universals, layout)
        assert_all_bitwise_equal(universals, expected_universals(blocks, 2, layout))
        poison_(blocks)
        kvbm_ext.universal_to_block(universals, blocks, layout)
        assert_all_bitwise_equal(blocks, expected_blocks(universals, layout))

    for fn in (kvbm_ext.block_to_universal, kvbm_ext.universal_to_block):
        blocks = [[FakeDeviceArray((4, 3, 5)) for _ in range(4)]]
        universals = [FakeDeviceArray((3, 2, 2, 4, 5))]
        args = (blocks, universals) if fn is kvbm_ext.block_to_universal else (universals, blocks)
        try:
            fn(*args, "NHD")
        except RuntimeError as e:
            assert "built without CUDA" in str(e), str(e)
        else:
            raise AssertionError("a device array was accepted by a build without CUDA")
    print("STUB-OK")
    """
)


@pytest.mark.build
@needs_repo_files
def test_stub_build_without_nvcc(tmp_path):
    _copy_repo(tmp_path)
    env = _env_without_nvcc(tmp_path)
    build = _build(tmp_path, env)
    assert build.returncode == 0, f"stub build failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
    check = subprocess.run(
        [sys.executable, "-c", STUB_CHECK, os.path.join(REPO_ROOT, "tests")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert check.returncode == 0 and "STUB-OK" in check.stdout, f"{check.stdout[-4000:]}\n{check.stderr[-4000:]}"


@pytest.mark.build
@needs_repo_files
def test_build_requiring_cuda_fails_without_nvcc(tmp_path):
    _copy_repo(tmp_path)
    env = _env_without_nvcc(tmp_path)
    env["KVBM_REQUIRE_CUDA"] = "1"
    build = _build(tmp_path, env)
    output = build.stdout + build.stderr
    assert build.returncode != 0, f"KVBM_REQUIRE_CUDA=1 without nvcc should fail:\n{output[-4000:]}"
    assert re.search(r"nvcc|CUDA", output), f"the failure should say why (nvcc / CUDA):\n{output[-4000:]}"


# --------------------------------------------------------------------------
# Signatures: inspect.signature on every function, and the stubs agree.
# --------------------------------------------------------------------------

PAGED_METHODS = ["to_universal", "from_universal", "to_operational", "from_operational"]


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS + PUBLIC_TYPES)
def test_every_function_has_a_signature(name):
    import inspect

    signature = inspect.signature(getattr(kvbm_ext, name))
    kinds = [p.kind for p in signature.parameters.values()]
    if name in ("block_to_universal", "universal_to_block", "universal_to_operational", "operational_to_universal",
                "block_to_operational", "operational_to_block"):
        # source and destination are positional-only, the options keyword-only
        assert kinds[:2] == [inspect.Parameter.POSITIONAL_ONLY] * 2, signature
        assert {"backend", "num_ctas", "stream"} <= set(signature.parameters), signature
        assert all(signature.parameters[k].kind == inspect.Parameter.KEYWORD_ONLY for k in ("backend", "num_ctas",
                                                                                           "stream")), signature


@pytest.mark.parametrize("method", PAGED_METHODS)
def test_paged_methods_have_signatures(method):
    import inspect

    signature = inspect.signature(getattr(kvbm_ext.PagedKVCache, method))
    names = list(signature.parameters)
    assert names[0] == "self" and signature.parameters[names[1]].kind == inspect.Parameter.POSITIONAL_ONLY, signature
    assert signature.parameters["stream"].kind == inspect.Parameter.KEYWORD_ONLY, signature


@pytest.mark.slow
def test_stubs_match_the_extension():
    """python -m mypy.stubtest kvbm_ext: the .pyi says exactly what the C side accepts."""
    pytest.importorskip("mypy")
    result = subprocess.run([sys.executable, "-m", "mypy.stubtest", "kvbm_ext", "--mypy-config-file", "pyproject.toml",
                             "--allowlist", "tools/stubtest_allowlist.txt", "--ignore-unused-allowlist"],
                            capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def clang_format_executable():
    """The clang-format of this Python's environment (pip install clang-format), else PATH's."""
    beside = os.path.join(os.path.dirname(sys.executable), "clang-format")
    return beside if os.access(beside, os.X_OK) else shutil.which("clang-format")


def test_c_and_cuda_sources_follow_clang_format():
    """csrc/ (every layer folder) and cuda/ read as .clang-format writes them (CI installs clang-format)."""
    executable = clang_format_executable()
    if executable is None:
        pytest.skip("clang-format is not installed (pip install clang-format)")
    sources = sorted(os.path.relpath(os.path.join(folder, name), REPO_ROOT) for top in ("csrc", "cuda")
                     for folder, _, names in os.walk(os.path.join(REPO_ROOT, top))
                     for name in names if name.endswith((".c", ".h", ".cu", ".cuh")))
    style = os.path.join(REPO_ROOT, ".clang-format")
    assert os.path.isfile(style), f"{style} is missing (clang-format would fall back to its own style)"
    result = subprocess.run([executable, f"--style=file:{style}", "--dry-run", "--Werror", *sources],
                            capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]


# One block of bytes through the buffer protocol (NumPy and torch do not load in an
# interpreter with its own GIL): block -> universal, and a PagedKVCache ("btd", two blocks)
# written from that universal.
SUBINTERPRETER_CODE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    import kvbm_ext

    chunk = memoryview(bytearray(range(8))).cast("B", (2, 1, 4))
    universal = bytearray(8)
    kvbm_ext.block_to_universal([[chunk]], [memoryview(universal).cast("B", (1, 1, 1, 2, 4))])
    assert universal == bytearray(range(8)), universal
    layer = bytearray(16)
    cache = kvbm_ext.PagedKVCache([memoryview(layer).cast("B", (2, 2, 4))], "btd")
    cache.from_universal([memoryview(universal).cast("B", (1, 1, 1, 2, 4))], [1])
    assert layer == bytearray(8) + bytearray(range(8)), layer
    """
)


# Runs SUBINTERPRETER_CODE twice in an isolated subinterpreter, then in the main one.
SUBINTERPRETER_SCRIPT = textwrap.dedent(
    """
    import sys
    from test.support import interpreters

    code = {code!r}
    if sys.version_info >= (3, 13):
        interp = interpreters.create()
        run = interp.exec
    else:
        interp = interpreters.create(isolated=True)
        run = interp.run
    try:
        run(code)
        run(code)  # the module again, in the same interpreter
    finally:
        interp.close()
    exec(code, {{}})
    print("ok")
    """
)


def test_import_loads_no_module_an_isolated_subinterpreter_refuses():
    """CPython 3.12's _datetime cannot load in a subinterpreter with its own GIL (it crashed
    the process once one had tried): importing kvbm_ext must not load it, on any Python."""
    code = f"import sys; sys.path.insert(0, {REPO_ROOT!r}); import kvbm_ext; print(sorted(m for m in sys.modules if 'datetime' in m))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.skipif(sys.version_info < (3, 12), reason="subinterpreters with their own GIL need Python 3.12+")
def test_imports_and_runs_in_a_subinterpreter_with_its_own_gil():
    """The module declares per-interpreter GIL support (Py_mod_multiple_interpreters): an
    isolated subinterpreter imports it and gets a module of its own that works, and the
    main interpreter's module is unaffected.  In a fresh process: once a subinterpreter
    has run, PyGILState_Check() misleads the rest of the process (torch 2.11's autograd
    then refuses to run, "called while holding the GIL", in later tests)."""
    pytest.importorskip("test.support.interpreters")
    script = SUBINTERPRETER_SCRIPT.format(code=SUBINTERPRETER_CODE.format(root=REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
