"""Builds kvbm_ext._C: C sources from csrc/ and CUDA sources from cuda/.

Environment:
  CUDA_ARCHS          GPU targets, e.g. "80;90" (default 80;86;89;90, plus PTX
                      for the newest); targets the toolkit cannot build are skipped.
  CUDA_HOME/CUDA_PATH where to look for nvcc before PATH.
  KVBM_REQUIRE_CUDA=1 fail instead of building without CUDA when nvcc is missing.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

VERSION = "0.4.0"
ROOT = Path(__file__).parent
DEFAULT_ARCHS = "80;86;89;90"
C_SOURCES = ["address_list.c", "args.c", "array.c", "convert.c", "copy.c", "cpu_copy.c", "debug.c", "module.c", "paged.c",
             "overlap.c", "pieces.c", "stream.c"]


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
    out = subprocess.run([str(nvcc), "--version"], check=True, capture_output=True, text=True).stdout
    return re.search(r"release (\d+\.\d+)", out).group(1)


def gencode_flags(nvcc):
    """-gencode flags for CUDA_ARCHS, machine code for each, PTX for the newest."""
    requested = [a.strip() for a in os.environ.get("CUDA_ARCHS", DEFAULT_ARCHS).replace(",", ";").split(";") if a.strip()]
    listed = subprocess.run([str(nvcc), "--list-gpu-arch"], check=True, capture_output=True, text=True).stdout
    supported = set(re.findall(r"compute_(\d+a?)", listed))
    archs = [a for a in requested if a in supported]
    for skipped in sorted(set(requested) - set(archs)):
        print(f"kvbm_ext: skipping sm_{skipped}: this nvcc cannot build it", file=sys.stderr)
    if not archs:
        raise RuntimeError(f"none of CUDA_ARCHS={requested} can be built by {nvcc}")
    archs.sort(key=lambda a: int(a.rstrip("a")))
    flags, names = [], []
    for arch in archs:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        names.append(f"sm_{arch}")
    newest = archs[-1]
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    names.append(f"compute_{newest}")
    return flags, names


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
            ext.sources.append("csrc/gpu_stub.c")
        else:
            self.add_cuda(ext, nvcc)
        super().build_extensions()

    def add_cuda(self, ext, nvcc):
        cuda_home = cuda_root(nvcc)
        flags, names = gencode_flags(nvcc)
        version = nvcc_version(nvcc)
        if tuple(int(x) for x in version.split(".")) < (12, 1):
            # Small pointer tables travel as 32 KB kernel parameters (CUDA 12.1+).
            raise RuntimeError(f"kvbm_ext needs CUDA 12.1 or newer; {nvcc} is CUDA {version}")
        print(f"kvbm_ext: building with CUDA {version} from {cuda_home} for {' '.join(names)}", file=sys.stderr)
        build_temp = Path(self.build_temp)
        build_temp.mkdir(parents=True, exist_ok=True)
        for source in sorted((ROOT / "cuda").glob("*.cu")):
            obj = build_temp / (source.stem + ".cu.o")
            cmd = [str(nvcc), "-c", str(source), "-o", str(obj), "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
                   "-Xcompiler", "-fvisibility=hidden", f"-I{ROOT / 'cuda'}", *flags]
            print(" ".join(cmd), file=sys.stderr)
            subprocess.run(cmd, check=True)
            ext.extra_objects.append(str(obj))
        ext.sources.extend(["csrc/gpu.c", "csrc/moves.c", "csrc/staging.c"])
        ext.include_dirs.append(str(cuda_home / "include"))
        lib_dir = cuda_home / "lib64" if (cuda_home / "lib64").is_dir() else cuda_home / "lib"
        ext.library_dirs.append(str(lib_dir))
        # Static cudart: the module imports on machines without a GPU driver.
        ext.libraries.extend(["cudart_static", "dl", "rt", "pthread", "stdc++"])
        ext.define_macros.extend([
            ("KVBM_CUDA_VERSION", f'"{version}"'),
            ("KVBM_CUDA_ARCHS", '"' + ";".join(names) + '"'),
        ])


extension = Extension(
    "kvbm_ext._C",
    sources=[f"csrc/{name}" for name in C_SOURCES],
    include_dirs=["csrc", "cuda"],
    define_macros=[("KVBM_VERSION", f'"{VERSION}"')],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
)

setup(
    version=VERSION,
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExt},
)
