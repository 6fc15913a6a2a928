"""Builds and loads the GPU kernels (csrc/cuda) compiled for the CPU SIMT emulator
(csrc/simt/simt_emu.h), so that tests run them, without a GPU, against the references.

``emulated_ops(warp_size)`` compiles every torch glue file ``csrc/cuda/*.cu`` as C++ with
``g++ -std=c++20 -DSIMT_EMU -DSIMT_WARP_SIZE=<32|64>`` (once per warp width; ninja rebuilds only
what changed) and returns the op namespace ``torch.ops.jakiro_simt<W>``: the jakiro ops,
taking CPU tensors, computed by the GPU kernels running as fibers on the calling thread.

Environment: ``JAKIRO_SIMT_BUILD_DIR`` (default ``build/simt`` in the repository),
``JAKIRO_SIMT_OPS`` (comma-separated glue file stems to compile, default all: for work on one
kernel), ``MAX_JOBS`` (parallel compiles, torch's variable), ``JAKIRO_SIMT_VERBOSE=1``.
"""
from __future__ import annotations

import functools
import os
import pathlib

import torch
from torch.utils import cpp_extension

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
WARP_SIZES = (32, 64)


def glue_sources() -> list[pathlib.Path]:
    sources = sorted((CSRC / "cuda").glob("*.cu"))
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
    namespace = f"jakiro_simt{warp_size}"
    build_dir = pathlib.Path(os.environ.get("JAKIRO_SIMT_BUILD_DIR", ROOT / "build" / "simt")) / f"w{warp_size}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # The .cu glue is compiled as C++: one-line wrappers, since torch's builder sends .cu to nvcc.
    sources = []
    for cu in glue_sources():
        wrapper = build_dir / f"{cu.stem}_simt.cpp"
        text = f'#include "{cu}"\n'
        if not wrapper.exists() or wrapper.read_text() != text:
            wrapper.write_text(text)
        sources.append(str(wrapper))
    sources += [str(CSRC / "validate.cpp"), str(CSRC / "simt" / "simt_library.cpp")]
    cpp_extension.load(
        name=namespace,
        sources=sources,
        # -fno-gnu-unique: the 32- and 64-wide libraries share one process; their inline and
        # template statics (the emulated __shared__ arrays, sized by the warp width) must not merge.
        extra_cflags=["-std=c++20", "-O2", "-fno-math-errno", "-ffp-contract=off", "-fno-gnu-unique", "-DSIMT_EMU",
                      f"-DSIMT_WARP_SIZE={warp_size}",
                      f"-DJAKIRO_SIMT_NAMESPACE={namespace}", "-Wno-unused-function"],
        extra_include_paths=[str(CSRC), str(CSRC / "include")],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=os.environ.get("JAKIRO_SIMT_VERBOSE") == "1",
    )
    return getattr(torch.ops, namespace)
