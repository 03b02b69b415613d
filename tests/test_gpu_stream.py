"""``convert --device cuda``'s streaming (quantkit.convert.gpu_stream), with torch's CPU encoders (and on CUDA
where there is one): the payload of every tensor equals the CPU path's, split into batches or not, with the same
errors."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from quantkit.convert import gpu_stream, pool  # noqa: E402
from quantkit.convert.execute import ConvertRequest, prepare  # noqa: E402
from quantkit.convert.tensors import SourceContext, pieces, tensor_bytes  # noqa: E402
from quantkit.errors import EncodeError  # noqa: E402
from quantkit.formats.registry import GGMLType  # noqa: E402
from quantkit.formats.warm import encoder_kinds  # noqa: E402
from quantkit.io.safetensors import SafetensorsFile, write_safetensors  # noqa: E402
from quantkit.kernels import gpu_encode  # noqa: E402
from quantkit.testing.recipe_texts import PRE_TOKENIZER as PRE  # noqa: E402
from quantkit.testing.synthetic_imatrix import write_synthetic_imatrix  # noqa: E402
from quantkit.testing.tiny_models import TinyCheckpointCache  # noqa: E402

#: Every GPU type on the tiny models' tensors (IQ2_XXS's eager CPU search is slow: it has the bundled model's test).
RECIPE = """name = "gpu-stream-test"
architectures = ["qwen3_moe"]
[defaults]
type = "Q8_0"
[[rule]]
class = "routed_experts"
type = "Q4_K"
fallback = "Q8_0"
[[rule]]
class = "routed_down"
type = "Q2_K"
fallback = "MXFP4"
[[rule]]
class = "attn_proj"
type = "NVFP4"
fallback = "Q8_0"
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyCheckpointCache:
    return TinyCheckpointCache(tmp_path_factory.mktemp("tiny-gpu-stream"))


def _prepared(ckpt: Path, tmp: Path, imatrix: bool):
    recipe = tmp / "recipe.toml"
    recipe.write_text(RECIPE)
    im_path = None
    if imatrix:
        im_path = tmp / "im.gguf"
        write_synthetic_imatrix(ckpt, im_path, seed=0, unobserved_first_expert=True)
    request = ConvertRequest(str(ckpt), tmp / "out.gguf", str(recipe),
                             imatrix=None if im_path is None else str(im_path), allow_synthetic_imatrix=True,
                             pre_tokenizer=PRE)
    prepared = prepare(request)
    return prepared, str(im_path) if im_path else None


def _contexts(prepared, im_path, device: str = "cpu"):
    """(a context of the CPU path, one for the stream on ``device``)."""
    def ctx(device):
        return SourceContext(str(prepared.source.path), prepared.plan.model_type, im_path, prepared.imatrix_shapes,
                             True, device)
    return ctx("cpu"), ctx(device)


def _assert_stream_equals_cpu(prepared, im_path, device: str, batch_bytes: int) -> None:
    cpu, streamed = _contexts(prepared, im_path, device)
    checked = 0
    for job in prepared.jobs.values():
        if job.kind != "encode" or not gpu_encode.supports(job.qtype):
            continue
        want = b"".join(a.tobytes() for a in tensor_bytes(cpu, job))
        got = b"".join(gpu_stream.payload(a).tobytes()
                       for a in gpu_stream.encode_stream(streamed, job, pieces(streamed, job), device,
                                                         batch_bytes=batch_bytes))
        assert got == want, job.name
        checked += 1
    assert checked > 5


