"""The tiny example model bundled with the package (the README's first command runs on it), and what comes with it.

Everything here is made by ``scripts/train_example_model.py`` (see its docstring for the model and the corpus):

``tiny-moe/``                          the trained BF16 Qwen3-MoE checkpoint with its tokenizer and
                                       ``quantkit_training.json`` (corpus files with SHA-256, hyper-parameters,
                                       loss curve, final train/held-out loss, versions)
``tiny-moe-text/calibration.txt``      held-out standard-library text the imatrix was collected on
``tiny-moe-text/prompts.jsonl``        the fixture prompts (other held-out standard-library files)
``tiny-moe.imatrix.gguf``              the imatrix (``quantkit imatrix collect``)
``tiny-moe-fixture/``                  the fixture captured from the checkpoint, label :data:`FIXTURE_LABEL`
``recipes/*.toml``                     recipes for the example's measurements (F16, Q4_K, a Q2-class layout)
"""
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
MODEL_DIR = "tiny-moe"
MANIFEST = "quantkit_training.json"
TEXT_DIR = "tiny-moe-text"
CALIBRATION_TEXT = "calibration.txt"
PROMPTS = "prompts.jsonl"
IMATRIX = "tiny-moe.imatrix.gguf"
FIXTURE_DIR = "tiny-moe-fixture"
FIXTURE_LABEL = "tiny-moe-v1"
RECIPES_DIR = "recipes"
#: llama.cpp pre-tokenizer name of the example's tokenizer (Qwen3.5's pipeline over a small BPE whose check-text
#: hash llama.cpp's table does not know): ``quantkit convert ... --pre-tokenizer`` needs it.
PRE_TOKENIZER = "qwen35"


def example_model_dir() -> Path:
    """Directory of the bundled tiny MoE checkpoint (safetensors + config + tokenizer + training manifest)."""
    return EXAMPLES / MODEL_DIR


def example_manifest() -> Path:
    """The training manifest of the bundled model (``quantkit_training.json``)."""
    return example_model_dir() / MANIFEST


def example_imatrix() -> Path:
    """The imatrix collected from the bundled model on held-out standard-library text."""
    return EXAMPLES / IMATRIX


def example_fixture_dir() -> Path:
    """The fixture captured from the bundled model (label :data:`FIXTURE_LABEL`)."""
    return EXAMPLES / FIXTURE_DIR


def example_calibration_text() -> Path:
    return EXAMPLES / TEXT_DIR / CALIBRATION_TEXT


def example_prompts() -> Path:
    return EXAMPLES / TEXT_DIR / PROMPTS


def example_recipe(name: str) -> Path:
    """A recipe made for the example (``quantkit/examples/recipes/<name>.toml``)."""
    return EXAMPLES / RECIPES_DIR / f"{name}.toml"
