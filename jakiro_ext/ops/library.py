"""Loading the compiled library ``jakiro_ext._C`` (it registers ``torch.ops.jakiro.*``), why it
failed when it did, and what the CPU kernels found of the CPU at run time."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

KERNEL_SOURCES = (".h", ".cuh", ".cu", ".cpp")  # what setup.py installs as jakiro_ext/csrc


def _kernel_sources(csrc: Path) -> Dict[str, bytes]:
    return {str(f.relative_to(csrc)): f.read_bytes() for f in sorted(csrc.rglob("*")) if f.suffix in KERNEL_SOURCES}


def installed_library(package: Path) -> Tuple[Optional[Path], str]:
    """For the package imported from its source checkout (``setup.py`` and ``csrc/`` beside it:
    run from the clone's root), which holds no compiled library of its own: the installed
    build's library when that build was made from these very kernel sources (the installed
    ``jakiro_ext/csrc`` copy equals ``csrc/``), else None; and why not, in a sentence."""
    root = package.parent
    if not ((root / "setup.py").is_file() and (root / "csrc").is_dir()):
        return None, ""
    for entry in sys.path:
        installed = Path(entry or ".").resolve() / "jakiro_ext"
        if installed == package.resolve() or not installed.is_dir():
            continue
        libraries = [f for suffix in importlib.machinery.EXTENSION_SUFFIXES for f in installed.glob("_C" + suffix)]
        if not libraries:
            continue
        if _kernel_sources(installed / "csrc") != _kernel_sources(root / "csrc"):
            return None, (f"jakiro_ext is imported from its source tree ({package}), whose csrc/ differs from the "
                          f"installed build's ({installed}): install it again (pip install --no-build-isolation .), "
                          f"or run from outside {root}")
        return libraries[0], ""
    return None, (f"jakiro_ext is imported from its source tree ({package}), and no installed build was found: "
                  f"install it (bash scripts/demo.sh, or pip install --no-build-isolation .) and use that "
                  f"environment's python (.venv/bin/python)")


def _load_installed(library: Path):
    """Load ``library`` as ``jakiro_ext._C`` (it registers torch.ops.jakiro.*)."""
    spec = importlib.util.spec_from_file_location("jakiro_ext._C", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["jakiro_ext._C"] = module
    return module


LOAD_ERROR: Optional[str] = None
try:
    try:
        from jakiro_ext import _C as compiled  # (registers torch.ops.jakiro.*)
    except ImportError as exc:
        library, why = installed_library(Path(__file__).resolve().parents[1])
        if library is None:
            raise ImportError(why or str(exc)) from None
        compiled = _load_installed(library)

    if compiled.torch_version.split("+")[0] != torch.__version__.split("+")[0]:
        LOAD_ERROR = (f"jakiro_ext was built against torch {compiled.torch_version} but torch {torch.__version__} "
                      "is running; reinstall it: pip install --no-build-isolation .")
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    compiled = None
    LOAD_ERROR = f"the compiled library jakiro_ext._C could not be loaded: {exc}"

if LOAD_ERROR is None:
    compiled.cpu_weight_stream()  # a bad JAKIRO_CPU_WEIGHT_STREAM is a ValueError here, not in a product's worker

USE_REFERENCE = os.environ.get("JAKIRO_USE_REFERENCE", "") == "1"
if LOAD_ERROR and USE_REFERENCE:
    warnings.warn(f"{LOAD_ERROR}. JAKIRO_USE_REFERENCE=1: using the pure-PyTorch reference ops (slow).")


def registered_ops() -> Tuple[str, ...]:
    """The ops the loaded library registered under ``jakiro::`` (their schemas: ``csrc/op_schemas.h``),
    sorted; empty when it is not loaded."""
    return tuple(sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("jakiro::")))


def schema_version() -> int:
    """The version of the ops' schemas the loaded library registered (``kSchemaVersion`` in
    ``csrc/op_schemas.h``, raised whenever a schema changes): what a project calling the ops checks."""
    if LOAD_ERROR is not None:
        raise RuntimeError(f"no jakiro op library is loaded: {LOAD_ERROR}")
    version = getattr(compiled, "schema_version", None)
    if version is None:
        raise RuntimeError("the loaded jakiro_ext._C predates schema versions: rebuild it (pip install "
                           "--no-build-isolation .)")
    return int(version)


def compiled_available() -> bool:
    return LOAD_ERROR is None


def cpu_avx512() -> bool:
    """Whether float32 products on the CPU (``linear``) run on 512-bit vectors (AVX-512, detected at
    run time; ``JAKIRO_CPU_AVX512=0`` turns them off, and with them native bf16) rather than 256-bit."""
    return bool(compiled.cpu_avx512()) if LOAD_ERROR is None else False


def cpu_bf16_dot() -> bool:
    """Whether bf16 products on the CPU use the CPU's native bf16 dot instructions (AVX512-BF16,
    detected at run time; ``JAKIRO_CPU_BF16_DOT=0`` or ``JAKIRO_CPU_AVX512=0`` turns them off) rather
    than widening to fp32."""
    return bool(compiled.cpu_bf16_dot()) if LOAD_ERROR is None else False


def cpu_onednn() -> bool:
    """Whether a prompt's float32 products on the CPU (``linear`` beyond 64 rows of one sequence)
    go to torch's oneDNN (``mkldnn::_linear_pointwise``, where torch has it; ``JAKIRO_CPU_ONEDNN=0``
    turns it off) rather than ATen's linear (MKL)."""
    return bool(compiled.cpu_onednn()) if LOAD_ERROR is None else False


def cpu_weight_stream() -> str:
    """How the CPU's 512-bit products read a weight, as measured best on each kind of CPU and
    chosen for this one at run time: ``"zen5"`` (AMD Zen 5 and later: up to 5 token rows a weight
    row at a time, one stream, 4 KB ahead), ``"zen4"`` (earlier AMD CPUs: one row so, 2 x 8 float32
    tiles beyond) or ``"intel"`` (4 x 6 tiles, the next tile asked for over the passes of many
    rows); ``JAKIRO_CPU_WEIGHT_STREAM`` names one instead. Every one gives the same bits."""
    return str(compiled.cpu_weight_stream()) if LOAD_ERROR is None else "none"
