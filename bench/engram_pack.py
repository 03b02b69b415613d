"""Engram row-store packing vs a same-run ``dd`` copy of the same bytes, and the sample audit's reads.

A seeded tiny V4.1 checkpoint with ``--rows`` Engram rows per layer (two layers) is written to a temporary
directory.  Measured, interleaved (A/B, median of ``--repeats`` after a warm-up, page cache warm for both):

- ``pack``: the converter's production of each Engram table (:func:`quantkit.convert.tensors.tensor_bytes` of the
  ``engram-rows`` job: ``pread`` of codes and scales by row chunk, rows interleaved, checked for NaN codes/scales)
  written with ``pwrite`` to an output file: the table bytes per second;
- ``dd``: ``dd bs=64M`` copying the same number of bytes out of the table shard into a file of the same directory;
- ``convert``: the whole ``quantkit convert`` of the checkpoint (one job), table bytes over its wall time (it also
  hashes the source bytes for the resume journal and the output for provenance: three passes over the tables);
- peak traced allocation while packing (the scratch bound is 256 MiB whatever the table size);
- after a real ``quantkit convert`` of the checkpoint: ``validate --payload sample`` reads (artifact bytes read,
  source table bytes read for the sampled rows) vs the file size, and the same for ``--payload full``.

Run: ``PYTHONPATH=. python bench/engram_pack.py --rows 2000000``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved_medians  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000, help="Engram rows per layer (two layers)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    args = ap.parse_args()

    from quantkit.convert.execute import ConvertRequest, convert, make_job, prepare
    from quantkit.convert.tensors import SourceContext, tensor_bytes
    from quantkit.testing.tiny_v41 import write_v41_checkpoint
    from quantkit.validate import validate

    with tempfile.TemporaryDirectory(prefix="engram-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        src = write_v41_checkpoint(root / "v41", rows_per_layer=args.rows)
        built = time.perf_counter() - t0
        request = ConvertRequest(str(src), root / "v41.gguf", "deepseek-v4.1-flash-q2", bootstrap=True,
                                 pre_tokenizer="deepseek-v3", progress=False)
        prepared = prepare(request)
        jobs = [make_job(t, None) for t in prepared.plan.tensors if t.output.tensor_class == "engram"]
        table_bytes = sum(j.nbytes for j in jobs)
        index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        shard = src / index["layers.1.engram.embed.weight"]
        ctx = SourceContext(str(src), "deepseek_v41")
        out = root / "packed.bin"
        copy = root / "dd.bin"

        def pack() -> None:
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                at = 0
                for job in jobs:
                    for piece in tensor_bytes(ctx, job):
                        os.pwrite(fd, piece, at)
                        at += piece.nbytes
            finally:
                os.close(fd)
            ctx.release()

        def dd() -> None:
            subprocess.run(["dd", f"if={shard}", f"of={copy}", "bs=64M", f"count={table_bytes}",
                           "iflag=count_bytes", "status=none"], check=True)

        medians = interleaved_medians({"pack": pack, "dd": dd}, repeats=args.repeats)
        tracemalloc.start()
        pack()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        mb = table_bytes / 1e6
        emit({"name": "engram-pack", "table_bytes": table_bytes, "rows_per_layer": args.rows,
              "pack_MBps": mb / medians["pack"], "dd_MBps": mb / medians["dd"],
              "ratio": medians["dd"] / medians["pack"], "pack_peak_traced_bytes": peak,
              "checkpoint_build_s": built})

        result = convert(request)
        emit({"name": "engram-convert", "table_bytes": table_bytes, "file_bytes": result.file_size,
              "convert_s": result.wall_seconds, "phases_s": result.phases,
              "table_MBps_whole_convert": mb / result.wall_seconds})

        gguf = root / "v41.gguf"
        size = gguf.stat().st_size
        for mode in ("sample", "full"):
            t0 = time.perf_counter()
            report = validate(gguf, source=str(src), payload=mode)
            seconds = time.perf_counter() - t0
            tables = [t for t in report.tensors if "engram_embd" in t["name"]]
            emit({"name": f"engram-validate-{mode}", "ok": report.ok, "file_bytes": size,
                  "artifact_bytes_read": report.io["artifact_bytes_read"],
                  "artifact_read_fraction": report.io["artifact_bytes_read"] / size,
                  "table_rows_compared": sum(t["rows"] for t in tables),
                  "table_bytes_compared": sum(t["bytes_compared"] for t in tables),
                  "source_table_bytes_read": sum(t["bytes_compared"] for t in tables),
                  "seconds": seconds})


if __name__ == "__main__":
    main()
