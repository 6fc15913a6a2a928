"""Build definition of the jakiro_ext Python package (torch cpp_extension + ninja).

The C++ CPU kernels are always built. The CUDA sources are built when torch is a CUDA
build and a CUDA toolkit is found; ``JAKIRO_CUDA=1`` forces them (and fails loudly if
impossible), ``JAKIRO_CUDA=0`` disables them. Other switches:

* ``JAKIRO_CPU_ARCH``: ``native`` (default, ``-march=native``) or ``generic``.
* ``JAKIRO_DEBUG=1``: ``-O0 -g``.
* ``TORCH_CUDA_ARCH_LIST``: defaults to ``8.0;9.0`` when no GPU is there to detect.
* ``MAX_JOBS``: defaults to what memory allows (2 GiB per job), at most the core count.
"""
import glob
import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name):
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    sys.exit(f"setup.py: {name} must be 1/0/auto, got {value!r}")


def _cpu_has_avx2():
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return " avx2" in flags and " fma" in flags
    except OSError:
        return False


def _find_cuda_home():
    # The toolkit's nvcc shim can mislead torch's guess: prefer an explicit CUDA_HOME,
    # then /usr/local/cuda, then torch's own guess.
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", cpp_extension.CUDA_HOME):
        if candidate and os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    return None


def _default_max_jobs():
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 4
    return str(max(1, min(os.cpu_count() or 1, int(mem_gib // 2))))


os.environ.setdefault("MAX_JOBS", _default_max_jobs())

want_cuda = _env_flag("JAKIRO_CUDA")
cuda_home = _find_cuda_home()
torch_has_cuda = torch.version.cuda is not None
if want_cuda is None:
    build_cuda = torch_has_cuda and cuda_home is not None
elif want_cuda:
    if not torch_has_cuda:
        sys.exit(f"setup.py: JAKIRO_CUDA=1 but torch {torch.__version__} is a CPU-only build")
    if cuda_home is None:
        sys.exit("setup.py: JAKIRO_CUDA=1 but no CUDA toolkit (bin/nvcc) was found; set CUDA_HOME")
    build_cuda = True
else:
    build_cuda = False

debug = _env_flag("JAKIRO_DEBUG") is True
cpu_arch = os.environ.get("JAKIRO_CPU_ARCH", "native")
if cpu_arch not in ("native", "generic"):
    sys.exit(f"setup.py: JAKIRO_CPU_ARCH must be native or generic, got {cpu_arch!r}")

# No contraction into fused multiply-adds: kernels round where the eager code they replace rounds
# (fused multiply-adds are written out where they are meant: at::vec::fmadd, std::fma).
cxx_flags = ["-std=c++20", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"]
cxx_flags += ["-O0", "-g"] if debug else ["-O3", "-DNDEBUG"]
if cpu_arch == "native":
    cxx_flags.append("-march=native")
    if _cpu_has_avx2():
        # Selects ATen's AVX2 Vectorized<T> specialisations (and their Sleef math).
        cxx_flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]

sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
define_macros = [("TORCH_BUILD_VERSION", f'"{torch.__version__}"')]
extra_compile_args = {"cxx": cxx_flags}

if build_cuda:
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    define_macros.append(("JAKIRO_WITH_CUDA", "1"))
    # 20011 (a __host__ function called from a __host__ __device__ one) is a warning to nvcc, and
    # the device side is then undefined: ptxas emptied a whole kernel over one such call.
    extra_compile_args["nvcc"] = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "--diag-error", "20011"] + (
        ["-g", "-G"] if debug else [])
    extension_cls = cpp_extension.CUDAExtension
else:
    extension_cls = cpp_extension.CppExtension

print(f"setup.py: torch {torch.__version__}, CUDA kernels: {'yes (' + cuda_home + ')' if build_cuda else 'no'}, "
      f"cpu arch: {cpu_arch}, debug: {debug}, MAX_JOBS={os.environ['MAX_JOBS']}")

class BuildPyWithKernelSources(build_py):
    """Installs csrc/ as jakiro_ext/csrc too: ops.use_backend("simt32" | "simt64") compiles the GPU
    kernels for the CPU SIMT emulator from it at run time (jakiro_ext/ops/emulator.py). And the
    committed token corpora as jakiro_ext/corpus (3 MB: `train --data SmolLM2-135M-Instruct` from
    anywhere, jakiro_ext.paths.packaged_corpus)."""

    def run(self):
        super().run()
        kernels = [p for p in glob.glob(os.path.join("csrc", "**", "*"), recursive=True)
                   if p.endswith((".h", ".cuh", ".cu", ".cpp"))]
        corpora = [p for p in glob.glob(os.path.join("corpus", "*", "*")) if p.endswith((".json", ".npz"))]
        for path in sorted(kernels + corpora):
            target = os.path.join(self.build_lib, "jakiro_ext", path)
            self.mkpath(os.path.dirname(target))
            self.copy_file(path, target)


setup(
    name="jakiro_ext",
    version="0.1.0",
    description="Tree-based speculative decoding with Mixture-of-Experts draft heads (Jakiro): fused torch ops",
    packages=find_packages(include=["jakiro_ext", "jakiro_ext.*"]),
    package_data={"jakiro_ext": ["data/*.jsonl", "heads/*/*.json", "heads/*/*.safetensors"]},
    ext_modules=[
        extension_cls(
            name="jakiro_ext._C",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=["-fopenmp"],
            py_limited_api=False,
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True),
              "build_py": BuildPyWithKernelSources},
    python_requires=">=3.10",
    install_requires=["numpy"],
    # The serving engines' plugins (jakiro_ext/serving): each registers the serving format's draft
    # class when that engine starts; nothing happens without the engine.
    entry_points={"vllm.general_plugins": ["jakiro = jakiro_ext.serving.plugins:register_vllm"],
                  "sglang.srt.plugins": ["jakiro = jakiro_ext.serving.plugins:register_sglang"]},
)
