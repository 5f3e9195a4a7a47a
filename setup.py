"""Builds kvbm_ext._C: C sources from csrc/ and CUDA sources from cuda/.

Environment:
  CUDA_ARCHS          GPU targets, e.g. "80;90" (default 80;86;89;90, plus PTX
                      for the newest); see parse_cuda_archs for the spellings.
                      Targets the toolkit cannot build are skipped, with the reason.
  CUDA_HOME/CUDA_PATH where to look for nvcc before PATH.
  KVBM_REQUIRE_CUDA=1 fail instead of building without CUDA when nvcc is missing.

A rebuild always reflects the current toolkit and targets: the build records
them (with the compiler flags from the environment) beside the objects, and
recompiles everything when they change; header edits rebuild too.  Objects
live in the tree's build/ whatever command builds (pip's editable and wheel
builds included), so reinstalling an unchanged tree only relinks.

Importing this file (the tests do) defines the helpers and does not build.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The one place the version is written: the metadata, kvbm_ext.__version__ (KVBM_VERSION below) and
# the tests read it from here; CHANGELOG.md's newest release heading must name it (tests/test_build.py).
VERSION = "0.5.0"
ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "80;86;89;90"
# csrc/ holds one folder per layer (docs/internals.md draws them; tests/test_tree.py checks
# that no file includes a header of a layer above its own).  Every csrc/<layer>/*.c is built;
# those of csrc/gpu/ call the CUDA runtime and are built only with nvcc, csrc/gpu/gpu_stub.c
# alone in their place without it.  Headers are included by name ("gpu.h"): every folder is
# on the include path, so names are unique across csrc/.
CUDA_FOLDER = "gpu"
GPU_STUB = "gpu_stub.c"
# Each kind of layout move's header there is read by its kernel file in cuda/ too.
MOVES = "csrc/moves"
# Flags that change the objects without changing a file; part of the recorded build configuration.
FLAG_VARIABLES = ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED")
RECORD_NAME = "kvbm_build_config.json"

# One GPU target: sm_/compute_ prefix optional, "90" or "9.0", an optional a/f suffix (arch- or
# family-specific features), an optional "+PTX" (also embed PTX for it, as in TORCH_CUDA_ARCH_LIST).
ARCH_PATTERN = re.compile(r"(?:sm_|compute_)?(?:(\d{2,3})|(\d{1,2})\.(\d))([af]?)(\+ptx)?", re.IGNORECASE)


def parse_cuda_archs(text):
    """The targets of a CUDA_ARCHS value, e.g. "8.0;9.0a" -> [("80", False), ("90a", False)].

    Entries are separated by ';', ',' or whitespace; each is 90, 9.0, sm_90, compute_90,
    90a, 9.0a, sm_90a or 100f, optionally followed by +PTX.  Each target comes once
    (with PTX if any spelling asked for it), in the order first given.  Raises ValueError
    naming the entry that is none of these."""
    targets = {}
    for entry in re.split(r"[;,\s]+", text.strip()):
        if not entry:
            continue
        match = ARCH_PATTERN.fullmatch(entry)
        if match is None:
            raise ValueError(f"CUDA_ARCHS={text!r}: {entry!r} is not a GPU target; "
                             "write e.g. 90, 9.0, sm_90 or 90a (several separated by ';', ',' or spaces)")
        digits, major, minor, suffix, ptx = match.groups()
        arch = (digits or major + minor) + suffix.lower()
        targets[arch] = targets.get(arch, False) or ptx is not None
    if not targets:
        raise ValueError(f"CUDA_ARCHS={text!r} names no GPU target")
    return list(targets.items())


def arch_number(arch):
    return int(arch.rstrip("af"))


def unsupported_reason(arch, listed, probe):
    """Why this nvcc cannot build `arch`, or None when it can.  `listed`: the compute_NN numbers
    of `nvcc --list-gpu-arch`; probe(arch): nvcc's complaint about -gencode for it, or None
    (needed for the a/f variants, which nvcc does not list)."""
    base = arch.rstrip("af")
    if base not in listed:
        shown = ", ".join(f"compute_{a}" for a in sorted(listed, key=int))
        return f"not among the targets `nvcc --list-gpu-arch` lists ({shown})"
    if arch != base:
        complaint = probe(arch)
        if complaint:
            return f"nvcc rejects it: {complaint}"
    return None


def select_archs(requested, listed, probe):
    """(the buildable targets sorted by number, [(arch, reason)] for the others)."""
    kept, skipped = [], []
    for arch, ptx in requested:
        reason = unsupported_reason(arch, listed, probe)
        if reason is None:
            kept.append((arch, ptx))
        else:
            skipped.append((arch, reason))
    kept.sort(key=lambda target: (arch_number(target[0]), target[0]))
    return kept, skipped


def gencode(kept):
    """(-gencode flags, names as build_info() reports them): machine code for every target,
    PTX for those that asked for it, else for the newest (so newer GPUs can JIT it)."""
    ptx = [arch for arch, wanted in kept if wanted] or [kept[-1][0]]
    flags = [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch, _ in kept]
    flags += [f"-gencode=arch=compute_{arch},code=compute_{arch}" for arch in ptx]
    return flags, [f"sm_{arch}" for arch, _ in kept] + [f"compute_{arch}" for arch in ptx]


def find_nvcc():
    """nvcc from CUDA_HOME, then CUDA_PATH, then PATH; None if absent."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home:
            candidate = Path(home) / "bin" / "nvcc"
            if candidate.is_file():
                return candidate
    found = shutil.which("nvcc")
    return Path(found).resolve() if found else None


