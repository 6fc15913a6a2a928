"""Shared helpers of the op tests: deterministic generators, random trees, tolerances; and the
import path of the test folders."""
import sys
from pathlib import Path

import pytest
import torch

import jakiro_ext  # noqa: F401  (loads torch.ops.jakiro)
from jakiro_ext.ops import emulator
from jakiro_ext import ops

TESTS = Path(__file__).resolve().parent
AREAS = ("ops", "gpu", "models", "engine", "training", "cli", "integrations", "robustness")
# Test modules share cases across areas (the GPU tests reuse the op tests' shapes, everything the
# helpers): the tests' folder and each area's are importable by module name, here and in the
# subprocesses some tests start (their PYTHONPATH gets TEST_PATH).
TEST_FOLDERS = [TESTS, *(TESTS / area for area in AREAS)]
for _folder in reversed(TEST_FOLDERS):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
TEST_PATH = [str(folder) for folder in TEST_FOLDERS]

# Tolerances of a kernel against its float32 reference, by the kernel's input dtype.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# The slow test modules: whole generations on the default model, kills at every file-system call,
# corpus generation, the engine through the emulated GPU kernels (about 12 of the suite's 19 minutes
# on a 2-core Xeon, measured with --durations).
SLOW_MODULES = {"test_engine_emulated.py", "test_lossless_smollm2.py", "test_robustness.py", "test_corpus.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "covers(op, kind): this test checks the op's kind of case (nonfinite, "
                                       "adversarial_shapes); test_op_registry requires both for every op")
    config.addinivalue_line("markers", "slow: a test of the slow modules (SLOW_MODULES): -m 'not slow' leaves them out")
    config.addinivalue_line("markers", "emulated: runs GPU kernels under the SIMT emulator (python_tests/gpu, a simt "
                                       "parameter): -m 'not emulated' leaves them out")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path
        if path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if path.parent.name == "gpu" or "simt" in item.name:
            item.add_marker(pytest.mark.emulated)


@pytest.fixture(scope="module")
def target():
    """The tiny random target (helpers.tiny_target), one per test module; a module that needs
    another target overrides this fixture."""
    from helpers import tiny_target  # (helpers imports this module)

    return tiny_target()


@pytest.fixture(autouse=True, scope="session")
def _compiled_ops_loaded():
    # The tests are about the compiled kernels: never let them silently run the references.
    assert ops.compiled_available(), ops.LOAD_ERROR


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def random_parents(batch: int, nodes: int, seed: int, max_children: int = 0) -> torch.Tensor:
    """Random trees in topological order: node i's parent is uniform in [0, i)
    (or among the last few nodes when max_children > 0, which gives deeper trees)."""
    g = gen(seed)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        lo = max(0, i - max_children) if max_children else 0
        parents[:, i] = torch.randint(lo, i, (batch,), generator=g)
    return parents


# ----------------------------------------------------------------------------- GPU kernels
class GpuBackend:
    """Where the GPU kernels of csrc/cuda run in a test: under the CPU SIMT emulator with warp
    width 32 or 64 (always), or on a real CUDA device (when there is one)."""

    def __init__(self, name: str):
        self.name = name
        if name == "cpu":  # the CPU kernels, for tests that run every backend alike
            self.ops, self.device = torch.ops.jakiro, torch.device("cpu")
        elif name == "cuda":
            self.ops, self.device = torch.ops.jakiro, torch.device("cuda")
        else:
            self.ops, self.device = emulator.emulated_ops(int(name.removeprefix("simt"))), torch.device("cpu")

    def to_device(self, value):
        if isinstance(value, list):  # (an op's Tensor[] argument)
            return [self.to_device(v) for v in value]
        return value.to(self.device) if isinstance(value, torch.Tensor) else value

    def run(self, op: str, *args, **kwargs):
        """Calls op on the backend's device; tensor results come back to the CPU."""
        args = [self.to_device(a) for a in args]
        kwargs = {k: self.to_device(v) for k, v in kwargs.items()}
        result = getattr(self.ops, op)(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            return result.cpu()
        if isinstance(result, (tuple, list)):
            return tuple(r.cpu() if isinstance(r, torch.Tensor) else r for r in result)
        return result


def _gpu_backend_names():
    names = ["simt32", "simt64"]
    if torch.cuda.is_available() and getattr(ops._C, "with_cuda", 0):
        names.append("cuda")
    return names


@pytest.fixture(scope="session", params=_gpu_backend_names())
def gpu_backend(request) -> GpuBackend:
    return GpuBackend(request.param)


@pytest.fixture(scope="session", params=["cpu"] + _gpu_backend_names())
def any_backend(request) -> GpuBackend:
    """The CPU kernels and every GPU backend of gpu_backend."""
    return GpuBackend(request.param)
