"""The benches' side-by-side runs import the tree they name (``python -c`` puts its working directory ahead of
PYTHONPATH: a child started in one checkout with another on PYTHONPATH runs the first one's code)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def convert_gpu():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("convert_gpu")
    finally:
        sys.path.remove(str(BENCH))


def test_a_tree_command_imports_that_tree(convert_gpu, tmp_path):
    tree = tmp_path / "other"
    (tree / "quantkit").mkdir(parents=True)
    (tree / "quantkit" / "__init__.py").write_text("")
    convert_gpu.check_tree(tree)          # the child runs inside the tree: its quantkit
    convert_gpu.check_tree(None)          # this checkout's


def test_a_directory_without_quantkit_is_refused(convert_gpu, tmp_path):
    with pytest.raises(SystemExit, match="imports quantkit from"):
        convert_gpu.check_tree(tmp_path)