def cuda_root(nvcc):
    """The toolkit directory nvcc itself uses (nvcc may be a wrapper script)."""
    dry = subprocess.run([str(nvcc), "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True)
    top = re.search(r"^#\$ TOP=(.*)$", dry.stdout + dry.stderr, re.MULTILINE)
    return Path(top.group(1).strip()).resolve() if top else nvcc.parent.parent


def nvcc_version(nvcc):
    """("13.0", the full release line, e.g. "Cuda compilation tools, release 13.0, V13.0.88")."""
    out = subprocess.run([str(nvcc), "--version"], check=True, capture_output=True, text=True).stdout
    release = re.search(r"^.*release (\d+\.\d+).*$", out, re.MULTILINE)
    return release.group(1), release.group(0).strip()


def nvcc_probe(nvcc):
    """probe(arch) for unsupported_reason: nvcc's error line for a dry run with that target."""
    def probe(arch):
        run = subprocess.run([str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull,
                              f"-gencode=arch=compute_{arch},code=sm_{arch}"], capture_output=True, text=True)
        if run.returncode == 0:
            return None
        lines = [line for line in (run.stderr + run.stdout).splitlines() if line and not line.startswith("#$")]
        return lines[0].strip() if lines else f"exit status {run.returncode}"
    return probe


def cuda_gencode(nvcc, version):
    """-gencode flags and names for CUDA_ARCHS with this nvcc; says why each skipped target is."""
    requested = parse_cuda_archs(os.environ.get("CUDA_ARCHS", DEFAULT_ARCHS))
    listing = subprocess.run([str(nvcc), "--list-gpu-arch"], check=True, capture_output=True, text=True).stdout
    listed = set(re.findall(r"compute_(\d+)\b", listing))
    kept, skipped = select_archs(requested, listed, nvcc_probe(nvcc))
    for arch, reason in skipped:
        print(f"kvbm_ext: skipping sm_{arch}: CUDA {version}'s {nvcc} cannot build it: {reason}", file=sys.stderr)
    if not kept:
        raise RuntimeError(f"none of CUDA_ARCHS={os.environ.get('CUDA_ARCHS', DEFAULT_ARCHS)!r} can be built "
                           f"by {nvcc} (CUDA {version}): see the reasons above")
    return gencode(kept)


def sources_under(folder, *patterns):
    return sorted(str(path.relative_to(ROOT)) for pattern in patterns for path in (ROOT / folder).glob(pattern))


def csrc_folders():
    """The layer folders of csrc/, as paths relative to the tree ("csrc/api", ...)."""
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "csrc").iterdir() if path.is_dir())


