"""Every command line the README and the docs show (their bash blocks) is one the CLI takes: its
command and options parse as written, and the repository paths it names exist. (What each command
does is the other CLI tests'; test_docs_examples.py runs the Python examples.)"""
import re
import shlex

import pytest

from conftest import TESTS
from jakiro_ext.cli import build_parser

ROOT = TESTS.parent
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                              if not p.name.startswith("benchmarks"))


def documented_commands(doc: str) -> list:
    """The ``jakiro_ext`` command lines of a file's bash blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "jakiro_ext" in words and words[words.index("jakiro_ext") - 1] == "-m":
                commands.append(words[words.index("jakiro_ext") + 1:])
    return commands


def test_the_docs_show_commands():
    assert sum(len(documented_commands(doc)) for doc in DOCS) >= 10


@pytest.mark.parametrize("doc", DOCS)
def test_every_documented_command_parses_and_names_paths_that_exist(doc, capsys):
    parser = build_parser()
    for argv in documented_commands(doc):
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{doc}: `python -m jakiro_ext {shlex.join(argv)}` is refused: {capsys.readouterr().err}")
        for option, value in zip(argv, argv[1:]):
            if option == "--data" and value.startswith("corpus/"):  # the committed corpus
                assert (ROOT / value / "corpus.json").is_file(), f"{doc}: {value} is not in the repository"
