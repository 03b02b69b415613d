"""The CUDA emulator (quantkit.testing.cuda_emulation, cuda_emu.h) on small kernels: shuffles, barriers and shared
memory as CUDA defines them, and what a GPU leaves undefined as errors.  tests/test_gpu_encoders.py runs
kq_search.cu's kernels on it against ggml."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from quantkit.kernels import gpu_encode  # noqa: E402
from quantkit.testing import cuda_emulation  # noqa: E402


pytestmark = pytest.mark.skipif(gpu_encode.search_extension("cpu") is None,
                                reason="no C++ compiler for torch extensions")

# Small kernels for the emulator's rules: each writes what every thread saw, or breaks one rule.
RULES_SOURCE = r"""
#include <torch/extension.h>
#ifdef __CUDACC__
__global__ void shuffles(int* out) {
    const int t = threadIdx.x, lane = t & 31;
    __shared__ int seen[64];
    int v = t * 10;
    int sum = v;
    for (int m = 16; m; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);   // butterfly: the warp's sum
    out[5 * t + 0] = sum;
    out[5 * t + 1] = __shfl_down_sync(0xffffffffu, v, 3, 8);                    // from lane + 3 within 8 lanes
    out[5 * t + 2] = __shfl_up_sync(0xffffffffu, v, 1);
    out[5 * t + 3] = __shfl_sync(0xffffffffu, v, 5, 16);                         // lane 5 of each half warp
    seen[t] = v + (int)blockIdx.x;
    __syncthreads();
    out[5 * t + 4] = seen[(t + 32) % 64];                                        // the other warp's value
    if (lane == 0) out[5 * t + 4] += 1000 * (int)gridDim.x;
}
__global__ void broken(int how, int* out) {
    const int lane = threadIdx.x & 31;
    if (how == 0 && lane == 0) __syncwarp();                                     // the others never arrive
    if (how == 1 && lane < 16) out[lane] = __shfl_sync(0x0000ffffu, lane, 20);    // lane 20 is outside the mask
    if (how == 2) out[lane] = __shfl_sync(lane < 16 ? 0x0000ffffu : 0xffffffffu, lane, 0);   // two masks
    if (how == 3) out[lane] = __shfl_sync(0x0000ffffu, lane, 0);                  // lanes 16-31 are left out
}
#endif
torch::Tensor run_shuffles(int64_t blocks) {
    auto out = torch::zeros({64, 5}, torch::kInt32);     // every block writes it: the last one's values stay
    shuffles<<<(unsigned)blocks, 64, 0, c10::cuda::getCurrentCUDAStream()>>>(out.data_ptr<int>());
    return out;
}
void run_broken(int64_t how) {
    auto out = torch::zeros({32}, torch::kInt32);
    broken<<<1, 32, 0, c10::cuda::getCurrentCUDAStream()>>>((int)how, out.data_ptr<int>());
}
"""


@pytest.fixture(scope="module")
def rules():
    from torch.utils.cpp_extension import load_inline

    return load_inline("quantkit_cuda_emulation_rules", cpp_sources=[cuda_emulation.emulated_source(RULES_SOURCE)],
                       functions=["run_shuffles", "run_broken"], extra_cflags=["-O1"])


def test_shuffles_and_shared_memory_follow_cuda(rules):
    got = rules.run_shuffles(2).numpy()
    v = np.arange(64) * 10
    lane, warp = np.arange(64) % 32, np.arange(64) // 32
    sums = np.array([v[warp == w].sum() for w in (0, 1)])[warp]
    down = np.where(lane % 8 + 3 < 8, v + 30, v)
    up = np.where(lane >= 1, v - 10, v)
    from_5 = v[(np.arange(64) & ~15) + 5]
    other = v[(np.arange(64) + 32) % 64] + 1 + np.where(lane == 0, 2000, 0)    # blockIdx.x = 1 in the last block
    assert np.array_equal(got, np.stack([sums, down, up, from_5, other], axis=1))


@pytest.mark.parametrize("how, message", [(0, "can never complete"), (1, "reads a lane outside its mask"),
                                          (2, "different masks"), (3, "whose mask leaves it out")])
def test_what_is_undefined_on_a_gpu_is_an_error(rules, how, message):
    with pytest.raises(RuntimeError, match=message):
        rules.run_broken(how)


def test_every_launch_is_rewritten():
    text = cuda_emulation.emulated_source(cuda_emulation.KERNELS.read_text())
    assert "<<<" not in text and "__CUDACC__" not in text
    assert text.count("::qk_emu::launch(") == cuda_emulation.KERNELS.read_text().count("<<<")