def layer_sources():
    """The C files every build compiles: csrc/<layer>/*.c of every folder but csrc/gpu/."""
    return [path for folder in csrc_folders() if folder != f"csrc/{CUDA_FOLDER}"
            for path in sources_under(folder, "*.c")]


def gpu_sources(cuda):
    """csrc/gpu/*.c but gpu_stub.c with CUDA; gpu_stub.c alone without."""
    stub = f"csrc/{CUDA_FOLDER}/{GPU_STUB}"
    return [path for path in sources_under(f"csrc/{CUDA_FOLDER}", "*.c") if path != stub] if cuda else [stub]


class BuildExt(build_ext):
    """Compiles cuda/*.cu with nvcc and links cudart statically, or builds the
    CPU-only variant when there is no nvcc."""

    def build_extensions(self):
        ext = self.extensions[0]
        nvcc = find_nvcc()
        if nvcc is None:
            if os.environ.get("KVBM_REQUIRE_CUDA") == "1":
                raise RuntimeError("KVBM_REQUIRE_CUDA=1 but nvcc was not found (CUDA_HOME, CUDA_PATH, PATH)")
            print("kvbm_ext: nvcc not found: building without CUDA (is_using_stubs() will be True)", file=sys.stderr)
            config = {"nvcc": None}
        else:
            config = cuda_config(nvcc)
        config["flags"] = {name: os.environ.get(name, "") for name in FLAG_VARIABLES}
        self.rebuild_if_changed(config)
        if nvcc is None:
            ext.sources.extend(gpu_sources(cuda=False))
        else:
            self.add_cuda(ext, config)
        super().build_extensions()
        self.record(config)

    def finalize_options(self):
        super().finalize_options()
        # pip's editable and wheel builds compile into a new temporary directory each time:
        # the tree's own build/ keeps the objects, so an unchanged tree relinks instead of
        # recompiling every kernel, whichever command built it last.
        kept = ROOT / "build" / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
        if Path(self.build_temp).resolve().parent != kept.parent.resolve():
            self.build_temp = str(kept)
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1     # the C sources compile side by side

    def record_path(self):
        return Path(self.build_temp) / RECORD_NAME

    def rebuild_if_changed(self, config):
        """Force a full rebuild (CUDA objects, C objects, link) when the configuration the
        objects were last built with differs: another nvcc, other targets, CUDA or not, other
        flags.  File times cannot tell."""
        try:
            built = json.loads(self.record_path().read_text())
        except (OSError, ValueError):
            built = None
        if built != config:
            self.force = True
            if self.compiler is not None:
                self.compiler.force = True

    def record(self, config):
        self.record_path().parent.mkdir(parents=True, exist_ok=True)
        self.record_path().write_text(json.dumps(config, indent=1, sort_keys=True))

    def add_cuda(self, ext, config):
        """Compiles the out-of-date CUDA objects and adds them, the CUDA variant of the GPU
        layer and static cudart to the extension."""
        nvcc, cuda_home = config["nvcc"], Path(config["cuda_home"])
        build_temp = Path(self.build_temp)
        build_temp.mkdir(parents=True, exist_ok=True)
        # A kernel file reads its kind's header, which declares its launch where KVBM_CUDA_VERSION
        # is defined, as for the C files of this build.
        headers = [ROOT / path for path in sources_under("cuda", "*.h", "*.cuh") + sources_under(MOVES, "*.h")]
        version = f'-DKVBM_CUDA_VERSION="{config["version"]}"'
        commands = []
        for source in sorted((ROOT / "cuda").glob("*.cu")):
            obj = build_temp / (source.stem + ".cu.o")
            inputs = [source, *headers, ROOT / "setup.py"]
            if self.force or not obj.exists() or max(p.stat().st_mtime for p in inputs) > obj.stat().st_mtime:
                commands.append([nvcc, "-c", str(source), "-o", str(obj), "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
                                 "-Xcompiler", "-fvisibility=hidden", f"-I{ROOT / 'cuda'}", f"-I{ROOT / MOVES}",
                                 version, *config["gencode"]])
            ext.extra_objects.append(str(obj))
            ext.depends.append(str(obj))
        run_concurrently(commands)
        ext.sources.extend(gpu_sources(cuda=True))
        ext.include_dirs.append(str(cuda_home / "include"))
        lib_dir = cuda_home / "lib64" if (cuda_home / "lib64").is_dir() else cuda_home / "lib"
        ext.library_dirs.append(str(lib_dir))
        # Static cudart: the module imports on machines without a GPU driver.
        ext.libraries.extend(["cudart_static", "dl", "rt", "pthread", "stdc++"])
        ext.define_macros.extend([
            ("KVBM_CUDA_VERSION", f'"{config["version"]}"'),
            ("KVBM_CUDA_ARCHS", '"' + ";".join(config["archs"]) + '"'),
        ])


