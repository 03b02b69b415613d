"""Regenerate the llama-imatrix reference files in this directory (see README.md).  Not a test.

Usage: python tests/data/imatrix/make_references.py LLAMA_IMATRIX_BINARY [LLAMA_CPP_SRC]

For each of qwen3_moe and deepseek_v3: write the seed-0 tiny checkpoint in float32 (quantkit.testing.tiny_models),
convert it to an F32 GGUF with llama.cpp's own convert_hf_to_gguf.py, record the token ids llama.cpp's tokenizer
gives the calibration text (llama-cpp-python, vocab only, with BOS as the GGUF says), and run llama-imatrix on it.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHS = {"qwen3_moe": "qwen2", "deepseek_v3": "deepseek-v3"}   # architecture -> pre-tokenizer name
CTX = 128
CHUNKS = {"a": 4, "b": 3}
#: llama-imatrix settings for parity with a float32 transformers forward: F32 KV cache, no flash attention
#: (it casts V to F16), one sequence per batch, two threads.
COMMON = ["-c", str(CTX), "-b", str(CTX), "-ub", str(CTX), "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-t", "2",
          "--no-ppl", "--seed", "0"]
CONVERTER = """
import sys
sys.path.insert(0, {src!r} + "/gguf-py")
sys.path.insert(0, {src!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", "f32", "--outfile", {out!r}]
convert_hf_to_gguf.main()
"""


def run(cmd: list[str]) -> None:
    """Run in this directory, so llama-imatrix records the calibration file's name without a machine path."""
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=HERE)


def weights_sha256(model) -> str:
    """SHA-256 over a model's state dict (names, shapes and bytes, in name order): ties the references to the
    tiny model they were made from (tests/test_imatrix_collect.py checks it)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + str(tuple(tensor.shape)).encode()
                      + tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def llama_tokens(gguf_path: Path, text: str) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    return llm.tokenize(text.encode("utf-8"), add_bos=llm.metadata.get("tokenizer.ggml.add_bos_token") == "true",
                        special=False)


def main(binary: str, src: str) -> None:
    from quantkit.testing.tiny_models import build_tiny_model, save_tiny_checkpoint

    manifest = {"ctx": CTX, "chunks": CHUNKS, "llama_imatrix_args": COMMON, "archs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, pre in ARCHS.items():
            model_dir = save_tiny_checkpoint(arch, Path(tmp) / arch, layout="per-expert", encoding="f32")
            gguf_path = Path(tmp) / f"{arch}-f32.gguf"
            script = CONVERTER.format(src=src, pre=pre, model=str(model_dir), out=str(gguf_path))
            run([sys.executable, "-c", script])
            record = {"weights_sha256": weights_sha256(build_tiny_model(arch, dtype="f32")[0]), "gguf_sha256": hashlib.sha256(gguf_path.read_bytes())
                      .hexdigest(), "tokens": {}}
            for part, chunks in CHUNKS.items():
                text_path = HERE / f"calibration-{part}.txt"
                text = text_path.read_text().removesuffix("\n")   # as llama-imatrix reads -f
                record["tokens"][part] = llama_tokens(gguf_path, text)[: chunks * CTX]
                run([binary, "-m", str(gguf_path), "-f", text_path.name, "--chunks", str(chunks), *COMMON,
                     "-o", f"{arch}-{part}.imatrix.gguf"])
            # without a prompt llama-imatrix only loads --in-file and saves (it still wants -m)
            run([binary, "-m", str(gguf_path), "--in-file", f"{arch}-a.imatrix.gguf", "-c", str(CTX),
                 "--output-format", "dat", "-o", f"{arch}-a.imatrix.dat"])
            run([binary, "-m", str(gguf_path), "--in-file", f"{arch}-a.imatrix.gguf", "--in-file",
                 f"{arch}-b.imatrix.gguf", "-c", str(CTX), "-o", f"{arch}-ab.imatrix.gguf"])
            manifest["archs"][arch] = record
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    from quantkit.testing import llama_src

    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else str(llama_src.fetch()))
