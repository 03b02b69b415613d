"""The tiny example model bundled with the package (the README's first command runs on it)."""
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent


def example_model_dir() -> Path:
    """Directory of the bundled tiny MoE checkpoint (safetensors + config + tokenizer)."""
    return EXAMPLES / "tiny-moe"
