import pytest

from quantkit.testing import ggml_ref


@pytest.fixture(scope="session")
def ggml():
    """ggml's reference encoders (llama-cpp-python's libggml-base); the interop extra must be installed."""
    if not ggml_ref.available():
        pytest.fail("llama-cpp-python (the interop extra) is required for byte-identity tests")
    return ggml_ref
