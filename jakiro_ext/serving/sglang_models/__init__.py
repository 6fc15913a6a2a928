"""SGLang's external model package for this package's heads: ``SGLANG_EXTERNAL_MODEL_PACKAGE=
jakiro_ext.serving.sglang_models`` (or the ``sglang.srt.plugins`` entry point, which registers it)."""
