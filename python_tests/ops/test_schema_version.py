"""The ops' schema version: what the library reports (``jakiro_ext.ops.schema_version()``) names
one set of schemas. A schema changed without raising ``kSchemaVersion`` in csrc/op_schemas.h fails
here, so that a project pinning a version never calls ops whose arguments moved under it."""
import hashlib

import torch

from jakiro_ext import ops

# version -> sha256 of every op's schema, one a line, sorted by name (the library's registration).
FINGERPRINTS = {1: "9f6017f00f994c982c1abf64a56e010b1f96e1ac8eac0332cfaf3dbeec1e87f5",
                2: "9fbd4a70c8f10bf62e3250ddc2fa28ddd0acc0e17139cff399433c560c94aa9c"}  # 2: dequantize_rows


def schemas() -> str:
    return "\n".join(str(getattr(torch.ops.jakiro, name).default._schema) for name in ops.registered_ops())


def test_the_reported_version_names_these_schemas():
    version, text = ops.schema_version(), schemas()
    assert "jakiro::tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_lens" in text
    assert version in FINGERPRINTS, (f"schema version {version} has no recorded fingerprint: record "
                                     f"{hashlib.sha256(text.encode()).hexdigest()} for it")
    assert hashlib.sha256(text.encode()).hexdigest() == FINGERPRINTS[version], (
        f"the op schemas changed but the library still reports version {version}: raise kSchemaVersion in "
        f"csrc/op_schemas.h and record the new fingerprint here. Now:\n{text}")
