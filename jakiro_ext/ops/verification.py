"""Verification and its commit: ``verify_tree`` (the longest accepted path and the bonus token),
``compact_kv`` (the accepted path's cache entries kept), and the GPU kernels' error word
(``device_errors``)."""
from __future__ import annotations

import torch

from jakiro_ext.ops.backends import kernel, same_device
from jakiro_ext.ops.library import compiled_available


def verify_tree(parents, draft_tokens, target_logits, uniforms=None, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0):
    """Accept the longest valid path of each draft tree.

    Parameters
    ----------
    parents : [B, T] int64, parents[b, 0] = -1 (root), 0 <= parents[b, i] < i.
    draft_tokens : [B, T] int64, the token of each node (that of the root is not tested).
    target_logits : [B, T, V], the target's logits at each node (predicting its children).
    uniforms : [B, T + 1] float64 draws in [0, 1), needed when temperature > 0: uniforms[b, i]
        decides node i's acceptance test, uniforms[b, T] the bonus token.
    temperature, top_p, top_k : 0 temperature is greedy; otherwise lossless rejection sampling
        against the target distribution filtered by temperature, top-k then top-p.

    Returns
    -------
    path : [B, T] int64, accepted node indices from the root (path[b, 0] = 0), -1 padded.
    accept_len : [B] int64, accepted draft tokens (path length - 1).
    bonus : [B] int64, the token the target adds after the accepted path.
    """
    return kernel("verify_tree")(parents, draft_tokens, target_logits, uniforms, temperature, top_p, top_k)


def compact_kv(cache, prefix_lens, path, path_len) -> None:
    """In place: for every sequence b, copy cache entries prefix_lens[b] + path[b, j] to
    prefix_lens[b] + j for j < path_len[b]. cache [..., B, H, S, D] contiguous (e.g. all
    layers' K and V in one buffer); path [B, P] int64 increasing tree indices."""
    kernel("compact_kv")(cache, prefix_lens, path, path_len)


# What each bit of jakiro::device_errors means (DeviceError in csrc/cuda/device.h): the value a
# GPU kernel met where the CPU op would have raised, and what the kernel did instead.
DEVICE_ERRORS = {
    1: "jakiro::tree_attention: prefix_lens[b] + tree tokens beyond [0, cache capacity] (no key was read)",
    2: "jakiro::rope_kv_write: lengths[b] + new tokens beyond [0, cache capacity] (k and v were not written)",
    4: "jakiro::compact_kv: prefix_lens, path_len or path out of range, or path not strictly increasing "
       "(the sequence's entries were not moved)",
    8: "jakiro::verify_tree: parents are not a tree in topological order (parents[b, 0] = -1, "
       "0 <= parents[b, i] < i)",
    16: "jakiro::verify_tree: a draft token id outside the vocabulary [0, target_logits.shape[2])",
    32: "jakiro::verify_tree: a uniform outside [0, 1)",
    64: "jakiro::dequantize_rows: a row outside the packed weight's [0, N) (its values were set to NaN)",
}


def device_errors(like: torch.Tensor) -> torch.Tensor:
    """The bad index values the GPU kernels met on ``like``'s device since the last call, as
    :data:`DEVICE_ERRORS` bits in an int32 [1] tensor on that device, read and cleared in stream
    order (no synchronisation: read it with a value the host reads anyway, and pass that to
    :func:`raise_device_errors`). Always 0 on the CPU, whose ops raise at once."""
    if not isinstance(like, torch.Tensor):
        raise TypeError(f"device_errors: like must be a tensor on the device to ask, got {type(like).__name__}")
    return kernel("device_errors")(like)


def raise_device_errors(word: int) -> None:
    """Raise a RuntimeError naming every error of the :func:`device_errors` bits ``word`` (none: return)."""
    if word:
        found = [message for bit, message in DEVICE_ERRORS.items() if word & bit]
        unknown = word & ~sum(DEVICE_ERRORS)
        if unknown:
            found.append(f"unknown error bits {unknown:#x}")
        raise RuntimeError("the GPU kernels met bad input values: " + "; ".join(found))


if compiled_available():  # the fakes (meta implementations), beside their ops
    @torch.library.register_fake("jakiro::verify_tree")
    def _verify_tree_fake(parents, draft_tokens, target_logits, uniforms=None, temperature=0.0, top_p=1.0, top_k=0):
        same_device("verify_tree", parents=parents, draft_tokens=draft_tokens, target_logits=target_logits, uniforms=uniforms)
        B = parents.shape[0]
        return parents.new_empty(parents.shape), parents.new_empty((B,)), parents.new_empty((B,))

    @torch.library.register_fake("jakiro::compact_kv")
    def _compact_kv_fake(cache, prefix_lens, path, path_len):
        same_device("compact_kv", cache=cache, prefix_lens=prefix_lens, path=path, path_len=path_len)
        return None

    @torch.library.register_fake("jakiro::device_errors")
    def _device_errors_fake(like):
        return like.new_empty((1,), dtype=torch.int32)
