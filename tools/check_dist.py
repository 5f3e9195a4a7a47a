#!/usr/bin/env python3
"""Checks the source distribution: it holds every tracked file that building and testing
need, every file the README links or shows (its image too: the README is the package's
long description), and nothing built; and a wheel built from it installs and imports in a
fresh venv on the oldest and the newest Python 3.10 to 3.13 found here (or the ones named).

  tools/check_dist.py                                # sdist, contents, oldest and newest Python
  tools/check_dist.py --python /usr/bin/python3.11   # these interpreters instead

The sdist and the wheels are built with build isolation (setuptools comes from the
package index: a network is needed) and go to a temporary directory.  The wheel build
honours CUDA_ARCHS like any build.  torch is never installed: nothing here needs it."""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

from readme import relative_links

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORTED = ("3.10", "3.11", "3.12", "3.13")   # requires-python and the classifiers
# Tracked but not shipped: CI configuration, the formatter's settings and measured results (nothing builds or
# tests with them).
NOT_SHIPPED = (".ci/", ".clang-format", ".gitignore", "benchmarks/results/")
BUILT = (".so", ".o", ".pyc", ".pyd")
WHEEL_FILES = ("kvbm_ext/__init__.py", "kvbm_ext/__init__.pyi", "kvbm_ext/py.typed", "kvbm_ext/__main__.py",
               "kvbm_ext/_debug.py", "kvbm_ext/_no_gpu.py", "kvbm_ext/compat/__init__.py", "kvbm_ext/compat/dynamo.py",
               "kvbm_ext/integrations/__init__.py", "kvbm_ext/integrations/transformers.py",
               "kvbm_ext/integrations/vllm.py")
# Run in the fresh venv, from outside the source tree: the installed package, not the checkout.
IMPORT_CHECK = """
import os, sys, sysconfig, kvbm_ext
where = os.path.dirname(kvbm_ext.__file__)
assert where.startswith(sysconfig.get_paths()["purelib"]) or where.startswith(sysconfig.get_paths()["platlib"]), where
print(f"imported {where} on Python {sys.version.split()[0]}: {kvbm_ext.build_info()}")
"""


def readme_link_problems(readme_text, shipped):
    """The README's relative links and images whose file (or folder) the sdist lacks."""
    problems = []
    for target in relative_links(readme_text):
        path = os.path.normpath(target.partition("#")[0]) if target.partition("#")[0] else None
        if path and path not in shipped and not any(member.startswith(path + "/") for member in shipped):
            problems.append(f"README.md links {target}, which the sdist lacks")
    return problems


def sdist_problems(sdist, tracked):
    """What is wrong with the sdist: tracked files it lacks (NOT_SHIPPED aside), files its
    README links that it lacks, built files it holds.  Messages in the order of `tracked`,
    then of the README, then of the archive."""
    with tarfile.open(sdist) as tar:
        members = [name.split("/", 1)[1] for name in tar.getnames() if "/" in name]
        readme = next((m for m in tar.getmembers() if m.name.split("/", 1)[-1] == "README.md" and m.isfile()), None)
        readme_text = tar.extractfile(readme).read().decode() if readme else ""
    shipped = set(members)
    missing = [f"missing from the sdist: {path}" for path in tracked
               if not path.startswith(NOT_SHIPPED) and path not in shipped]
    built = [f"built file in the sdist: {path}" for path in members if path.endswith(BUILT)]
    return missing + readme_link_problems(readme_text, shipped) + built


def run(cmd, **kwargs):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def tracked_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [path for path in out.splitlines() if os.path.exists(os.path.join(ROOT, path))]


def python_version(python):
    out = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def find_pythons():
    """{"3.10": path, ...} for the supported versions found on PATH or under pyenv."""
    found = {}
    pyenv = os.path.join(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")), "versions")
    for minor in SUPPORTED:
        candidates = [shutil.which(f"python{minor}")]
        candidates += sorted(glob.glob(os.path.join(pyenv, f"{minor}.*", "bin", f"python{minor}")), reverse=True)
        for candidate in filter(None, candidates):
            version = python_version(candidate)
            if version and version.startswith(minor + "."):
                found[minor] = candidate
                break
    return found


def build_sdist(out):
    run([sys.executable, "-m", "build", "--sdist", "--outdir", out, ROOT])
    (sdist,) = glob.glob(os.path.join(out, "kvbm_ext-*.tar.gz"))
    return sdist


def check_wheel(python, sdist, work):
    """A venv on `python`: a wheel built from the sdist, installed, imported, self-checked."""
    venv = os.path.join(work, "venv")
    run([python, "-m", "venv", venv])
    bin_dir = os.path.join(venv, "bin")
    wheels = os.path.join(work, "wheels")
    run([os.path.join(bin_dir, "python"), "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, sdist])
    (wheel,) = glob.glob(os.path.join(wheels, "kvbm_ext-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    missing = [name for name in WHEEL_FILES if name not in names]
    if missing or not any(name.startswith("kvbm_ext/_C.") and name.endswith(".so") for name in names):
        sys.exit(f"check_dist: {os.path.basename(wheel)} lacks {missing or 'the extension module'}")
    run([os.path.join(bin_dir, "python"), "-m", "pip", "install", "-q", wheel])
    outside = os.path.join(work, "elsewhere")
    os.makedirs(outside)
    python_in_venv = os.path.join(bin_dir, "python")
    run([python_in_venv, "-c", IMPORT_CHECK], cwd=outside)
    run([python_in_venv, "-m", "kvbm_ext", "--version"], cwd=outside)
    run([python_in_venv, "-m", "kvbm_ext", "--device", "cpu", "--quick"], cwd=outside)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", default=None,
                        help="an interpreter to build and import the wheel with (repeatable; default: the "
                             "oldest and the newest of Python 3.10 to 3.13 found on PATH or under pyenv)")
    args = parser.parse_args()
    started = time.monotonic()
    if args.python:
        pythons = args.python
    else:
        found = find_pythons()
        if not found:
            sys.exit(f"check_dist: no Python {', '.join(SUPPORTED)} found on PATH or under pyenv")
        print("Pythons found: " + ", ".join(f"{minor} ({path})" for minor, path in found.items()))
        versions = sorted(found, key=lambda minor: tuple(map(int, minor.split("."))))
        pythons = list(dict.fromkeys([found[versions[0]], found[versions[-1]]]))
        if len(found) == 1:
            print(f"check_dist: only Python {versions[0]} is here: the wheel is built and imported on it alone")
    with tempfile.TemporaryDirectory(prefix="check_dist-") as work:
        sdist = build_sdist(work)
        problems = sdist_problems(sdist, tracked_files())
        if problems:
            sys.exit("check_dist: " + "\n  ".join([os.path.basename(sdist)] + problems))
        print(f"{os.path.basename(sdist)}: every tracked file that building and testing need, nothing built")
        for i, python in enumerate(pythons):
            print(f"== wheel from the sdist on {python} (Python {python_version(python)})", flush=True)
            check_wheel(python, sdist, os.path.join(work, f"python{i}"))
    print(f"check_dist: ok on {len(pythons)} interpreter(s) in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
