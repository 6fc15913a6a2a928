"""The package's layout rules (scripts/check_layout.py): no import circles, no imports inside
functions but the allowed ones, no private imports, no module over 400 lines, inference apart from
training; and the checker itself finds each kind of breach."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_layout.py"


@pytest.fixture(scope="module")
def layout():
    spec = importlib.util.spec_from_file_location("check_layout", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_keeps_its_layout(layout):
    assert layout.problems() == []


def test_the_checker_finds_each_breach(layout, tmp_path, monkeypatch):
    package = tmp_path / "jakiro_ext"
    (package / "engine").mkdir(parents=True)
    (package / "training").mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "training" / "__init__.py").write_text("")
    (package / "a.py").write_text("from jakiro_ext import b\nfrom jakiro_ext.b import _hidden\n")
    (package / "b.py").write_text("import jakiro_ext.a\n\n\ndef f():\n    import json\n" + "x = 1\n" * 401)
    # A circle through an import for annotations only is a circle all the same.
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jakiro_ext.d import D\n")
    (package / "d.py").write_text("from jakiro_ext import c\n")
    (package / "engine" / "run.py").write_text("from jakiro_ext.training import loop\n")
    (package / "training" / "loop.py").write_text("def f():\n    from transformers import AutoModel\n")
    monkeypatch.setattr(layout, "PACKAGE", package)
    found = "\n".join(layout.problems())
    assert "import circle: jakiro_ext.a -> jakiro_ext.b" in found
    assert "a.py:2: imports the private jakiro_ext.b._hidden" in found
    assert "b.py:5: import inside a function: import json" in found
    assert "b.py: 406 lines (at most 400)" in found
    assert "import circle: jakiro_ext.c -> jakiro_ext.d" in found or "import circle: jakiro_ext.d -> jakiro_ext.c" in found
    assert "c.py:3: import inside a function" not in found  # (an annotation-only import is not one)
    assert "engine/run.py: inference imports jakiro_ext.training.loop" in found
    assert "loop.py" not in found  # an optional dependency may be imported where it is used


def test_importing_the_package_leaves_the_lazy_imports_unloaded(tmp_path):
    # A CUDA build of torch on a GPU-less machine warns on stderr when cpp_extension is imported,
    # which would break the CLI's one-line errors; the optional dependencies cost start-up time.
    code = ("import sys, jakiro_ext, jakiro_ext.cli, jakiro_ext.engine.generate\n"
            "print(' '.join(m for m in ('torch.utils.cpp_extension', 'transformers', 'matplotlib') if m in sys.modules))")
    # cwd outside the repository: the installed package, as the CLI tests run it.
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ""
