// The op library of an emulated GPU build (jakiro_ext/emulator.py): the jakiro schemas
// under JAKIRO_SIMT_NAMESPACE, implemented by csrc/cuda/*.cu compiled with -DSIMT_EMU.
#include "op_schemas.h"

TORCH_LIBRARY(JAKIRO_SIMT_NAMESPACE, m) { jakiro::define_ops(m); }
