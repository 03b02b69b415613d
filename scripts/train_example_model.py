"""Train quantkit's bundled example model on the Python standard library, and bundle what the demo needs with it.

The model (:func:`example_config`): a 4-layer Qwen3-MoE (hidden 256, 4 query / 2 KV heads of 64, 8 routed experts
of width 256, top-2, no shared expert), vocabulary 512 with the byte-level BPE of
:mod:`quantkit.testing.tiny_tokenizer` (Qwen's specials).  Every weight row is a multiple of 256, so every GGUF
block type, K-quants and IQ types included, applies to every matrix; 7.35 M parameters, 14.7 MB in BF16.

The corpus (:data:`TRAIN_FILES`, :data:`EVAL_FILES`, :data:`CALIBRATION_FILES`, :data:`PROMPT_FILES`): source
files of Python 3.11's standard library (PSF licence), disjoint lists, named by path relative to the stdlib
directory and recorded with their SHA-256 in the manifest, so anyone can check that their stdlib is the one the
model saw (one CPython patch release always ships the same files).  Documents are joined with ``<|endoftext|>``.
The tokenizer's own corpus (``tiny_tokenizer.CORPUS_FILES``) is part of the training files.  Training sees only
:data:`TRAIN_FILES`; :data:`EVAL_FILES` give the held-out loss, :data:`CALIBRATION_FILES` the imatrix text and
:data:`PROMPT_FILES` the fixture prompts, so calibration and scoring never share text.

Training (:func:`train`): float32 on CPU, AdamW, linear warm-up then cosine decay, gradient clipping, and a
per-layer load-balancing loss (:func:`balance_loss`, so every expert of every layer is used and calibrated);
``TRAIN_STEPS`` batches of ``BATCH`` windows of ``SEQ`` tokens drawn from a generator seeded with the seed.  The
CPU kernels involved are deterministic for a fixed thread count (``TORCH_THREADS``; torch's deterministic mode is
not needed and made a step 5x slower), so the run repeats bit for bit on one machine and torch build; another CPU
may round matrix products differently, so the recorded losses are what this build measured.

Stages (``python scripts/train_example_model.py STAGE``):

``train``    train and write the BF16 release (transformers' ``save_pretrained``), tokenizer and
             ``quantkit_training.json`` (corpus manifest, hyper-parameters, loss curve, final train/held-out loss,
             versions) to ``quantkit/examples/tiny-moe/``;
``bundle``   write the held-out calibration text and the prompts, then run ``quantkit imatrix collect`` and
             capture the fixture (label ``quantkit.examples.FIXTURE_LABEL``, :func:`capture`) from the release;
``all``      both;
``measure``  convert the release with each recipe of :data:`MEASURED`, score every artifact on the fixture,
             compare them (:data:`COMPARED`) and write ``bench/results/example-model-<date>.md``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantkit import examples  # noqa: E402
from quantkit.testing import tiny_tokenizer  # noqa: E402
from quantkit.testing.tiny_models import build_tiny_tokenizer, release_copy  # noqa: E402

ARCH = "qwen3_moe"
MODEL_CLASS = "Qwen3MoeForCausalLM"
AUTO_CLASS = "AutoModelForCausalLM"
DOC_SEPARATOR = "<|endoftext|>"

# -- corpus: paths relative to the stdlib directory, disjoint lists -------------------------------------------------
TRAIN_FILES = (
    "abc.py", "argparse.py", "ast.py", "base64.py", "bdb.py", "bisect.py", "bz2.py", "cmd.py", "code.py",
    "codecs.py", "colorsys.py", "compileall.py", "configparser.py", "contextlib.py", "copy.py", "csv.py",
    "dataclasses.py", "datetime.py", "dis.py", "doctest.py", "enum.py", "filecmp.py", "fileinput.py", "fnmatch.py",
    "ftplib.py", "functools.py", "genericpath.py", "getopt.py", "gettext.py", "glob.py", "graphlib.py", "gzip.py",
    "hashlib.py", "heapq.py", "hmac.py", "imaplib.py", "inspect.py", "io.py", "ipaddress.py", "keyword.py",
    "linecache.py", "locale.py", "logging/__init__.py", "logging/handlers.py", "lzma.py", "mailbox.py",
    "mimetypes.py", "modulefinder.py", "netrc.py", "ntpath.py", "numbers.py", "opcode.py", "operator.py",
    "optparse.py", "os.py", "pathlib.py", "pdb.py", "pickle.py", "pkgutil.py", "platform.py", "plistlib.py",
    "poplib.py", "posixpath.py", "profile.py", "pstats.py", "py_compile.py", "pyclbr.py", "queue.py",
    "quopri.py", "random.py", "reprlib.py", "rlcompleter.py", "runpy.py", "sched.py", "secrets.py", "selectors.py",
    "shelve.py", "shlex.py", "shutil.py", "signal.py", "site.py", "smtplib.py", "socket.py", "socketserver.py",
    "ssl.py", "stat.py", "statistics.py", "string.py", "stringprep.py", "struct.py", "subprocess.py", "symtable.py",
    "sysconfig.py", "tabnanny.py", "tempfile.py", "textwrap.py", "threading.py", "timeit.py", "token.py",
    "tokenize.py", "trace.py", "traceback.py", "tracemalloc.py", "types.py", "typing.py", "uuid.py", "warnings.py",
    "wave.py", "weakref.py", "webbrowser.py", "zipapp.py", "zipfile.py", "zipimport.py",
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py",
    "collections/__init__.py", "email/message.py", "email/utils.py", "email/feedparser.py",
    "email/_header_value_parser.py", "http/client.py", "http/server.py", "http/cookiejar.py",
    "urllib/parse.py", "urllib/request.py", "concurrent/futures/_base.py", "concurrent/futures/process.py",
    "concurrent/futures/thread.py", "asyncio/base_events.py", "asyncio/events.py", "asyncio/futures.py",
    "asyncio/locks.py", "asyncio/queues.py", "asyncio/streams.py", "asyncio/tasks.py", "unittest/case.py",
    "unittest/mock.py", "unittest/loader.py", "unittest/result.py", "unittest/runner.py", "xml/dom/minidom.py",
    "xml/etree/ElementTree.py", "importlib/_bootstrap.py", "importlib/_bootstrap_external.py",
    "sqlite3/__init__.py", "sqlite3/dump.py", "re/_compiler.py", "re/_parser.py", "re/__init__.py",
)
#: The corpus is this minor version's stdlib (3.13 removed smtpd, cgi and nntplib; files change between releases).
CORPUS_PYTHON = (3, 11)
EVAL_FILES = ("fractions.py", "pprint.py", "calendar.py")
CALIBRATION_FILES = ("tarfile.py", "difflib.py")
PROMPT_FILES = ("pickletools.py", "smtpd.py", "cgi.py", "nntplib.py")

# -- model and training ---------------------------------------------------------------------------------------------
DEFAULT_SEED = 0
HIDDEN = 256
LAYERS = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 256
ROUTER_AUX_COEF = 0.01
SEQ = 256
BATCH = 16
TRAIN_STEPS = 300
WARMUP_STEPS = 20
PEAK_LR = 3e-3
FINAL_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
CLIP_NORM = 1.0
TORCH_THREADS = 1          # on a shared 2-core machine a second thread mostly spins
LOG_EVERY = 20
EVAL_WINDOWS = 24          # held-out windows of SEQ tokens (the first ones of the eval text)

# -- bundle ---------------------------------------------------------------------------------------------------------
FIXTURE_TOKENS = 24
FIXTURE_TOP_LOGPROBS = 20
N_PROMPTS = 100
PROMPT_MIN_CHARS = 200     # a prompt is whole lines, at least this long and at most PROMPT_MAX_CHARS
PROMPT_MAX_CHARS = 480
IMATRIX_CTX = 256


def stdlib_dir() -> Path:
    if sys.version_info[:2] != CORPUS_PYTHON:
        raise SystemExit(f"the example's corpus is Python {'.'.join(map(str, CORPUS_PYTHON))}'s standard library; "
                         f"this is Python {platform.python_version()}")
    return Path(sysconfig.get_paths()["stdlib"])


def file_manifest(names) -> list[dict]:
    """``{"path", "bytes", "sha256"}`` of each stdlib file, in order."""
    out = []
    for name in names:
        data = (stdlib_dir() / name).read_bytes()
        out.append({"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return out


def corpus_text(names) -> list[str]:
    return [(stdlib_dir() / name).read_text(encoding="utf-8") for name in names]


def token_stream(tokenizer, names) -> list[int]:
    """The files' tokens, each document followed by ``<|endoftext|>``."""
    sep = tokenizer.convert_tokens_to_ids(DOC_SEPARATOR)
    ids = []
    for text in corpus_text(names):
        ids.extend(tokenizer(text, add_special_tokens=False).input_ids)
        ids.append(sep)
    return ids


