"""Packaging: CUDA_ARCHS parsing and target selection (setup.py's helpers, no build), a
rebuild that follows the toolkit and the targets, the sdist's contents, the license
metadata with old and new setuptools, the project metadata, and type checkers finding the
package after an editable install.  .ci/run also builds a wheel from the sdist and imports it on the
oldest and newest Python the machine has (tools/check_dist.py)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from support import REPO_ROOT



def load_setup():
    """setup.py as a module: importing it defines the helpers and builds nothing."""
    spec = importlib.util.spec_from_file_location("kvbm_setup", os.path.join(REPO_ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_py = load_setup()
NVCC = setup_py.find_nvcc()
requires_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA_HOME, CUDA_PATH or PATH)")


# --------------------------------------------------------------------------
# CUDA_ARCHS: the spellings, the separators, the reasons a target is skipped.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("90", [("90", False)]),
    ("9.0", [("90", False)]),
    ("sm_90", [("90", False)]),
    ("compute_90", [("90", False)]),
    ("SM_90", [("90", False)]),
    ("90a", [("90a", False)]),
    ("9.0a", [("90a", False)]),
    ("sm_90a", [("90a", False)]),
    ("10.0", [("100", False)]),
    ("12.1", [("121", False)]),
    ("100f", [("100f", False)]),
    ("80;90", [("80", False), ("90", False)]),
    ("80,90", [("80", False), ("90", False)]),
    ("80 90", [("80", False), ("90", False)]),
    (" 8.0, 9.0 ;\tsm_100 ", [("80", False), ("90", False), ("100", False)]),
    ("8.0 9.0+PTX", [("80", False), ("90", True)]),
    ("9.0+ptx", [("90", True)]),
    ("90;9.0;sm_90", [("90", False)]),
    ("90;9.0+PTX", [("90", True)]),
])
def test_cuda_archs_spellings(text, expected):
    assert setup_py.parse_cuda_archs(text) == expected


@pytest.mark.parametrize("text,entry", [
    ("sm_sm_90", "sm_sm_90"),
    ("9", "9"),
    ("90b", "90b"),
    ("80;volta", "volta"),
    ("9.00", "9.00"),
    ("sm90", "sm90"),
])
def test_cuda_archs_rejects_what_is_not_a_target(text, entry):
    with pytest.raises(ValueError, match=re.escape(repr(entry)) + ".*not a GPU target"):
        setup_py.parse_cuda_archs(text)


@pytest.mark.parametrize("text", ["", " ;, "])
def test_cuda_archs_empty(text):
    with pytest.raises(ValueError, match="names no GPU target"):
        setup_py.parse_cuda_archs(text)


LISTED = {"75", "80", "86", "90", "100"}


def fake_probe(arch):
    """nvcc's answer for the a/f variants: 90a and 100f exist, the others not."""
    return None if arch in ("90a", "100f") else f"nvcc fatal   : Unsupported gpu architecture 'compute_{arch}'"


def test_select_archs_keeps_sorts_and_says_why():
    requested = setup_py.parse_cuda_archs("100;9.0a;70;8.0;80a;90;100f")
    kept, skipped = setup_py.select_archs(requested, LISTED, fake_probe)
    assert [arch for arch, _ in kept] == ["80", "90", "90a", "100", "100f"]
    reasons = dict(skipped)
    assert set(reasons) == {"70", "80a"}
    assert "nvcc --list-gpu-arch" in reasons["70"] and "compute_75, compute_80, compute_86, compute_90, compute_100" \
        in reasons["70"], reasons["70"]
    assert reasons["80a"] == "nvcc rejects it: nvcc fatal   : Unsupported gpu architecture 'compute_80a'"


def test_select_archs_suffixed_target_needs_its_base_listed():
    kept, skipped = setup_py.select_archs([("120a", False)], LISTED, fake_probe)
    assert kept == [] and "nvcc --list-gpu-arch" in dict(skipped)["120a"]


def test_gencode_ptx_for_the_newest_unless_asked():
    flags, names = setup_py.gencode([("80", False), ("90", False)])
    assert flags == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                     "-gencode=arch=compute_90,code=compute_90"]
    assert names == ["sm_80", "sm_90", "compute_90"]
    flags, names = setup_py.gencode([("80", True), ("90", False)])
    assert flags[-1] == "-gencode=arch=compute_80,code=compute_80" and names == ["sm_80", "sm_90", "compute_80"]


