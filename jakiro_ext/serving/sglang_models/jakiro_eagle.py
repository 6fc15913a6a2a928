"""SGLang's draft model for this package's serving-format heads (:mod:`jakiro_ext.serving.format`),
dense or MoE: SGLang's EAGLE Llama draft with the MoE block in place of the MLP
(:class:`~jakiro_ext.serving.layers.JakiroMoE`) and the logits outside the head's draft vocabulary
at -inf. Found by SGLang through ``SGLANG_EXTERNAL_MODEL_PACKAGE=jakiro_ext.serving.sglang_models``
or the plugin (:mod:`jakiro_ext.serving.plugins`); SGLang's EAGLE worker drafts its top-k tree
from the head's main branch."""
from __future__ import annotations

from jakiro_ext.serving.plugins import require

require("sglang")  # a clear error where this sglang lacks what the class relies on

from sglang.srt.distributed import get_tensor_model_parallel_world_size
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle

from jakiro_ext.serving.format import ARCHITECTURE
from jakiro_ext.serving.loading import load_draft_weights, set_up_draft


class EagleJakiroLlamaForCausalLM(LlamaForCausalLMEagle):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        moe = set_up_draft(self, config, self.model.layers, self.model.fc.weight.dtype)
        if moe and get_tensor_model_parallel_world_size() > 1:
            # SGLang's layer boundary sums the MLP's output over the ranks; the MoE block is
            # replicated, not sharded: its output would be counted once per rank.
            raise ValueError(f"{ARCHITECTURE}: a MoE draft head runs in SGLang with tensor parallelism 1 only "
                             f"(got {get_tensor_model_parallel_world_size()}); serve it with vLLM for more")
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
        self.reduced_vocabulary = load_draft_weights(self, weights, default_weight_loader)


EntryClass = [EagleJakiroLlamaForCausalLM]
