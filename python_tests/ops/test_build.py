"""What was built matches what runs: the torch version, and the CUDA kernels exactly when the
extension was built with them (scripts/check_cuda_build.sh builds it so and sets
JAKIRO_EXPECT_CUDA=1; the CPU run sets 0)."""
import os

import torch

from jakiro_ext import ops


def test_build_matches_the_running_torch():
    assert ops._C.torch_version == torch.__version__


def test_cuda_kernels_are_registered_exactly_when_built():
    built = bool(ops._C.with_cuda)
    expected = os.environ.get("JAKIRO_EXPECT_CUDA")
    if expected is not None:
        assert built == (expected == "1"), f"JAKIRO_EXPECT_CUDA={expected} but the extension has with_cuda={built}"
    for name in ops.OP_NAMES:  # the CPU kernels are there in every build, the CUDA kernels in CUDA builds
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"jakiro::{name}", "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"jakiro::{name}", "CUDA") == built, name


def test_every_gpu_kernel_is_tested_under_the_emulator():
    # Each op's CUDA kernel has a test_gpu_<op>_matches_reference test (run under the SIMT emulator
    # at warp widths 32 and 64, and on a GPU when there is one).
    import importlib
    import pathlib

    names = []
    for path in (pathlib.Path(__file__).parents[1] / "gpu").glob("test_gpu_*.py"):
        names += [n for n in dir(importlib.import_module(path.stem)) if n.startswith("test_gpu_")]
    for name in ops.OP_NAMES:
        assert any(n.startswith(f"test_gpu_{name}_matches_reference") for n in names), f"no GPU test of jakiro::{name}"
