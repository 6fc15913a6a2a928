"""This package's fused ops inside other projects' decoding loops (each module imports its peer, so
import the one you use; none is imported by ``jakiro_ext`` itself):

- :mod:`jakiro_ext.integrations.eagle`: EAGLE's own reference code (PyPI ``eagle-llm``): its
  tree attention, its posterior evaluation and its KV commit replaced by ``tree_attention``,
  ``verify_tree`` and ``compact_kv``, behind a switch (:func:`~jakiro_ext.integrations.eagle.use_jakiro_ops`).
- :mod:`jakiro_ext.integrations.medusa`: Medusa's reference code (PyPI ``medusa-llm``), the same
  places, and its typical acceptance by ``verify_tree``'s lossless sampling.
- :mod:`jakiro_ext.integrations.kv_llama`: what those two share (their KV Llama is one code): the
  patched functions, and the fixes that make that code run on transformers 5 at all.
- :mod:`jakiro_ext.integrations.transformers`: an attention implementation registered with
  transformers (``attn_implementation="jakiro_tree"``) that verifies a tree with ``tree_attention``
  from the mask the model is given, and the KV commit of a ``DynamicCache`` after ``verify_tree``.

The contracts these rely on, and the schema version: docs/integrations.md.
"""