def run_concurrently(commands):
    """Runs the commands at once (nvcc spends much of its time waiting); raises on the first
    that fails, after all have ended."""
    for cmd in commands:
        print(" ".join(cmd), file=sys.stderr)
    running = [(cmd, subprocess.Popen(cmd)) for cmd in commands]
    failed = [cmd for cmd, process in running if process.wait() != 0]
    if failed:
        raise RuntimeError(f"nvcc failed: {' '.join(failed[0])}")


def cuda_config(nvcc):
    """What a CUDA build depends on beyond its files: nvcc, its release, the targets."""
    version, release = nvcc_version(nvcc)
    if tuple(int(x) for x in version.split(".")) < (12, 1):
        # Small pointer tables travel as 32 KB kernel parameters (CUDA 12.1+).
        raise RuntimeError(f"kvbm_ext needs CUDA 12.1 or newer; {nvcc} is CUDA {version}")
    cuda_home = cuda_root(nvcc)
    flags, names = cuda_gencode(nvcc, version)
    print(f"kvbm_ext: building with CUDA {version} from {cuda_home} for {' '.join(names)}", file=sys.stderr)
    return {"nvcc": str(nvcc), "release": release, "version": version, "cuda_home": str(cuda_home),
            "gencode": flags, "archs": names}


def license_metadata():
    """SPDX license metadata where setuptools knows it (77 and newer: License-Expression),
    the classic License field before.  pyproject.toml leaves `license` dynamic because
    setuptools older than 77 rejects the SPDX string there, and offline builds
    (--no-build-isolation) use whatever setuptools is installed."""
    if int(setuptools.__version__.split(".")[0]) >= 77:
        return {"license_expression": "Apache-2.0", "license_files": ["LICENSE"]}
    return {"license": "Apache-2.0", "license_files": ["LICENSE"]}


if __name__ == "__main__":
    setup(
        version=VERSION,
        ext_modules=[Extension(
            "kvbm_ext._C",
            sources=layer_sources(),  # build_extensions adds csrc/gpu/'s (gpu_sources)
            # Every header, kernel and this file: a change to any of them rebuilds the extension.
            depends=sources_under("csrc", "*/*.h", "*/*.c") + sources_under("cuda", "*") + ["setup.py"],
            include_dirs=[*csrc_folders(), "cuda"],
            define_macros=[("KVBM_VERSION", f'"{VERSION}"')],
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        )],
        cmdclass={"build_ext": BuildExt},
        **license_metadata(),
    )
