"""Cases of silu_mul, decoder_layer and decoder_layers shared by their CPU tests (ops/) and GPU
tests (gpu/), and by the non-finite tests."""
import math

import torch

from conftest import TOL, randn, random_parents
from jakiro_ext import ops
from jakiro_ext.ops import quantized, reference

# (leading dims, I): one element, odd sizes (no vector multiple), SmolLM2's 1536, many rows, no rows.
SILU_SHAPES = [((1,), 1), ((3,), 7), ((1, 1), 1536), ((2, 5), 131), ((300,), 48), ((0,), 16)]


def check_silu_mul(backend, shape, dtype):
    lead, I = shape
    x = randn(*lead, 2 * I, seed=1, dtype=dtype, scale=4.0)
    out = backend.run("silu_mul", x)
    assert out.shape == (*lead, I) and out.dtype == dtype
    torch.testing.assert_close(out, reference.silu_mul(x), **TOL[dtype])


class Layer:
    """A random decoder layer and its inputs: B sequences of T tokens after prefixes of different
    lengths, random trees (T > 1), optionally a qkv bias and an incoming residual."""

    def __init__(self, B=2, T=5, H=48, Hq=4, Hkv=2, D=16, I=40, S=None, dtype=torch.float32, bias=True,
                 residual=True, seed=0, prefix=(9, 3)):
        self.B, self.T, self.Hq, self.Hkv, self.D = B, T, Hq, Hkv, D
        s = seed * 100
        scale = 1 / math.sqrt(H)
        self.weights = dict(
            input_norm=1 + 0.1 * randn(H, seed=s + 1, dtype=dtype),
            qkv_weight=randn((Hq + 2 * Hkv) * D, H, seed=s + 2, dtype=dtype, scale=scale),
            qkv_bias=randn((Hq + 2 * Hkv) * D, seed=s + 3, dtype=dtype, scale=0.1) if bias else None,
            o_weight=randn(H, Hq * D, seed=s + 4, dtype=dtype, scale=1 / math.sqrt(Hq * D)),
            post_norm=1 + 0.1 * randn(H, seed=s + 5, dtype=dtype),
            gate_up_weight=randn(2 * I, H, seed=s + 6, dtype=dtype, scale=scale),
            down_weight=randn(H, I, seed=s + 7, dtype=dtype, scale=1 / math.sqrt(I)))
        self.lengths = torch.tensor([prefix[b % len(prefix)] for b in range(B)])
        S = S or int(self.lengths.max()) + T + 3
        self.delta = randn(B, T, H, seed=s + 8, dtype=dtype)
        self.residual = randn(B, T, H, seed=s + 9, dtype=dtype) if residual else None
        self.kv_cache = randn(2, B, Hkv, S, D, seed=s + 10, dtype=dtype)
        self.tree_mask = ops.build_tree_mask(random_parents(B, T, seed=s + 11, max_children=3))
        depths = torch.arange(T).expand(B, T)  # positions: any increasing ones do for the check
        angles = (self.lengths.unsqueeze(1) + depths).float().unsqueeze(-1) * (1e4 ** (-torch.arange(0, D, 2) / D))
        self.cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
        self.sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)

    def with_bf16_projections(self) -> "Layer":
        """The four projection weights rounded to bf16 and kept so (the rest float32)."""
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            self.weights[name] = self.weights[name].bfloat16()
        return self

    def with_packed_projections(self, format: str) -> "Layer":
        """The four projection weights quantized to ``format`` blocks and packed (H, Hq D, I
        multiples of 32; the rows of each a multiple of 16)."""
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            self.weights[name] = quantized.from_float(self.weights[name], format)
        return self

    def args(self, kv_cache=None):
        w = self.weights
        return (self.delta, self.residual, w["input_norm"], w["qkv_weight"], w["qkv_bias"], w["o_weight"],
                w["post_norm"], w["gate_up_weight"], w["down_weight"], self.cos, self.sin,
                self.kv_cache.clone() if kv_cache is None else kv_cache, self.lengths, self.tree_mask, 1e-5)


# (B, T, H, Hq, Hkv, D, I, prefixes): decoding, a tree, a prompt beyond 64 tokens (a mask of
# two words, BLAS rows), MHA (Hq = Hkv), many sequences whose rows exceed 64 together, odd sizes,
# an empty prefix.
LAYER_SHAPES = [(1, 1, 48, 4, 2, 16, 40, (9,)), (2, 5, 48, 4, 2, 16, 40, (9, 3)), (1, 70, 32, 2, 2, 8, 24, (0,)),
                (3, 30, 24, 3, 3, 8, 17, (1, 40, 5)), (2, 3, 17, 6, 2, 6, 9, (0, 2))]


