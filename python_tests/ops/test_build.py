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


def test_from_its_source_tree_the_package_uses_the_installed_build_of_the_same_kernels(tmp_path, monkeypatch):
    # Run from a clone's root, `import jakiro_ext` finds the source tree, which holds no compiled
    # library: the installed build's is used when its csrc/ copy equals the tree's, else one
    # sentence says what to do.
    import importlib.machinery
    import sys

    from jakiro_ext.ops.library import installed_library

    root, site = tmp_path / "clone", tmp_path / "site"
    package = root / "jakiro_ext"
    for d in (package, root / "csrc" / "cpu", site / "jakiro_ext" / "csrc" / "cpu"):
        d.mkdir(parents=True)
    (root / "setup.py").write_text("")
    for csrc in (root / "csrc", site / "jakiro_ext" / "csrc"):
        (csrc / "cpu" / "kernel.cpp").write_text("int f() { return 1; }\n")
    monkeypatch.setattr(sys, "path", [str(root), str(site)])
    found, why = installed_library(package)
    assert found is None and "no installed build was found" in why and ".venv/bin/python" in why
    library = site / "jakiro_ext" / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])
    library.write_bytes(b"")
    assert installed_library(package) == (library, "")
    (root / "csrc" / "cpu" / "kernel.cpp").write_text("int f() { return 2; }\n")  # edited, not reinstalled
    found, why = installed_library(package)
    assert found is None and f"whose csrc/ differs from the installed build's ({site / 'jakiro_ext'})" in why
    assert "pip install --no-build-isolation ." in why
    assert installed_library(site / "jakiro_ext") == (None, "")  # an installed package is no source tree
