"""SGLang's draft model for this package's serving-format heads (:mod:`jakiro_ext.serving.format`),
dense or MoE: SGLang's EAGLE Llama draft with the MoE block in place of the MLP
(:class:`~jakiro_ext.serving.layers.JakiroMoE`) and the logits outside the head's draft vocabulary
at -inf. Found by SGLang through ``SGLANG_EXTERNAL_MODEL_PACKAGE=jakiro_ext.serving.sglang_models``
or the plugin (:mod:`jakiro_ext.serving.plugins`); SGLang's EAGLE worker drafts its top-k tree
from the head's main branch."""
from __future__ import annotations

from jakiro_ext.serving.plugins import require

require("sglang")  # a clear error where this sglang lacks what the class relies on

import torch  # noqa: E402
from sglang.srt.distributed import get_tensor_model_parallel_world_size
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle

from jakiro_ext.serving.format import ARCHITECTURE, settings
from jakiro_ext.serving.layers import JakiroMoE
from jakiro_ext.serving.loading import blocked_tokens, load_serving_weights


class EagleJakiroLlamaForCausalLM(LlamaForCausalLMEagle):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        own = settings({"jakiro": getattr(config, "jakiro", None)}, f"the {ARCHITECTURE} draft's config.json")
        if own.get("num_experts"):
            if get_tensor_model_parallel_world_size() > 1:
                # SGLang's layer boundary sums the MLP's output over the ranks; the MoE block is
                # replicated, not sharded: its output would be counted once per rank.
                raise ValueError(f"{ARCHITECTURE}: a MoE draft head runs in SGLang with tensor parallelism 1 only "
                                 f"(got {get_tensor_model_parallel_world_size()}); serve it with vLLM for more")
            dtype = self.model.fc.weight.dtype
            for layer in self.model.layers:
                layer.mlp = JakiroMoE(config.hidden_size, own["expert_intermediate_size"], own["num_experts"],
                                      bool(own.get("renormalize")), dtype=dtype)
        self.register_buffer("blocked", torch.zeros(config.vocab_size, dtype=torch.bool), persistent=False)
        self.reduced_vocabulary = False

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        logits = getattr(out, "next_token_logits", None)
        # (Over the whole vocabulary only: with --speculative-token-map the logits are over that
        # map's tokens, which then decide what is drafted.)
        if self.reduced_vocabulary and logits is not None and logits.shape[-1] == self.blocked.numel():
            out.next_token_logits = logits.masked_fill(self.blocked, float("-inf"))
        return out

    def load_weights(self, weights):
        draft_to_target = load_serving_weights(self, weights, default_weight_loader)
        if draft_to_target is not None:
            self.blocked.copy_(blocked_tokens(draft_to_target, self.config.vocab_size))
            self.reduced_vocabulary = True


EntryClass = [EagleJakiroLlamaForCausalLM]
