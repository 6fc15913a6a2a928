"""Every op of torch.ops.jakiro has a reference, a fake (meta) implementation, a Python entry
point, and tests; this fails as soon as an op is added without them."""
import importlib
import inspect
import re

import pytest
import torch

from jakiro_ext import ops
from jakiro_ext.ops import reference

from conftest import TESTS


def registered_ops():
    return sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("jakiro::"))


def test_the_registered_ops_are_the_schemas_and_the_package_lists_them():
    # The library registers exactly the schemas of csrc/op_schemas.h, and the package's list of
    # its ops is what it registered (read from it, not kept by hand).
    schemas = (TESTS.parent / "csrc" / "op_schemas.h").read_text()
    defined = sorted(re.findall(r'm\.def\(\s*"(\w+)\(', schemas))
    assert len(defined) >= 15 and registered_ops() == defined == sorted(ops.OP_NAMES)


def each_test_module():
    """(path, module) of every test module (a module skipped at import, its peer not installed, left out)."""
    for path in TESTS.rglob("test_*.py"):
        try:
            yield path, importlib.import_module(path.stem)
        except pytest.skip.Exception:
            continue


def test_every_op_has_reference_fake_entry_point_and_tests():
    test_functions = []
    for _, module in each_test_module():
        test_functions += [name for name in dir(module) if name.startswith("test_")]
    for name in registered_ops():
        assert callable(getattr(reference, name, None)), f"jakiro::{name} has no reference in jakiro_ext.ops.reference"
        assert callable(getattr(ops, name, None)), f"jakiro::{name} has no entry point in jakiro_ext.ops"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"jakiro::{name}", "Meta") or \
            torch._library.simple_registry.singleton.find(f"jakiro::{name}").fake_impl.kernel is not None, \
            f"jakiro::{name} has no fake implementation"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"jakiro::{name}", "CPU"), f"jakiro::{name} has no CPU kernel"
        for kind in ("matches_reference", "opcheck", "bad_input_errors"):
            assert any(f.startswith(f"test_{name}_{kind}") for f in test_functions), \
                f"jakiro::{name} has no test_{name}_{kind}* test"


# What every op must have a test for, besides the names above; the tests say so with
# @pytest.mark.covers(op, kind). Exempt: what has no such case, and why.
COVERED_KINDS = ("nonfinite", "adversarial_shapes")
EXEMPT = {"device_errors": "it reads and clears the device's error word: no values to poison, one shape"}


def coverage() -> dict:
    """(op, kind) -> the tests marked as checking it, each verified to be a test function whose
    source (decorators included) names the op."""
    found = {}
    for path, module in each_test_module():
        for name, fn in vars(module).items():
            for mark in getattr(fn, "pytestmark", []) if name.startswith("test_") else []:
                if mark.name != "covers":
                    continue
                op, kind = mark.args
                assert kind in COVERED_KINDS, f"{path.name}::{name}: unknown kind {kind!r}"
                assert op in inspect.getsource(fn), f"{path.name}::{name} is marked for {op} but never names it"
                found.setdefault((op, kind), []).append(f"{path.name}::{name}")
    return found


def test_every_op_has_nonfinite_and_adversarial_shape_tests():
    found = coverage()
    missing = [f"{op}: {kind}" for op in registered_ops() if op not in EXEMPT for kind in COVERED_KINDS
               if (op, kind) not in found]
    assert not missing, f"ops without a test marked @pytest.mark.covers(op, kind): {missing}"
    assert set(EXEMPT) <= set(registered_ops())


def test_outputs_are_ordinary_tensors():
    # Callers update results in place and use them under autograd: no inference tensors.
    parents = torch.tensor([[-1, 0, 0, 1]])
    mask = ops.build_tree_mask(parents)
    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 2, 32, 16)
    outputs = [
        *ops.tree_attention(q, k, k, torch.tensor([10]), mask),
        *ops.tree_attention_partial(q, k, k, torch.tensor([10]), mask, 2),
        *ops.merge_attention_states(torch.randn(1, 2, 3, 2, 8), torch.randn(1, 2, 3, 2)),
        *ops.moe_top2(torch.randn(3, 16), torch.randn(6, 16), torch.randn(4, 8, 16), torch.randn(4, 8, 16),
                      torch.randn(4, 16, 8)),
        *ops.contrastive_topk(torch.randn(3, 16), None, None, torch.randn(50, 16), 4),
        *ops.verify_tree(parents, torch.tensor([[1, 2, 3, 4]]), torch.randn(1, 4, 10)),
    ]
    for t in outputs:
        assert not t.is_inference()
        t.add_(1)
    w = torch.randn(16, 16, requires_grad=True)
    (outputs[0].flatten(0, 2) @ w).sum().backward()  # usable as an autograd input
    assert w.grad is not None
