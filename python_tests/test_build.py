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
    assert torch._C._dispatch_has_kernel_for_dispatch_key("jakiro::merge_attention_states", "CUDA") == built
    for name in ops.OP_NAMES:  # the CPU kernels are there in every build
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"jakiro::{name}", "CPU")