def example_tokenizer():
    return build_tiny_tokenizer(ARCH)


def example_config(tokenizer):
    from transformers import Qwen3MoeConfig

    from quantkit.testing.tiny_tokenizer import MODEL_VOCAB_SIZE

    return Qwen3MoeConfig(
        vocab_size=MODEL_VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        moe_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
        router_aux_loss_coef=ROUTER_AUX_COEF, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(DOC_SEPARATOR),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids(DOC_SEPARATOR))


def learning_rate(step: int, steps: int) -> float:
    """Linear warm-up to PEAK_LR, then cosine decay to FINAL_LR_FRACTION * PEAK_LR at the last step."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - 1 - WARMUP_STEPS)
    return PEAK_LR * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def eval_windows(ids: list[int], n: int):
    """The first ``n`` non-overlapping SEQ-token windows of ``ids`` as a LongTensor ``[n, SEQ]``."""
    import torch

    n = min(n, len(ids) // SEQ)
    return torch.tensor(ids[:n * SEQ], dtype=torch.long).view(n, SEQ)


def mean_loss(model, windows, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over ``windows`` (no router loss)."""
    import torch

    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(windows), batch):
            x = windows[start:start + batch]
            logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    return total / count


def initial_model(config, seed: int):
    """The float32 model under ``manual_seed(seed)`` (transformers' own initialisation); the caller's RNG state is
    left untouched."""
    import torch
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return getattr(transformers, MODEL_CLASS)(config)


