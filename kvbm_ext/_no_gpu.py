"""The one answer of `python -m kvbm_ext` and of every benchmark script when a GPU is asked
for and none can be used: why not, in one message, with one exit status."""

import sys
from typing import NoReturn, Optional

# The status argparse gives a bad option: what was asked for cannot be had here.
EXIT_NO_GPU = 2


def why_no_gpu(count: int = 1, build: bool = True) -> Optional[str]:
    """Why `count` CUDA devices cannot be used through torch (and through this kvbm_ext
    build, when `build`), or None when they can."""
    if build:
        import kvbm_ext

        if kvbm_ext.is_using_stubs():
            return "this kvbm_ext was built without CUDA (kvbm_ext.is_using_stubs() is True)"
        if not kvbm_ext.cuda_devices():
            return "no CUDA device is visible"
    try:
        import torch
    except ImportError:
        return "torch is not installed, and the GPU work allocates its arrays with torch"
    if torch.version.cuda is None:
        return "torch cannot use CUDA here (this torch is a build without CUDA)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    visible = torch.cuda.device_count()
    if visible < count:
        return f"only {visible} CUDA device(s) visible, {count} needed"
    return None


def no_gpu_message(program: str, why: str) -> str:
    return f"{program}: no GPU to run on: {why}"


def exit_no_gpu(program: str, why: str) -> NoReturn:
    """Says why on stderr and exits with EXIT_NO_GPU."""
    print(no_gpu_message(program, why), file=sys.stderr)
    sys.exit(EXIT_NO_GPU)


def require_gpu(program: str, count: int = 1, build: bool = True) -> None:
    """Returns when `count` CUDA devices can be used (see why_no_gpu), else exits saying why."""
    why = why_no_gpu(count, build)
    if why is not None:
        exit_no_gpu(program, why)