@requires_nvcc
def test_cuda_archs_with_this_nvcc(monkeypatch, capsys):
    """The real nvcc: every spelling of one target comes out once; a target it lacks is named
    with the list it offers; arch-specific variants go through nvcc itself."""
    version, _ = setup_py.nvcc_version(NVCC)
    monkeypatch.setenv("CUDA_ARCHS", "sm_20;8.0;90;sm_90a;80a")
    flags, names = setup_py.cuda_gencode(NVCC, version)
    assert names == ["sm_80", "sm_90", "sm_90a", "compute_90a"], names
    err = capsys.readouterr().err
    assert re.search(r"skipping sm_20: CUDA \d+\.\d+'s .*nvcc cannot build it: not among the targets "
                     r"`nvcc --list-gpu-arch` lists \(compute_", err), err
    assert re.search(r"skipping sm_80a: .*nvcc rejects it: .*compute_80a", err), err
    monkeypatch.setenv("CUDA_ARCHS", "sm_20")
    with pytest.raises(RuntimeError, match="none of CUDA_ARCHS='sm_20' can be built"):
        setup_py.cuda_gencode(NVCC, version)


# --------------------------------------------------------------------------
# A rebuild reflects the current toolkit and targets.
# --------------------------------------------------------------------------

SOURCE_PARTS = ["setup.py", "pyproject.toml", "README.md", "LICENSE", "csrc", "cuda", "kvbm_ext"]


def copy_sources(dest):
    for part in SOURCE_PARTS:
        src = os.path.join(REPO_ROOT, part)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, part),
                            ignore=shutil.ignore_patterns("*.so", "__pycache__"))
        else:
            shutil.copy2(src, dest)


def build(tree, **env):
    environment = dict(os.environ, **env)
    environment.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=environment,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


def built_archs(tree):
    out = subprocess.run([sys.executable, "-c", "import kvbm_ext; print(kvbm_ext.build_info()['cuda_archs'])"],
                         cwd=tree, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.build
@requires_nvcc
def test_rebuild_follows_cuda_archs_and_nvcc(tmp_path):
    copy_sources(tmp_path)
    build(tmp_path, CUDA_ARCHS="90")
    assert built_archs(tmp_path) == "['sm_90', 'compute_90']"
    # Nothing changed: nothing is compiled again.
    again = build(tmp_path, CUDA_ARCHS="90")
    assert "nvcc" not in again.replace("kvbm_ext: building with", "") and " -c csrc/" not in again, again[-2000:]
    # Other targets, no file touched: everything is rebuilt for them (it used to keep sm_90).
    build(tmp_path, CUDA_ARCHS="8.0")
    assert built_archs(tmp_path) == "['sm_80', 'compute_80']"
    # No nvcc at all: the CPU-only variant replaces the CUDA build.
    no_cuda = str(tmp_path / "no-cuda")
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if not os.path.exists(os.path.join(d, "nvcc")))
    build(tmp_path, CUDA_HOME=no_cuda, CUDA_PATH=no_cuda, PATH=path)
    assert built_archs(tmp_path) == "[]"


@pytest.mark.build
@requires_nvcc
def test_a_second_editable_build_of_an_unchanged_tree_compiles_no_kernel(tmp_path):
    """pip install -e builds in a new temporary directory each time (PEP 660's
    build_editable, called here without installing anything); the objects stay in the
    tree's build/, so the second build runs no nvcc."""
    copy_sources(tmp_path)
    environment = dict(os.environ, CUDA_ARCHS="90")
    environment.pop("PYTHONPATH", None)
    code = "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])"

    def editable():
        run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=tmp_path, env=environment,
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return run.stdout + run.stderr

    assert "nvcc -c" in editable()
    again = editable()
    assert "nvcc -c" not in again and "kvbm_ext: building with CUDA" in again, again[-3000:]


# --------------------------------------------------------------------------
# The sdist holds what building and testing need.
# --------------------------------------------------------------------------

def tracked_files():
    """The files git tracks here (None outside a git checkout, e.g. in an unpacked sdist).
    .git is a file in a linked worktree (git worktree add), a folder elsewhere."""
    if not os.path.exists(os.path.join(REPO_ROOT, ".git")) or shutil.which("git") is None:
        return None
    out = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return [path for path in out.stdout.splitlines() if os.path.exists(os.path.join(REPO_ROOT, path))]


@pytest.mark.build
def test_sdist_holds_what_building_and_testing_need(tmp_path):
    """The sdist from this tree holds every tracked source, test, tool, example and
    benchmark script, and nothing built (tools/check_dist.py says what stays out)."""
    pytest.importorskip("build", reason="the test extra installs build")
    pytest.importorskip("setuptools")
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        import check_dist
    finally:
        sys.path.pop(0)
    tracked = tracked_files()
    if tracked is None:
        pytest.skip("not a git checkout: nothing to compare the sdist with")
    # --no-isolation: the setuptools installed here (offline machines have nothing else).
    run = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
                          "--outdir", str(tmp_path), REPO_ROOT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (sdist,) = tmp_path.glob("kvbm_ext-*.tar.gz")
    problems = check_dist.sdist_problems(str(sdist), tracked)
    assert not problems, "\n".join(problems)


