import pytest

from quantkit import ggml_ref


@pytest.fixture(scope="session")
def ggml():
    """ggml's reference encoders (llama-cpp-python's libggml-base); the interop extra must be installed."""
    if not ggml_ref.available():
        pytest.fail("llama-cpp-python (the interop extra) is required for byte-identity tests")
    return ggml_ref


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny seeded checkpoints of every architecture, each built once per test session."""
    from quantkit.testing.tiny_models import TinyCheckpointCache

    return TinyCheckpointCache(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def llama_cpp_src():
    """llama.cpp's source tree from the llama-cpp-python sdist (``python -m quantkit.testing.llama_src``)."""
    from quantkit.testing import llama_src

    tree = llama_src.source_dir()
    if not (tree / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp source not found at {tree}: run python -m quantkit.testing.llama_src")
    return tree
