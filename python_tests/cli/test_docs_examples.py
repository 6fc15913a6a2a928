"""The Python examples of the README and docs/api.md run as written, in order, each file's blocks
in one namespace (a later block uses what an earlier one made), in a fresh directory. "Your model,
your head" gets the default model's transformers directory for its ``MODEL_DIR``."""
import re

import pytest

from conftest import TESTS
from jakiro_ext.models.default import default_model_dir

ROOT = TESTS.parent
YOUR_MODEL = '"path/to/your/model"'


def python_blocks(doc: str) -> list:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)


@pytest.mark.parametrize("doc,blocks", [("README.md", 1), ("docs/api.md", 4)])
def test_the_docs_python_examples_run_as_written(doc, blocks, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = python_blocks(doc)
    assert len(found) == blocks, f"{doc} has {len(found)} Python examples; this test expects {blocks}"
    namespace = {}
    for i, block in enumerate(found):
        code = block.replace(YOUR_MODEL, repr(str(default_model_dir())))
        exec(compile(code, f"{doc}, example {i + 1}", "exec"), namespace)
    if YOUR_MODEL in "".join(found):  # the trained head was saved and decoded losslessly (the example asserts it)
        assert (tmp_path / "my-head" / "model.safetensors").is_file() and namespace["history"]
