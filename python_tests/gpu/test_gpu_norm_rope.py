"""GPU kernels of rms_norm and rope_kv_write (csrc/cuda) against the references, run by the
SIMT emulator at warp widths 32 and 64 (and on a GPU when there is one); the CPU kernels run the
same checks in op_cases/norm_rope.py."""
import pytest
import torch

from op_cases.norm_rope import RMS_NORM_SHAPES, ROPE_SHAPES, check_rms_norm, check_rope_kv_write


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", RMS_NORM_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}")
def test_gpu_rms_norm_matches_reference(gpu_backend, shape, dtype, with_residual):
    check_rms_norm(gpu_backend, shape, dtype, with_residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "B{}-T{}-Hq{}-Hkv{}-D{}-S{}".format(*s))
def test_gpu_rope_kv_write_matches_reference(gpu_backend, shape, dtype):
    check_rope_kv_write(gpu_backend, shape, dtype)