def test_check_dist_notices_a_missing_header_and_a_built_object(tmp_path):
    """The sdist check itself: it names a tracked file that is missing and a build product."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        import check_dist
    finally:
        sys.path.pop(0)
    top = f"kvbm_ext-{setup_py.VERSION}"
    sdist = tmp_path / f"{top}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("setup.py", "csrc/api/module.c", "kvbm_ext/_C.cpython-311-x86_64-linux-gnu.so"):
            path = tmp_path / "x"
            path.write_text("x")
            tar.add(path, arcname=f"{top}/{name}")
    problems = check_dist.sdist_problems(str(sdist), ["setup.py", "csrc/api/module.c", "csrc/plan/state.h",
                                                      "benchmarks/results/x.csv"])
    assert problems == ["missing from the sdist: csrc/plan/state.h",
                        "built file in the sdist: kvbm_ext/_C.cpython-311-x86_64-linux-gnu.so"], problems


# --------------------------------------------------------------------------
# License metadata whatever the setuptools (offline builds use the installed one).
# --------------------------------------------------------------------------

@pytest.mark.parametrize("version,expected", [
    ("68.2.2", {"license": "Apache-2.0", "license_files": ["LICENSE"]}),
    ("76.1.0", {"license": "Apache-2.0", "license_files": ["LICENSE"]}),
    ("77.0.3", {"license_expression": "Apache-2.0", "license_files": ["LICENSE"]}),
    ("84.2.1", {"license_expression": "Apache-2.0", "license_files": ["LICENSE"]}),
])
def test_license_metadata_for_each_setuptools(monkeypatch, version, expected):
    monkeypatch.setattr(setup_py.setuptools, "__version__", version)
    assert setup_py.license_metadata() == expected


def test_project_metadata_names_people_keywords_and_no_url():
    """pyproject.toml names authors, maintainers, keywords and classifiers; no URL (the project
    has no public home: README.md, "More"), no "License ::" classifier (setuptools 77 and newer
    refuse one beside the SPDX expression), and the Python versions check_dist.py builds for."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["authors"] and project["maintainers"] and project["keywords"]
    assert all(person.get("name") for person in project["authors"] + project["maintainers"])
    assert "urls" not in project
    classifiers = project["classifiers"]
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers
    sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
    try:
        import check_dist
    finally:
        sys.path.pop(0)
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert tuple(versions) == check_dist.SUPPORTED
    assert project["requires-python"] == f">={check_dist.SUPPORTED[0]}"


# --------------------------------------------------------------------------
# Type checkers find the package after the README's editable install.
# --------------------------------------------------------------------------

def editable_finder_entries():
    """What `pip install -e .` put into this environment's site-packages for kvbm_ext."""
    import site
    entries = []
    for folder in site.getsitepackages() + [site.getusersitepackages()]:
        if os.path.isdir(folder):
            entries += [os.path.join(folder, name) for name in os.listdir(folder)
                        if name.startswith("__editable__") and "kvbm_ext" in name]
    return entries


def test_editable_install_is_a_path_entry_type_checkers_read():
    """An editable install must be a plain path in a .pth file (mypy and pyright read those),
    not setuptools' import hook (a finder module that only Python runs)."""
    entries = editable_finder_entries()
    if not entries:
        pytest.skip("kvbm_ext is not installed in editable mode here")
    assert not [e for e in entries if e.endswith(".py")], f"an import-hook finder was installed: {entries}"
    (pth,) = [e for e in entries if e.endswith(".pth")]
    with open(pth) as f:
        lines = [line.strip() for line in f if line.strip()]
    # One directory (the checkout installed, not necessarily this copy of it) holding the package.
    assert len(lines) == 1 and os.path.isfile(os.path.join(lines[0], "kvbm_ext", "__init__.pyi")), lines


def test_mypy_finds_the_package_from_outside_the_checkout(tmp_path):
    """mypy, run on a file outside the source tree, resolves kvbm_ext to its stubs."""
    pytest.importorskip("mypy")
    if not editable_finder_entries():
        pytest.skip("kvbm_ext is not installed in editable mode here")
    (tmp_path / "use.py").write_text("import kvbm_ext\n"
                                     "reveal_type(kvbm_ext.PagedKVCache.to_universal)\n"
                                     "kvbm_ext.block_to_universal([], [], layout=3)\n")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("MYPYPATH", None)
    run = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "use.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert "import-not-found" not in out and "Cannot find implementation" not in out, out
    assert re.search(r'use\.py:2: note: Revealed type is "def \((self: )?kvbm_ext\.PagedKVCache', out), out
    # The stubs are in force: a wrong argument type is an error.
    assert re.search(r'use\.py:3: error: Argument "layout" to "block_to_universal" has incompatible type', out), out
