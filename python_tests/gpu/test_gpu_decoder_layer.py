"""GPU kernels of decoder_layer (the composition over the GPU ops), decoder_layers (its layers in
turn) and silu_mul (csrc/cuda) against the references, run by the SIMT emulator at warp widths 32
and 64 (and on a GPU when there is one); the CPU kernels run the same checks in
test_decoder_layer.py and test_decoder_layers.py (the cases of op_cases/decoder_layer.py)."""
import pytest
import torch

from op_cases import decoder_layer as cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", cases.SILU_SHAPES, ids=lambda s: f"{'x'.join(map(str, s[0]))}-I{s[1]}")
def test_gpu_silu_mul_matches_reference(gpu_backend, shape, dtype):
    cases.check_silu_mul(gpu_backend, shape, dtype)


@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)], ids=["first-nobias", "residual-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", cases.LAYER_SHAPES, ids=lambda s: "B{}-T{}-H{}-Hq{}-Hkv{}-D{}-I{}".format(*s[:7]))
def test_gpu_decoder_layer_matches_reference(gpu_backend, shape, dtype, bias, residual):
    cases.check_decoder_layer(gpu_backend, shape, dtype, bias, residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", cases.LAYER_SHAPES[:2] + cases.LAYER_SHAPES[3:],
                         ids=lambda s: "B{}-T{}-H{}-Hq{}-Hkv{}-D{}-I{}".format(*s[:7]))
def test_gpu_decoder_layers_matches_reference(gpu_backend, shape, dtype):
    cases.check_decoder_layers(gpu_backend, shape, dtype, True, True, 2)
