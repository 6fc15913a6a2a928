"""The GPU kernels of ``csrc/cuda`` compiled for the CPU SIMT emulator (``csrc/simt/simt_emu.h``):
every CUDA kernel runs on the CPU, its threads as fibers on the calling thread, warps of 32 or 64
lanes. ``jakiro_ext.ops.use_backend("simt32" | "simt64")`` routes the package's ops through it;
the tests also call the namespaces directly.

``emulated_ops(warp_size)`` compiles every torch glue file ``csrc/cuda/*.cu`` as C++ with
``g++ -std=c++20 -DSIMT_EMU -DSIMT_WARP_SIZE=<32|64>`` (once per warp width and build directory;
ninja rebuilds only what changed), loads it and returns the op namespace
``torch.ops.jakiro_simt<W>``: the jakiro ops, taking CPU tensors.

The sources are the repository's ``csrc`` in a checkout, else the copy installed with the package
(``jakiro_ext/csrc``). Environment: ``JAKIRO_SIMT_BUILD_DIR`` (default ``build/simt`` in a checkout,
else ``$JAKIRO_CACHE/simt``), ``JAKIRO_SIMT_OPS`` (comma-separated glue file stems to compile,
default all: for work on one kernel), ``MAX_JOBS`` (parallel compiles, torch's variable),
``JAKIRO_SIMT_VERBOSE=1``.
"""
from __future__ import annotations

import fcntl
import functools
import os
import pathlib
import sys

import torch

from jakiro_ext.paths import cache_root

WARP_SIZES = (32, 64)
PACKAGE = pathlib.Path(__file__).resolve().parent.parent  # the installed jakiro_ext
CHECKOUT = PACKAGE.parent if (PACKAGE.parent / "csrc" / "cuda").is_dir() else None


def csrc_dir() -> pathlib.Path:
    path = CHECKOUT / "csrc" if CHECKOUT else PACKAGE / "csrc"
    if not (path / "cuda").is_dir():
        raise FileNotFoundError(f"the emulated GPU build compiles csrc/cuda, which is not at {path}: "
                                "reinstall jakiro_ext (pip install --no-build-isolation .), which installs it")
    return path


def build_root() -> pathlib.Path:
    if os.environ.get("JAKIRO_SIMT_BUILD_DIR"):
        return pathlib.Path(os.environ["JAKIRO_SIMT_BUILD_DIR"])
    if CHECKOUT:
        return CHECKOUT / "build" / "simt"

    return cache_root() / "simt"


def glue_sources() -> list[pathlib.Path]:
    sources = sorted((csrc_dir() / "cuda").glob("*.cu"))
    wanted = os.environ.get("JAKIRO_SIMT_OPS", "").strip()
    if wanted:
        names = {n.strip() for n in wanted.split(",") if n.strip()}
        unknown = names - {s.stem for s in sources}
        if unknown:
            raise ValueError(f"JAKIRO_SIMT_OPS names no csrc/cuda/<name>.cu: {sorted(unknown)}")
        sources = [s for s in sources if s.stem in names]
    return sources


@functools.cache
def emulated_ops(warp_size: int):
    if warp_size not in WARP_SIZES:
        raise ValueError(f"warp_size must be one of {WARP_SIZES}, got {warp_size}")

    csrc = csrc_dir()
    namespace = f"jakiro_simt{warp_size}"
    build_dir = build_root() / f"w{warp_size}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{namespace}.so").exists():
        print(f"jakiro_ext: building the GPU kernels for the CPU SIMT emulator (warp {warp_size}) in {build_dir}; "
              "this takes a few minutes, once", file=sys.stderr, flush=True)
    with open(build_dir / "build.flock", "w") as guard:
        # One build at a time in a build directory. torch's own lock (the file "lock", created
        # and deleted by the build) stays behind when a build is killed, and every later build
        # would wait for it forever; this lock is the kernel's, released when its holder dies:
        # whoever holds it knows a "lock" file there is such a leftover.
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        _build(csrc, namespace, build_dir, warp_size)
    return getattr(torch.ops, namespace)


def _build(csrc: pathlib.Path, namespace: str, build_dir: pathlib.Path, warp_size: int) -> None:
    """Compile (what changed) and load the library ``namespace`` in ``build_dir``."""
    # The .cu glue is compiled as C++: one-line wrappers, since torch's builder sends .cu to nvcc.
    sources = []
    for cu in glue_sources():
        wrapper = build_dir / f"{cu.stem}_simt.cpp"
        text = f'#include "{cu}"\n'
        if not wrapper.exists() or wrapper.read_text() != text:
            wrapper.write_text(text)
        sources.append(str(wrapper))
    sources += [str(csrc / "validate.cpp"), str(csrc / "simt" / "simt_library.cpp")]
    # Imported here: importing cpp_extension warns on stderr in a CUDA build of torch without a GPU.
    from torch.utils import cpp_extension
    cpp_extension.load(
        name=namespace,
        sources=sources,
        # -fno-gnu-unique: the 32- and 64-wide libraries share one process; their inline and
        # template statics (the emulated __shared__ arrays, sized by the warp width) must not merge.
        extra_cflags=["-std=c++20", "-O2", "-fno-math-errno", "-ffp-contract=off", "-fno-gnu-unique", "-DSIMT_EMU",
                      f"-DSIMT_WARP_SIZE={warp_size}",
                      f"-DJAKIRO_SIMT_NAMESPACE={namespace}", "-Wno-unused-function"],
        extra_include_paths=[str(csrc), str(csrc / "include")],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=os.environ.get("JAKIRO_SIMT_VERBOSE") == "1",
    )
