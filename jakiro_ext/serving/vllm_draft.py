"""vLLM's draft model for this package's serving-format heads (:mod:`jakiro_ext.serving.format`),
dense or MoE: vLLM's EAGLE Llama draft with ``fc``'s bias (vLLM's own has none), the MoE block in
place of the MLP (:class:`~jakiro_ext.serving.layers.JakiroMoE`, replicated on every tensor-parallel
rank: its output needs no reduction) and the logits outside the head's draft vocabulary at -inf.
vLLM imports this module through the plugin (:mod:`jakiro_ext.serving.plugins`); it drafts a chain
of ``num_speculative_tokens`` from the head's main branch."""
from __future__ import annotations

from jakiro_ext.serving.plugins import require

require("vllm")  # a clear error where this vllm lacks what the class relies on

import torch  # noqa: E402
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

from jakiro_ext.serving.loading import load_draft_weights, set_up_draft


class EagleJakiroLlamaForCausalLM(EagleLlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        c = self.config
        dtype, H = vllm_config.model_config.dtype, c.hidden_size
        self.model.fc = ReplicatedLinear(input_size=2 * H, output_size=H, bias=True, params_dtype=dtype,
                                         prefix=maybe_prefix(maybe_prefix(prefix, "model"), "fc"), return_bias=False)
        set_up_draft(self, c, self.model.layers, dtype)

    def compute_logits(self, hidden_states: torch.Tensor):
        logits = super().compute_logits(hidden_states)
        return None if logits is None else logits.masked_fill(self.blocked[: logits.shape[-1]], float("-inf"))

    def load_weights(self, weights):
        load_draft_weights(self, weights, default_weight_loader)
        # None, as vLLM's own EAGLE drafts return: its check would count the embedding that it
        # shares from the target after loading as missing (ours checked every other parameter).
        return None