def balance_loss(router_logits, top_k: int):
    """Switch-Transformer load balance, per layer then averaged: ``E * sum_e f_e * P_e`` with ``f_e`` the share of
    top-k slots routed to expert ``e`` and ``P_e`` its mean router probability.  (transformers' own aux loss pools
    all layers' tokens, so one layer may starve an expert that another overuses; here each layer must balance.)"""
    import torch

    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices
        share = torch.zeros_like(probs).scatter_(1, chosen, 1.0).mean(dim=0) / top_k
        losses.append(probs.shape[-1] * (share * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def expert_shares(model, windows) -> list[list[float]]:
    """Per layer, the share of top-k routing slots each expert gets over ``windows``."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=windows, output_router_logits=True, use_cache=False)
    top_k, n = model.config.num_experts_per_tok, model.config.num_experts
    return [[round(float(c), 4) for c in torch.bincount(logits.topk(top_k, dim=-1).indices.reshape(-1), minlength=n)
             / (logits.shape[0] * top_k)] for logits in out.router_logits]


def train(model, train_ids: list[int], eval_ids: list[int], seed: int, steps: int, batch: int = BATCH,
          log=print) -> dict:
    """Train ``model`` in place (module doc); return the log: loss curve, final train and held-out loss."""
    import torch

    data = torch.tensor(train_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=PEAK_LR, betas=BETAS)
    held_out = eval_windows(eval_ids, EVAL_WINDOWS)
    curve = []
    window_loss, window_n, started = 0.0, 0, time.monotonic()
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        starts = torch.randint(0, len(data) - SEQ - 1, (batch,), generator=generator)
        x = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        lm_loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]).float(),
                                                    x[:, 1:].reshape(-1))
        loss = lm_loss + ROUTER_AUX_COEF * balance_loss(out.router_logits, model.config.num_experts_per_tok)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
        window_loss += float(lm_loss.detach())
        window_n += 1
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            entry = {"step": step + 1, "train_loss": round(window_loss / window_n, 4),
                     "seconds": round(time.monotonic() - started, 1)}
            curve.append(entry)
            log(json.dumps(entry))
            window_loss, window_n = 0.0, 0
    model.eval()
    return {"curve": curve, "train_seconds": round(time.monotonic() - started, 1),
            "eval_tokens": int(held_out[:, 1:].numel()), "held_out_loss_f32": round(mean_loss(model, held_out), 4)}


def write_release(release, tokenizer, out: Path, manifest: dict) -> None:
    """The BF16 release, the tokenizer and the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    release.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)     # written private; package data must be readable to all
    tokenizer.save_pretrained(out)
    (out / examples.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def build(out: Path, seed: int = DEFAULT_SEED, steps: int = TRAIN_STEPS, log=print) -> dict:
    """Train the example and write its release to ``out``; return the manifest."""
    import torch
    import transformers

    tokenizer = example_tokenizer()
    config = example_config(tokenizer)
    train_ids = token_stream(tokenizer, TRAIN_FILES)
    eval_ids = token_stream(tokenizer, EVAL_FILES)
    model = initial_model(config, seed)
    result = train(model, train_ids, eval_ids, seed, steps, log=log)
    release = release_copy(model, AUTO_CLASS)
    held_out = eval_windows(eval_ids, EVAL_WINDOWS)
    train_sample = eval_windows(train_ids, EVAL_WINDOWS)
    manifest = {
        "builder": "scripts/train_example_model.py", "seed": seed, "architecture": ARCH,
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": {"source": "Python standard library source files (PSF licence)",
                   "python": platform.python_version(), "separator": DOC_SEPARATOR,
                   "tokenizer": file_manifest(tiny_tokenizer.CORPUS_FILES),
                   "train": file_manifest(TRAIN_FILES), "eval": file_manifest(EVAL_FILES),
                   "calibration": file_manifest(CALIBRATION_FILES), "prompts": file_manifest(PROMPT_FILES),
                   "train_tokens": len(train_ids), "eval_tokens": len(eval_ids)},
        "training": {"steps": steps, "batch": BATCH, "seq": SEQ, "tokens_seen": steps * BATCH * SEQ,
                     "peak_lr": PEAK_LR, "warmup_steps": WARMUP_STEPS, "final_lr_fraction": FINAL_LR_FRACTION,
                     "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "clip_norm": CLIP_NORM,
                     "router_aux_loss_coef": ROUTER_AUX_COEF, "torch_threads": TORCH_THREADS,
                     "seconds": result["train_seconds"], "curve": result["curve"]},
        "loss": {"unit": "nats/token", "eval_windows": int(held_out.shape[0]), "seq": SEQ,
                 "held_out_f32": result["held_out_loss_f32"],
                 "held_out_bf16": round(mean_loss(release, held_out), 4),
                 "train_bf16": round(mean_loss(release, train_sample), 4),
                 "uniform": round(math.log(config.vocab_size), 4)},
        "expert_shares_held_out": expert_shares(release, held_out),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    write_release(release, tokenizer, out, manifest)
    return manifest


# -- bundle -----------------------------------------------------------------------------------------------------------

def calibration_text() -> str:
    """The imatrix text: :data:`CALIBRATION_FILES`, each followed by a blank line."""
    return "".join(text.rstrip("\n") + "\n\n" for text in corpus_text(CALIBRATION_FILES))


def prompt_snippets(n: int = N_PROMPTS) -> list[tuple[str, str]]:
    """``n`` prompts ``(id, text)`` from :data:`PROMPT_FILES`: whole lines from a non-blank line on, between
    PROMPT_MIN_CHARS and PROMPT_MAX_CHARS long, starting at (or after) ``n`` evenly spaced lines of the files."""
    lines = []   # (file stem, line number, lines of the file)
    for name, text in zip(PROMPT_FILES, corpus_text(PROMPT_FILES)):
        file_lines = text.splitlines(keepends=True)
        lines.extend((Path(name).stem, i, file_lines) for i in range(len(file_lines)))
    prompts, next_free = [], 0
    for k in range(n):
        i = max(k * len(lines) // n, next_free)
        while i < len(lines):
            stem, line, file_lines = lines[i]
            snippet = _snippet(file_lines, line)
            if snippet is not None:
                prompts.append((f"{stem}-{line + 1:05d}", snippet))
                next_free = i + snippet.count("\n")
                break
            i += 1
    return prompts


def _snippet(file_lines: list[str], start: int) -> str | None:
    if not file_lines[start].strip():
        return None
    text = ""
    for line in file_lines[start:]:
        text += line
        if len(text) >= PROMPT_MIN_CHARS:
            return text if len(text) <= PROMPT_MAX_CHARS else None
    return None


def run_cli(args: list[str], cwd: Path) -> None:
    """Run one ``quantkit`` command in-process from ``cwd`` (so recorded paths are relative to it)."""
    import os

    from quantkit.cli import main as cli

    here = Path.cwd()
    os.chdir(cwd)
    try:
        cli.main(args, prog_name="quantkit", standalone_mode=False)
    finally:
        os.chdir(here)


def bundle(model_dir: Path) -> None:
    """Write the calibration text and prompts next to the model, then collect the imatrix and capture the fixture
    (paths recorded relative to the examples directory)."""
    root = model_dir.parent
    text_dir = root / examples.TEXT_DIR
    text_dir.mkdir(exist_ok=True)
    (text_dir / examples.CALIBRATION_TEXT).write_text(calibration_text(), encoding="utf-8")
    with open(text_dir / examples.PROMPTS, "w", encoding="utf-8") as f:
        for case_id, prompt in prompt_snippets():
            f.write(json.dumps({"id": case_id, "prompt": prompt}) + "\n")
    model = model_dir.name
    run_cli(["imatrix", "collect", model, "--text", f"{examples.TEXT_DIR}/{examples.CALIBRATION_TEXT}",
             "--ctx", str(IMATRIX_CTX), "--no-progress", "--force", "-o", examples.IMATRIX], root)
    capture(model_dir, text_dir / examples.PROMPTS, root / examples.FIXTURE_DIR)


def capture(model_dir: Path, prompts: Path, out: Path) -> None:
    """``quantkit fixture capture`` of the release with transformers as the logit source (float32 compute, the
    runtime's compute dtype).  The bundled fixture was made this way when the packed runtime had no KV cache
    (~40 minutes for 100 cases); the command now generates with a cache and reproduces it exactly (30 of 30
    cases checked, bench/results/fixture-capture-2026-11-30.md), so either source gives this fixture.
    The directory is made readable to all (the fixture writer creates it private), as package data must be."""
    import dataclasses

    import torch
    import transformers

    from quantkit.fixtures.capture import capture_fixture, read_prompts
    from quantkit.fixtures.tokens import Rendering
    from quantkit.scoring.loading import describe_model
    from quantkit.scoring.source import TransformersSource

    codec, identity = describe_model(model_dir)
    identity = dataclasses.replace(identity, path=model_dir.name)    # relative to the examples directory
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = capture_fixture(TransformersSource(model, identity), codec, read_prompts(prompts), out,
                             label=examples.FIXTURE_LABEL, tokens=FIXTURE_TOKENS, top_logprobs=FIXTURE_TOP_LOGPROBS,
                             rendering=Rendering("raw"), overwrite=True)
    out.chmod(0o755)
    print(f"fixture {out}: {len(result.cases)} cases, {sum(len(c.response) for c in result.cases)} target tokens")


# -- measure ----------------------------------------------------------------------------------------------------------

#: (artifact name, recipe, extra convert arguments), in the expected NLL order.
MEASURED = (
    ("F16", "recipes/tiny-moe-f16.toml", ()),
    ("Q8_0", "q8_0", ()),
    ("Q4_K", "recipes/tiny-moe-q4_k.toml", ()),
    ("Q2-imatrix", "recipes/tiny-moe-iq2xxs-w2q2k.toml", ("--imatrix", examples.IMATRIX)),
    ("Q2-bootstrap", "recipes/tiny-moe-iq2xxs-w2q2k.toml", ("--bootstrap-importance",)),
)
#: (old, new) pairs compared; the last is the imatrix-vs-bootstrap question.
COMPARED = (("F16", "Q8_0"), ("Q8_0", "Q4_K"), ("Q4_K", "Q2-imatrix"), ("Q2-bootstrap", "Q2-imatrix"))
SCORE_CTX = 512


def quantkit_command(args: list[str], cwd: Path) -> tuple[str, float]:
    """Run the installed ``quantkit`` command; return its stdout and wall seconds (stderr passes through)."""
    started = time.monotonic()
    exe = Path(sys.executable).with_name("quantkit")
    done = subprocess.run([str(exe), *args], cwd=cwd, check=True, stdout=subprocess.PIPE, text=True)
    return done.stdout, time.monotonic() - started


def _avg_text(total: float, count: int) -> str:
    return f"{total / count:.6f}" if count else "-"


def measure(model_dir: Path, work: Path, report: Path) -> None:
    """Convert the example with each of :data:`MEASURED`, score every artifact and the checkpoint on the bundled
    fixture, compare :data:`COMPARED`, and write the Markdown ``report``."""
    from quantkit.scoring.table import read_table

    root = model_dir.parent
    work.mkdir(parents=True, exist_ok=True)
    fixture = str(root / examples.FIXTURE_DIR)
    base_logits = work / "tiny-moe-checkpoint.logits"
    rows, log = [], []
    for name, recipe, extra in (("checkpoint", None, ()),) + MEASURED:
        if recipe is None:
            artifact = model_dir
        else:
            artifact = work / f"tiny-moe-{name}.gguf"
            out, seconds = quantkit_command(["convert", model_dir.name, "-o", str(artifact), "--recipe", recipe,
                                             "--label", examples.FIXTURE_LABEL,
                                             "--pre-tokenizer", examples.PRE_TOKENIZER,
                                             "--no-progress", "--force", *extra], root)
            log.append(f"$ quantkit convert {model_dir.name} --recipe {recipe} {' '.join(extra)}  ({seconds:.0f} s)")
            log += [line for line in out.splitlines() if line.startswith(("name tag", "importance", "wrote"))]
        table = work / f"tiny-moe-{name}.tsv"
        kld = ["--save-logits", str(base_logits)] if recipe is None else ["--kld-base", str(base_logits)]
        out, seconds = quantkit_command(["score", str(artifact), fixture, str(table), "--ctx", str(SCORE_CTX), *kld],
                                        root)
        log.append(f"$ quantkit score {artifact.name} {kld[0]} {base_logits.name}  ({seconds:.0f} s)")
        log += [line for line in out.splitlines() if "summary" in line]
        scored = read_table(table)
        totals, api = scored.totals, scored.totals.api
        kld_stats = dict(item.split("=", 1) for line in scored.trailer if line.startswith("kld_summary")
                         for item in line.split()[1:])
        size = artifact.stat().st_size if artifact.is_file() else (artifact / "model.safetensors").stat().st_size
        rows.append(f"| {name} | {size:,} | {totals.avg_nll:.6f} | {totals.first_matches}/{totals.cases} | "
                    f"{totals.avg_lcp:.2f} | {api.top1_match}/{api.top1_count} | "
                    f"{_avg_text(api.target_abs_delta, api.target_count)} | {kld_stats.get('mean_kld', '-')} | "
                    f"{kld_stats.get('same_top', '-')} |")
        print(rows[-1], flush=True)
    comparisons = []
    for old, new in COMPARED:
        out, _ = quantkit_command(["compare", str(work / f"tiny-moe-{old}.tsv"), str(work / f"tiny-moe-{new}.tsv")],
                                  root)
        comparisons += [f"### {old} -> {new}", "", "```", out.rstrip(), "```", ""]
    manifest = json.loads((model_dir / examples.MANIFEST).read_text())
    text = [f"# Example model: conversions scored on its fixture ({time.strftime('%Y-%m-%d')})", "",
            f"Model: `quantkit/examples/{model_dir.name}` ({manifest['parameters']:,} parameters, "
            f"{manifest['training']['steps']} steps, {manifest['training']['tokens_seen']:,} tokens, "
            f"{manifest['training']['seconds']:.0f} s of training; held-out loss {manifest['loss']['held_out_bf16']} "
            f"nats/token, train {manifest['loss']['train_bf16']}, uniform {manifest['loss']['uniform']}).",
            f"Fixture: `quantkit/examples/{examples.FIXTURE_DIR}` (label {examples.FIXTURE_LABEL}); imatrix: "
            f"`quantkit/examples/{examples.IMATRIX}`.  Made by `python scripts/train_example_model.py measure` "
            f"(quantkit score --ctx {SCORE_CTX}, CPU).", "",
            "| artifact | bytes | avg NLL | first match | avg greedy prefix | API top-1 | target MAE | "
            "mean KLD vs checkpoint | same top |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows, "",
            "## Paired comparisons (quantkit compare)", "",
            *comparisons, "## Commands", "", "```", *log, "```", ""]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=("train", "bundle", "all", "measure"))
    parser.add_argument("--out", type=Path, default=examples.example_model_dir(), help="model directory")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--steps", type=int, default=TRAIN_STEPS)
    parser.add_argument("--work", type=Path, default=Path("/tmp/quantkit-example-measure"),
                        help="measure: where the converted artifacts and score tables go")
    parser.add_argument("--report", type=Path,
                        default=REPO / "bench" / "results" / f"example-model-{time.strftime('%Y-%m-%d')}.md",
                        help="measure: the Markdown report")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(TORCH_THREADS)     # every stage: the thread count changes float rounding
    if args.stage in ("train", "all"):
        manifest = build(args.out, args.seed, args.steps)
        print(json.dumps(manifest["loss"]))
    if args.stage in ("bundle", "all"):
        bundle(args.out)
    if args.stage == "measure":
        measure(args.out, args.work, args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
