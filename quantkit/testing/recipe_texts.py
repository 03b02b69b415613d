"""Small recipes and settings the convert and validate tests share."""

#: The tiny tokenizers hash to nothing llama.cpp knows: name a pre-tokenizer.
PRE_TOKENIZER = "qwen2"
#: Routed experts IQ2_XXS / Q2_K: slow enough that a run can be interrupted between tensors.
Q2_RECIPE = """name = "q2-test"
architectures = ["qwen3_moe"]
[defaults]
type = "Q8_0"
[[rule]]
class = "routed_experts"
type = "IQ2_XXS"
[[rule]]
class = "routed_down"
type = "Q2_K"
"""
#: Keeps every source encoding GGUF can hold losslessly (MXFP4/NVFP4 repacks, float copies).
SOURCE_RECIPE = """name = "source-test"
architectures = ["qwen3_moe", "deepseek_v4"]
[defaults]
type = "Q8_0"
[[rule]]
class = "routed_experts"
type = "source"
"""
#: F32 everywhere, the source-precision classes (hc, ape, indexer) included: what llama.cpp's ``--outtype f32``
#: writes, and what llama.cpp runs as transformers does.
F32_RECIPE = """name = "f32-interop"
architectures = ["deepseek_v4", "glm5_next", "qwen4_exp", "qwen3_moe", "deepseek_v3"]
[defaults]
type = "F32"
[[rule]]
class = "hc"
type = "F32"
[[rule]]
class = "ape"
type = "F32"
[[rule]]
class = "indexer"
type = "F32"
"""
#: A Q2 release layout (IQ2_XXS / Q2_K routed experts, Q8_0 elsewhere) with fallbacks for rows these types cannot
#: hold, for the architectures without a shipped one.
Q2_FALLBACK_RECIPE = """name = "q2-interop"
architectures = ["qwen3_moe", "deepseek_v3"]
[defaults]
type = "Q8_0"
[[rule]]
class = "routed_experts"
type = "IQ2_XXS"
fallback = "IQ4_NL"
[[rule]]
class = "routed_down"
type = "Q2_K"
fallback = "Q4_0"
"""
