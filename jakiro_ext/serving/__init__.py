"""This package's heads served by vLLM and SGLang, without a fork of either.

- :mod:`.format`: the ``serving`` format (``head.save(dir, format="serving")``), dense or MoE heads
  with their draft vocabulary, under one architecture name both plugins register;
- :mod:`.layers`: the MoE block and the whole draft forward in plain PyTorch, static shapes (what
  the engines run; tested against the head's own forward);
- :mod:`.loading`: the tensors into an engine's draft model (stacked q/k/v and gate/up, every
  parameter checked);
- :mod:`.plugins`: the entry points the engines call (``vllm.general_plugins``,
  ``sglang.srt.plugins``), with a check of the engine internals the classes rely on;
- :mod:`.vllm_draft`, :mod:`.sglang_models`: the engines' draft classes (imported by the engines only).

How to serve a head: docs/serving.md.
"""