def check_decoder_layer(backend, shape, dtype, bias, residual):
    B, T, H, Hq, Hkv, D, I, prefix = shape
    layer = Layer(B, T, H, Hq, Hkv, D, I, dtype=dtype, bias=bias, residual=residual, prefix=prefix)
    cache = backend.to_device(layer.kv_cache.clone())  # written in place on the backend's device
    got_residual, got_delta = backend.run("decoder_layer", *layer.args(cache))
    want_cache = layer.kv_cache.clone()
    want_residual, want_delta = reference.decoder_layer(*layer.args(want_cache))
    assert got_delta.shape == (B, T, H) and got_delta.dtype == dtype and got_residual.dtype == dtype
    torch.testing.assert_close(got_residual, want_residual, **TOL[dtype])
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)  # bf16 rounds at every part
    torch.testing.assert_close(got_delta, want_delta, **tol)
    torch.testing.assert_close(cache.cpu(), want_cache, **tol)


# (B, T, H, Hq, Hkv, D, I, prefixes, bias, residual): one token (decoding), a tree, prefixes over
# several 512-key splits of the attention, odd widths (partial column blocks, a SiLU tail), a
# batch of 64 rows (the most one parallel region takes), and beyond it (the ops composed).
COMPOSED_SHAPES = [(1, 1, 48, 4, 2, 16, 40, (9,), True, True), (2, 6, 48, 4, 2, 16, 40, (9, 3), True, True),
                   (2, 3, 64, 6, 2, 16, 96, (1100, 513), False, True), (1, 2, 17, 3, 1, 6, 41, (0,), False, False),
                   (4, 16, 40, 4, 4, 8, 50, (0, 5, 600, 2), True, True), (5, 13, 32, 2, 1, 8, 24, (3,), False, True),
                   (1, 1, 48, 6, 2, 16, 40, (70,), False, True)]  # (3 threads: a KV head's 3 query heads apart)


PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


WEIGHTS = ("input_norm", "qkv_weight", "qkv_bias", "o_weight", "post_norm", "gate_up_weight", "down_weight")


class Layers:
    """L random decoder layers of one shape (each its own weights and cache) and one input: the
    first layer's delta, residual, rotary tables, lengths and tree."""

    def __init__(self, L=3, *args, **kwargs):
        seed = kwargs.pop("seed", 0)
        self.layers = [Layer(*args, seed=seed + layer, **kwargs) for layer in range(L)]
        self.first = self.layers[0]
        self.kv_cache = torch.stack([layer.kv_cache for layer in self.layers])

    def weights(self, name):
        return [layer.weights[name] for layer in self.layers]

    def args(self, kv_cache=None):
        f = self.first
        biases = self.weights("qkv_bias")
        return (f.delta, f.residual, self.weights("input_norm"), self.weights("qkv_weight"),
                [] if biases[0] is None else biases, self.weights("o_weight"), self.weights("post_norm"),
                self.weights("gate_up_weight"), self.weights("down_weight"), f.cos, f.sin,
                self.kv_cache.clone() if kv_cache is None else kv_cache, f.lengths, f.tree_mask, 1e-5)

    def one_by_one(self, kv_cache):
        """What decoder_layer gives called layer after layer (kv_cache written in place)."""
        f = self.first
        residual, delta = f.residual, f.delta
        for i, layer in enumerate(self.layers):
            w = layer.weights
            residual, delta = ops.decoder_layer(delta, residual, *(w[name] for name in WEIGHTS), f.cos, f.sin,
                                                kv_cache[i], f.lengths, f.tree_mask, 1e-5)
        return residual, delta


def check_decoder_layers(backend, shape, dtype, bias, residual, L, cache_dtype=None):
    B, T, H, Hq, Hkv, D, I, prefix = shape
    layers = Layers(L, B, T, H, Hq, Hkv, D, I, dtype=dtype, bias=bias, residual=residual, prefix=prefix)
    layers.kv_cache = layers.kv_cache.to(cache_dtype or dtype)
    cache = backend.to_device(layers.kv_cache.clone())
    got_residual, got_delta = backend.run("decoder_layers", *layers.args(cache))
    want_cache = layers.kv_cache.clone()
    want_residual, want_delta = reference.decoder_layers(*layers.args(want_cache))
    assert got_delta.shape == (B, T, H) and got_delta.dtype == dtype and got_residual.dtype == dtype
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=1e-1, rtol=1e-1)  # bf16 rounds at every part
    torch.testing.assert_close(got_residual, want_residual, **tol)
    torch.testing.assert_close(got_delta, want_delta, **tol)
    # (a bf16 cache beside float32 rows: a key 1e-7 apart may round to the neighbouring bf16)
    torch.testing.assert_close(cache.cpu(), want_cache, **(TOL[torch.bfloat16] if cache_dtype == torch.bfloat16 else tol))
