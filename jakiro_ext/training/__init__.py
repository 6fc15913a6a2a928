"""Training draft heads: the token corpus (``corpus``), the target's cached features
(``features``, ``feature_cache``), examples and batches (``examples``), the loss (``loss``), the
loop and its checkpoints (``train``), data parallelism (``distributed``), and a head's acceptance
profile (``acceptance``). Inference never imports this package."""
