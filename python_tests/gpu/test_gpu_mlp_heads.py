"""The GPU kernel of mlp_heads (csrc/cuda) against the reference, run by the `gpu_backend`
fixture: under the SIMT emulator (warp widths 32 and 64) and on CUDA when present."""
import torch

from jakiro_ext.ops import reference
from op_cases.mlp_heads import MLP_HEADS_SHAPES, TOL_HEADS, make_mlp_heads, mlp_heads_id, rows_are_independent


def test_gpu_mlp_heads_matches_reference(gpu_backend):
    for dtype in (torch.float32, torch.bfloat16):
        for shape in MLP_HEADS_SHAPES:
            args = make_mlp_heads(shape, dtype)
            got = gpu_backend.run("mlp_heads", *args)
            torch.testing.assert_close(got, reference.mlp_heads(*args), **TOL_HEADS[dtype], msg=mlp_heads_id(shape))


def test_gpu_mlp_heads_row_does_not_depend_on_the_other_rows(gpu_backend):
    rows_are_independent(lambda *args: gpu_backend.run("mlp_heads", *args))
