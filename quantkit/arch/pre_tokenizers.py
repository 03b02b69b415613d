"""The pre-tokenizer names llama.cpp accepts in ``tokenizer.ggml.pre`` (for BPE vocabularies).

llama.cpp refuses to load a GGUF whose ``tokenizer.ggml.pre`` it does not know ("unknown pre-tokenizer type"), so
a name given with ``--pre-tokenizer`` is checked here before any work.  The table is llama.cpp's own list, copied
from ``llama_vocab::impl::load`` in ``src/llama-vocab.cpp`` of the llama.cpp vendored by llama-cpp-python 0.3.36;
``tests/test_recipes_cli.py`` reads that source and fails when the two differ, so the table is never trusted
blindly.
"""
from __future__ import annotations

import difflib

from ..errors import SourceError

#: Every name in llama.cpp's pre-tokenizer chain (``tokenizer_pre == "..."``), sorted.
LLAMA_CPP_PRE_TOKENIZERS: frozenset[str] = frozenset({
    "a.x-4.0", "afmoe", "bailingmoe", "bailingmoe2", "bloom", "chameleon", "chatglm-bpe", "codeshell",
    "cohere2moe", "command-r", "dbrx", "deepseek-coder", "deepseek-llm", "deepseek-r1-qwen", "deepseek-v3",
    "default", "exaone", "exaone-moe", "exaone4", "f2llmv2", "falcon", "falcon-h1", "falcon3", "gemma4",
    "gigachat", "glm4", "glm5", "gpt-2", "gpt-4o", "gpt3-finnish", "granite-docling", "granite-embed-multi-311m",
    "granite-embed-multi-97m", "grok-2", "hunyuan", "hunyuan-dense", "hy_v4", "jais", "jais-2", "jina-de",
    "jina-es", "jina-v1-en", "jina-v2-code", "jina-v2-de", "jina-v2-es", "jina-v5-nano", "joyai-llm", "kanana2",
    "kimi-k2", "kormo", "laguna", "lfm2", "llada-moe", "llama-bpe", "llama-v3", "llama3", "llama4", "megrez",
    "mellum", "mellum2", "midm-2.0", "minerva-7b", "minicpm5", "minimax-m2", "modern-bert", "mpt", "olmo",
    "phi-2", "pixtral", "poro-chat", "qwen2", "qwen35", "refact", "roberta-bpe", "sarvam-moe", "seed-coder",
    "smaug-bpe", "smollm", "solar-open", "spark2_5", "stablelm2", "starcoder", "superbpe", "talkie", "tekken",
    "tiny_aya", "trillion", "ufakzeka", "viking", "whitespace", "youtu",
})


def check_pre_tokenizer(name: str) -> str:
    """``name`` if llama.cpp knows it; otherwise :class:`SourceError` naming the closest known names."""
    if name in LLAMA_CPP_PRE_TOKENIZERS:
        return name
    close = difflib.get_close_matches(name, sorted(LLAMA_CPP_PRE_TOKENIZERS), n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise SourceError(f"--pre-tokenizer {name!r} is not a pre-tokenizer llama.cpp knows (it would refuse the file); "
                      f"{hint}known: {', '.join(sorted(LLAMA_CPP_PRE_TOKENIZERS))}", field="pre_tokenizer")