@pytest.mark.parametrize("layout,imatrix", [("per-expert", False), ("per-expert", True), ("fused", True)])
@pytest.mark.parametrize("batch_bytes", [1 << 20, 4096])
def test_stream_equals_cpu_payload(tiny, tmp_path, layout, imatrix, batch_bytes):
    """Whole batches of pieces and pieces split over batches (4 KiB: a few rows each) give the CPU bytes."""
    prepared, im_path = _prepared(tiny.get("qwen3_moe", layout, "bf16"), tmp_path, imatrix)
    _assert_stream_equals_cpu(prepared, im_path, "cpu", batch_bytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch_bytes", [1 << 20, 4096])
def test_cuda_stream_equals_cpu_payload(tiny, tmp_path, batch_bytes):
    """On CUDA (uploads on a copy stream while the previous batch encodes, each download collected behind the next
    batch's sync), with many small batches: the bytes of the CPU encoders."""
    prepared, im_path = _prepared(tiny.get("qwen3_moe", "fused", "bf16"), tmp_path, True)
    _assert_stream_equals_cpu(prepared, im_path, "cuda", batch_bytes)


def test_batches_keep_the_piece_order_and_split_large_pieces():
    rows = [np.zeros((r, 256), np.uint16) for r in (3, 5, 2)]
    units = [("a", ("BF16", rows[0])), ("b", None), ("c", ("BF16", rows[1])), ("d", ("F32", rows[2]))]
    items = list(gpu_stream._batches(units, 1 << 20, 4 * 512))      # 4 rows of BF16 per batch
    shape = [it if isinstance(it, str) else [(s.index, s.first_row, len(s.rows)) for s in it.spans] for it in items]
    assert shape == [[(0, 0, 3)], "b", [(2, 0, 4)], [(2, 4, 1)], [(3, 0, 2)]]


def test_non_finite_row_and_read_errors_come_back_in_place(tiny, tmp_path):
    """A NaN weight is reported as the CPU path reports it (the unit and its row); an error of the reader thread
    is raised in the encoding thread, and the thread is joined."""
    src = tiny.get("qwen3_moe", "per-expert", "bf16")
    ckpt = tmp_path / "nan"
    ckpt.mkdir()
    for p in src.iterdir():
        if p.suffix != ".safetensors":
            (ckpt / p.name).write_bytes(p.read_bytes())
    for p in src.glob("*.safetensors"):
        f = SafetensorsFile(p)
        tensors = {n: np.array(f.array(n)) for n in f.entries}
        for name in tensors:
            if name.endswith("experts.1.up_proj.weight"):
                tensors[name][2, 5] = np.nan
        write_safetensors(ckpt / p.name, tensors)
        f.close()
    prepared, _ = _prepared(ckpt, tmp_path, False)
    cpu, streamed = _contexts(prepared, None)
    job = next(j for j in prepared.jobs.values() if j.name.endswith("ffn_up_exps.weight"))
    with pytest.raises(EncodeError) as on_cpu:
        b"".join(tensor_bytes(cpu, job))
    with pytest.raises(EncodeError) as streaming:
        b"".join(gpu_stream.payload(a) for a in gpu_stream.encode_stream(streamed, job, pieces(streamed, job), "cpu",
                                                                          batch_bytes=1 << 20))
    assert str(streaming.value) == str(on_cpu.value) and "row 2" in str(on_cpu.value)


@pytest.mark.parametrize("case", ["abort-in-second", "nan-after-abort", "nan-and-abort-in-one"])
def test_batch_errors_name_the_first_failing_piece_and_row_as_the_cpu_path(case):
    """The stream never waits for a batch: its rows' flags come back with its bytes, and the error raised is the
    CPU path's, piece by piece (IQ2_XXS rows whose weighted distances overflow: ggml aborts on them)."""
    from quantkit import encode
    from quantkit.convert.tensors import Piece
    from quantkit.testing import corpus

    rng = np.random.default_rng(3)
    experts = [(rng.standard_normal((3, 256)) * 0.02).astype(np.float32) for _ in range(3)]
    overflow = corpus.family("mixed_blocks", 1, 256)[0]            # 1e30-scaled blocks
    bad_rows = {"abort-in-second": [(1, 2, overflow)], "nan-after-abort": [(1, 1, overflow), (2, 0, np.nan)],
                "nan-and-abort-in-one": [(0, 0, overflow), (0, 2, np.nan)]}[case]
    for expert, row, value in bad_rows:
        experts[expert][row] = value
    stored = [(e.view(np.uint32) >> 16).astype(np.uint16) for e in experts]   # exact in BF16: its top half
    experts = [(b.astype(np.uint32) << 16).view(np.float32) for b in stored]
    im = {m: corpus.imatrix("random", 256) + m for m in range(3)}
    job = SimpleNamespace(name="blk.0.ffn_up_exps.weight", qtype="IQ2_XXS", importance="imatrix", bootstrap=(),
                          imatrix_name=None)
    ctx = SimpleNamespace(imatrix=SimpleNamespace(importance=lambda name, expert: im[expert]))
    units = [Piece(m, 3 * m, 3, produce=None, stored=lambda b=b: ("BF16", b)) for m, b in enumerate(stored)]
    with pytest.raises(EncodeError) as on_cpu:
        for m, x in enumerate(experts):
            try:
                encode(x, "IQ2_XXS", im[m])
            except EncodeError as exc:
                raise EncodeError(exc.detail, tensor=f"{job.name}[{m}]") from None
    with pytest.raises(EncodeError) as streaming:
        for piece in gpu_stream.encode_stream(ctx, job, units, "cpu"):   # the three experts in one batch
            gpu_stream.payload(piece)
    assert str(streaming.value) == str(on_cpu.value)



def test_read_error_is_raised_in_place_and_the_reader_stops(tiny, tmp_path, monkeypatch):
    prepared, _ = _prepared(tiny.get("qwen3_moe", "per-expert", "bf16"), tmp_path, False)
    _, ctx = _contexts(prepared, None)
    job = next(j for j in prepared.jobs.values() if j.name.endswith("ffn_up_exps.weight"))
    calls = []
    fill = gpu_stream._fill

    def failing(dst, spans):
        calls.append(len(spans))
        if len(calls) == 2:
            raise OSError("read failed")
        fill(dst, spans)
    monkeypatch.setattr(gpu_stream, "_fill", failing)
    stream = gpu_stream.encode_stream(ctx, job, pieces(ctx, job), "cpu", batch_bytes=4096)
    first = next(stream)
    assert gpu_stream.payload(first).size > 0
    with pytest.raises(OSError, match="read failed"):
        next(stream)
    assert len(calls) == 2
    assert not any(t.name == "quantkit-gpu-reader" for t in threading.enumerate())


def test_convert_through_the_stream_writes_the_cpu_file(tiny, tmp_path, monkeypatch):
    """A whole ``convert --device cuda -j 1`` (the device warmed beside the planning; expert 0 unobserved, so its
    bootstrap importance takes the piece path) with torch's CPU encoders standing in for the GPU: the file of the
    CPU path, byte for byte."""
    from quantkit.convert import execute

    ckpt = tiny.get("qwen3_moe", "fused", "bf16")
    prepared, im_path = _prepared(ckpt, tmp_path, True)
    stream, encode = gpu_stream.encode_stream, gpu_encode.encode
    monkeypatch.setattr(gpu_encode, "encode", lambda *a, device, **kw: encode(*a, device="cpu", **kw))
    monkeypatch.setattr(gpu_encode, "check_device", lambda device: None)
    warmed = []
    monkeypatch.setattr(gpu_encode, "warm_device", lambda device, kinds: warmed.append((device, kinds)))
    monkeypatch.setattr(gpu_stream, "encode_stream", lambda ctx, job, units, device, **kw: stream(ctx, job, units,
                                                                                                 "cpu", **kw))
    files, steps, walls = {}, {}, {}
    for device in ("cpu", "cuda"):
        request = ConvertRequest(str(ckpt), tmp_path / f"{device}.gguf", str(tmp_path / "recipe.toml"),
                                 imatrix=im_path, allow_synthetic_imatrix=True, pre_tokenizer=PRE, progress=False,
                                 device=device)
        report = execute.convert(request).report()
        steps[device], walls[device] = report["stream_seconds"], report["stream_wall_seconds"]
        files[device] = request.out.read_bytes()
    assert files["cuda"] == files["cpu"]
    assert warmed == [("cuda", encoder_kinds(prepared.jobs.values()))]   # every kind of encoder this plan runs
    # the report says where the stream's time went (this run's steps only; no download to wait for on the CPU),
    # summed over threads and as wall time (every step timed in threads; "setup" is the converting thread's own)
    assert steps["cpu"] == {} and walls["cpu"] == {}
    setup_parts = {"setup_pieces", "setup_imatrix", "setup_reader"}
    assert set(steps["cuda"]) == {"setup", *setup_parts, "queue", "wait_reader", "fill", "wait_write_queue", "write",
                                  "hash", "release", "wait_tensor_writes"}
    assert all(s > 0 for s in steps["cuda"].values())
    assert sum(steps["cuda"][part] for part in setup_parts) <= steps["cuda"]["setup"]
    assert set(walls["cuda"]) == set(steps["cuda"]) - {"setup", *setup_parts}
    assert all(0 < walls["cuda"][step] <= steps["cuda"][step] + 1e-9 for step in walls["cuda"])


def test_step_wall_time_counts_overlapping_threads_once():
    """Two threads inside one step at the same time: their seconds add up, the step's wall time counts the overlap
    once (what several threads writing into one file cost the run)."""
    both_inside = threading.Barrier(2)
    before_sum, before_wall = gpu_stream.STEP_SECONDS["test-step"], gpu_stream.STEP_WALL_SECONDS["test-step"]

    def work():
        with gpu_stream.timed("test-step"):
            both_inside.wait()
            time.sleep(0.05)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summed = gpu_stream.STEP_SECONDS["test-step"] - before_sum
    wall = gpu_stream.STEP_WALL_SECONDS["test-step"] - before_wall
    assert 0.05 <= wall < summed and summed >= 0.1


def test_write_behind_keeps_the_order_and_raises_the_first_write_failure(monkeypatch):
    """On a GPU, pieces are written and hashed in a thread: in order, and a failed write stops the tensor."""
    import hashlib

    pieces_out = [np.full(1000 + i, i, np.uint8) for i in range(6)]
    monkeypatch.setattr(pool, "tensor_bytes", lambda ctx, job: (p for p in pieces_out))
    ctx = SimpleNamespace(device="cuda", release=lambda: None)
    job = SimpleNamespace(name="t", kind="copy", qtype=GGMLType.I8, nbytes=sum(p.nbytes for p in pieces_out))
    written = []
    done = pool.produce_tensor(ctx, job, lambda piece, at: written.append((at, piece.tobytes())))
    assert b"".join(w for _, w in written) == b"".join(p.tobytes() for p in pieces_out)
    assert [at for at, _ in written] == list(np.cumsum([0] + [p.nbytes for p in pieces_out[:-1]]))
    assert done.sha256 == hashlib.sha256(b"".join(p.tobytes() for p in pieces_out)).hexdigest()

    def failing(piece, at):
        if at:
            raise OSError("disk gone")
    with pytest.raises(OSError, match="disk gone"):
        pool.produce_tensor(ctx, job, failing)


def test_next_tensor_encodes_while_earlier_ones_finish_writing(tmp_path, monkeypatch):
    """``-j 1`` on a GPU: a tensor's last writes overlap the next tensor's encode; every payload still lands at its
    offset with its hash, in the order given, and a write failing behind stops the run with that failure."""
    import hashlib

    sizes = [3000, 1, 5000, 700, 4096]
    payloads = {f"t{i}": np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    offsets = dict(zip(payloads, np.cumsum([0] + sizes[:-1]).tolist()))
    jobs = {name: SimpleNamespace(name=name, kind="copy", qtype=GGMLType.I8, nbytes=p.nbytes)
            for name, p in payloads.items()}
    slow_first = threading.Event()

    def pieces_of(ctx, job):
        return (payloads[job.name][i:i + 1000] for i in range(0, job.nbytes, 1000))
    monkeypatch.setattr(pool, "tensor_bytes", pieces_of)
    put = pool.pwrite_all

    def slow_put(fd, piece, at):   # t0's writes wait until t1 was produced: the overlap is real
        if at == offsets["t0"] and not slow_first.is_set():
            assert slow_first.wait(10)
        put(fd, piece, at)
    monkeypatch.setattr(pool, "pwrite_all", slow_put)
    start = pool.start_tensor

    def starting(ctx, job, write):
        if job.name == "t1":
            slow_first.set()
        return start(ctx, job, write)
    monkeypatch.setattr(pool, "start_tensor", starting)
    partial = tmp_path / "out.partial"
    partial.write_bytes(bytes(sum(sizes)))
    setup = pool.WorkerSetup("unused", "qwen3_moe", None, str(partial), jobs, offsets, {}, device="cuda")
    done = list(pool.WorkerPool(1).run(setup, list(payloads)))
    assert [d.name for d in done] == list(payloads)
    assert all(d.sha256 == hashlib.sha256(payloads[d.name].tobytes()).hexdigest() for d in done)
    assert partial.read_bytes() == b"".join(p.tobytes() for p in payloads.values())

    def failing(fd, piece, at):
        if at == offsets["t2"]:
            raise OSError("disk gone")
        put(fd, piece, at)
    monkeypatch.setattr(pool, "pwrite_all", failing)
    with pytest.raises(OSError, match="disk gone"):
        list(pool.WorkerPool(1).run(setup, list(payloads)))


@pytest.mark.parametrize("built", [True, False])
def test_warm_up_encodes_each_kind_and_never_builds_the_extension(monkeypatch, built):
    """The warm-up runs one small encode of each kind with a GPU encoder (with its importance or none) and leaves
    the kinds of ``kq_search.cu`` to the stream where no build of it is on disk (a build must not be cut short by
    the process's exit)."""
    calls = []
    monkeypatch.setattr(gpu_encode, "FUSED_SEARCH_ON", {"cpu"})
    monkeypatch.setattr(gpu_encode, "_extension_built", lambda device_type: built)
    monkeypatch.setattr(gpu_encode, "encode_rows", lambda x, qtype, imatrix=None: calls.append(
        (qtype, imatrix is not None, tuple(x.shape))))
    kinds = [(int(GGMLType.Q8_0), False), (int(GGMLType.Q2_K), True), (int(GGMLType.IQ2_XXS), True),
             (int(GGMLType.Q6_K), True), (int(GGMLType.F32), False)]          # Q6_K, F32: no GPU encoder
    gpu_encode.warm_device("cpu", kinds)
    searched = [(GGMLType.Q2_K, True), (GGMLType.IQ2_XXS, True)] if built else []
    assert [(q, im) for q, im, _ in calls] == [(GGMLType.Q8_0, False), *searched]
    assert all(shape[1] % 256 == 0 for _, _, shape in calls)


def test_pieces_in_flight_are_bounded_in_bytes(monkeypatch):
    """A GPU stream's producer waits while the pieces not yet written hold IN_FLIGHT_BYTES (over all tensors); a
    piece larger than the bound goes alone, and every piece still lands in order."""
    pieces_out = [np.full(1000, i, np.uint8) for i in range(6)]
    monkeypatch.setattr(pool, "tensor_bytes", lambda ctx, job: (p for p in pieces_out))
    ctx = SimpleNamespace(device="cuda", release=lambda: None)
    job = SimpleNamespace(name="t", kind="copy", qtype=GGMLType.I8, nbytes=6000)
    for limit, most in ((2500, 2000), (500, 1000)):
        monkeypatch.setattr(pool, "IN_FLIGHT_BYTES", limit)
        first_write, held_then, written = threading.Event(), [], []

        def put(piece, at):
            if not at:
                assert first_write.wait(10)
            written.append(piece.tobytes())
        producing = threading.Thread(target=pool.produce_tensor, args=(ctx, job, put))
        producing.start()
        for _ in range(200):    # the producer stops once the held bytes reach the bound
            held_then.append(pool._IN_FLIGHT._held)
            time.sleep(0.005)
        first_write.set()
        producing.join(10)
        assert not producing.is_alive()
        assert max(held_then) == most and held_then[-1] == most
        assert b"".join(written) == b"".join(p.tobytes() for p in pieces_out)
        assert pool._IN_FLIGHT._held == 0
