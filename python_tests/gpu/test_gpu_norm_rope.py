"""GPU kernels of rms_norm and rope_kv_write (csrc/cuda) against the references, run by the
SIMT emulator at warp widths 32 and 64 (and on a GPU when there is one); the CPU kernels run the
same checks in test_rms_norm.py and test_rope_kv_write.py."""
import pytest
import torch

import test_rms_norm
import test_rope_kv_write


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", test_rms_norm.SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-H{s[1]}")
def test_gpu_rms_norm_matches_reference(gpu_backend, shape, dtype, with_residual):
    test_rms_norm.check_matches_reference(gpu_backend, shape, dtype, with_residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", test_rope_kv_write.SHAPES, ids=lambda s: "B{}-T{}-Hq{}-Hkv{}-D{}-S{}".format(*s))
def test_gpu_rope_kv_write_matches_reference(gpu_backend, shape, dtype):
    test_rope_kv_write.check_matches_reference(gpu_backend, shape, dtype)
