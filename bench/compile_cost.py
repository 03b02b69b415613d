"""Cold numba compile cost of the demo's kernels (encode + decode of Q8_0, Q2_K with imatrix, IQ2_XXS, F16), in CPU
seconds of this process: on a shared machine CPU time is what compares; run with an empty NUMBA_CACHE_DIR:

    NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=<checkout> python bench/compile_cost.py
"""
import resource, time, numpy as np
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
c0, w0 = cpu(), time.perf_counter()
from quantkit import encode
from quantkit.formats import decode
rng = np.random.default_rng(0)
x = rng.standard_normal((4, 512)).astype(np.float32)
im = (rng.random(512).astype(np.float32) + .1) ** 2
print(f"import cpu {cpu()-c0:.1f}", flush=True)
tot = 0
for t, use in (("Q8_0", False), ("Q2_K", True), ("IQ2_XXS", True), ("F16", False)):
    c = cpu(); data = encode(x, t, im if use else None); dt = cpu() - c; tot += dt
    c = cpu(); decode(data, t, x.shape); dd = cpu() - c; tot += dd
    print(f"{t:8s} encode cpu {dt:6.1f}  decode cpu {dd:5.1f}", flush=True)
print(f"total compile cpu {tot:.1f}  (wall {time.perf_counter()-w0:.1f})", flush=True)
