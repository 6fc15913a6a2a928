"""Cases shared by the op tests (ops/) and the GPU kernels' tests (gpu/): shapes, input makers and
checks run on any backend, one module per op family."""
