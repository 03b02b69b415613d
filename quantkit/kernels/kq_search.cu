// make_qkx2_quants / make_qkx3_quants (ggml's K-quant sub-block scale search) fused into one CUDA thread per
// sub-block, and make_qp_quants (the imatrix paths' quantization of the sub-block scales) one thread per super-block: the same float32 operation sequence as quantkit.kernels.kq_primitives.make_qkx_quants_lanes, with
// every multiply, add and divide an explicitly rounded intrinsic (no FMA contraction; built with -fmad=false
// too).  Lanes layout: sub-block k is column k of xt[n, K].  Compiled by quantkit.kernels.gpu_encode with nvcc,
// or with a C++ compiler (-ffp-contract=off) for the CPU check of the same source.
#include <torch/extension.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>

#ifdef __CUDACC__
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#define QK_DEV __device__ __forceinline__
#define FADD(a, b) __fadd_rn((a), (b))
#define FSUB(a, b) __fsub_rn((a), (b))
#define FMUL(a, b) __fmul_rn((a), (b))
#define FDIV(a, b) __fdiv_rn((a), (b))
QK_DEV int f32_bits(float v) { return __float_as_int(v); }
#else
#define QK_DEV static inline
#define FADD(a, b) ((float)((a) + (b)))
#define FSUB(a, b) ((float)((a) - (b)))
#define FMUL(a, b) ((float)((a) * (b)))
#define FDIV(a, b) ((float)((a) / (b)))
QK_DEV int f32_bits(float v) { int i; std::memcpy(&i, &v, 4); return i; }
#endif

// ggml nearest_int; a NaN gives 0, what the x86 default NaN gives (a CUDA NaN has other payload bits).
QK_DEV int nearest_int(float v) {
    float biased = FADD(v, 12582912.0f);
    if (biased != biased) return 0;
    return (f32_bits(biased) & 0x007FFFFF) - 0x00400000;
}

QK_DEV float level(float iscale, float x, float mn, int nmax) {
    int l = nearest_int(FMUL(iscale, FSUB(x, mn)));
    return (float)(l < 0 ? 0 : (l > nmax ? nmax : l));
}

template <int N>
QK_DEV void qkx_search(const float* x, const float* w, int nmax, float rmin, float rdelta, int nstep, bool use_mad,
                       float* scale_out, float* min_out, float* q_iscale_out, float* q_min_out) {
    float mn = x[0], mx = x[0], sum_w = w[0], sum_x = FMUL(w[0], x[0]);
    for (int i = 1; i < N; ++i) {
        float v = x[i];
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        sum_w = FADD(sum_w, w[i]);
        sum_x = FADD(sum_x, FMUL(w[i], v));
    }
    if (mn > 0.0f) mn = 0.0f;
    const float fnmax = (float)nmax;
    float iscale = FDIV(fnmax, FSUB(mx, mn));
    float scale = FDIV(1.0f, iscale);
    float q_iscale = iscale, q_min = mn, best = 0.0f;
    for (int i = 0; i < N; ++i) {
        float diff = FSUB(FADD(FMUL(scale, level(iscale, x[i], mn, nmax)), mn), x[i]);
        diff = use_mad ? fabsf(diff) : FMUL(diff, diff);
        best = FADD(best, FMUL(w[i], diff));
    }
    const bool active = mx > mn;   // ggml returns at once when max == min: no trial may win, quants are 0
    if (!active) { scale = 0.0f; q_iscale = 0.0f; }
    for (int step = 0; step <= nstep; ++step) {
        float numer = FADD(FADD(rmin, FMUL(rdelta, (float)step)), fnmax);
        iscale = FDIV(numer, FSUB(mx, mn));
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
        for (int i = 0; i < N; ++i) {
            float fl = level(iscale, x[i], mn, nmax);
            float wl = FMUL(w[i], fl);
            sum_l = FADD(sum_l, wl);
            sum_l2 = FADD(sum_l2, FMUL(wl, fl));
            sum_xl = FADD(sum_xl, FMUL(wl, x[i]));
        }
        float D = FSUB(FMUL(sum_w, sum_l2), FMUL(sum_l, sum_l));
        float sc = FDIV(FSUB(FMUL(sum_w, sum_xl), FMUL(sum_x, sum_l)), D);
        float m = FDIV(FSUB(FMUL(sum_l2, sum_x), FMUL(sum_l, sum_xl)), D);
        float t_scale = sc, t_min = m;
        if (m > 0.0f) { t_scale = FDIV(sum_xl, sum_l2); t_min = 0.0f; }
        float err = 0.0f;
        for (int i = 0; i < N; ++i) {
            float fl = level(iscale, x[i], mn, nmax);
            float diff = FSUB(FADD(FMUL(t_scale, fl), t_min), x[i]);
            diff = use_mad ? fabsf(diff) : FMUL(diff, diff);
            err = FADD(err, FMUL(w[i], diff));
        }
        if (D > 0.0f && err < best && active) {
            best = err;
            scale = t_scale;
            q_iscale = iscale;
            q_min = mn;
            mn = t_min;
        }
    }
    *scale_out = scale;
    *min_out = -mn;
    *q_iscale_out = q_iscale;
    *q_min_out = q_min;
}

template <int N>
QK_DEV void qkx_lane(const float* xt, const float* wt, int64_t K, int64_t k, int nmax, float rmin, float rdelta,
                     int nstep, bool use_mad, int32_t* Lt, float* scale, float* mins) {
    float x[N], w[N];
    for (int i = 0; i < N; ++i) { x[i] = xt[i * K + k]; w[i] = wt[i * K + k]; }
    float s, m, qi, qm;
    qkx_search<N>(x, w, nmax, rmin, rdelta, nstep, use_mad, &s, &m, &qi, &qm);
    for (int i = 0; i < N; ++i) Lt[i * K + k] = (int32_t)level(qi, x[i], qm, nmax);
    scale[k] = s;
    mins[k] = m;
}

#ifdef __CUDACC__
template <int N>
__global__ void qkx_kernel(const float* xt, const float* wt, int64_t K, int nmax, float rmin, float rdelta,
                           int nstep, bool use_mad, int32_t* Lt, float* scale, float* mins) {
    int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k < K) qkx_lane<N>(xt, wt, K, k, nmax, rmin, rdelta, nstep, use_mad, Lt, scale, mins);
}
#endif

std::vector<torch::Tensor> qkx_search_lanes(torch::Tensor xt, torch::Tensor wt, int64_t nmax, double rmin,
                                            double rdelta, int64_t nstep, bool use_mad) {
    TORCH_CHECK(xt.dtype() == torch::kFloat32 && wt.dtype() == torch::kFloat32, "float32 lanes expected");
    TORCH_CHECK(xt.is_contiguous() && wt.is_contiguous() && xt.sizes() == wt.sizes(), "contiguous [n, K] lanes");
    const int64_t n = xt.size(0), K = xt.size(1);
    TORCH_CHECK(n == 16 || n == 32, "sub-blocks of 16 or 32 weights");
    auto Lt = torch::empty({n, K}, xt.options().dtype(torch::kInt32));
    auto scale = torch::empty({K}, xt.options());
    auto mins = torch::empty({K}, xt.options());
    const float r0 = (float)rmin, rd = (float)rdelta;   // the caller passes float32 values
    const float* x = xt.data_ptr<float>();
    const float* w = wt.data_ptr<float>();
#ifdef __CUDACC__
    TORCH_CHECK(xt.is_cuda(), "CUDA lanes expected");
    const int threads = 128;
    const int64_t blocks = (K + threads - 1) / threads;
    auto stream = c10::cuda::getCurrentCUDAStream();
    if (K > 0) {
        if (n == 16)
            qkx_kernel<16><<<blocks, threads, 0, stream>>>(x, w, K, (int)nmax, r0, rd, (int)nstep, use_mad,
                                                           Lt.data_ptr<int32_t>(), scale.data_ptr<float>(),
                                                           mins.data_ptr<float>());
        else
            qkx_kernel<32><<<blocks, threads, 0, stream>>>(x, w, K, (int)nmax, r0, rd, (int)nstep, use_mad,
                                                           Lt.data_ptr<int32_t>(), scale.data_ptr<float>(),
                                                           mins.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
#else
    TORCH_CHECK(!xt.is_cuda(), "CPU lanes expected");
    for (int64_t k = 0; k < K; ++k) {
        if (n == 16)
            qkx_lane<16>(x, w, K, k, (int)nmax, r0, rd, (int)nstep, use_mad, Lt.data_ptr<int32_t>(),
                         scale.data_ptr<float>(), mins.data_ptr<float>());
        else
            qkx_lane<32>(x, w, K, k, (int)nmax, r0, rd, (int)nstep, use_mad, Lt.data_ptr<int32_t>(),
                         scale.data_ptr<float>(), mins.data_ptr<float>());
    }
#endif
    return {Lt, scale, mins};
}

// make_qp_quants on one lane of n (8 or 16) non-negative values x (the sub-block scales or mins) weighted by qw:
// quants L (stored as uint8 by ggml: kept in 0..255 here) and the returned scale.
template <int N>
QK_DEV float qp_search(const float* x, const float* qw, int nmax, int* L) {
    float mx = 0.0f;
    for (int i = 0; i < N; ++i) mx = mx > x[i] ? mx : x[i];
    if (mx < 1e-15f) {
        for (int i = 0; i < N; ++i) L[i] = 0;
        return 0.0f;
    }
    const float fnmax = (float)nmax;
    float iscale = FDIV(fnmax, mx);
    for (int i = 0; i < N; ++i) L[i] = nearest_int(FMUL(iscale, x[i])) & 0xFF;
    float scale = FDIV(1.0f, iscale);
    float best_mse = 0.0f;
    for (int i = 0; i < N; ++i) {
        float diff = FSUB(x[i], FMUL(scale, (float)L[i]));
        best_mse = FADD(best_mse, FMUL(FMUL(qw[i], diff), diff));
    }
    for (int step = -4; step <= 4; ++step) {
        if (step == 0) continue;
        float iscale_is = FDIV(FADD(FMUL(0.1f, (float)step), fnmax), mx);
        float scale_is = FDIV(1.0f, iscale_is);
        float mse = 0.0f;
        for (int i = 0; i < N; ++i) {
            int l = nearest_int(FMUL(iscale_is, x[i]));
            l = l < nmax ? l : nmax;
            float diff = FSUB(x[i], FMUL(scale_is, (float)l));
            mse = FADD(mse, FMUL(FMUL(qw[i], diff), diff));
        }
        if (mse < best_mse) { best_mse = mse; iscale = iscale_is; }
    }
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < N; ++i) {
        int l = nearest_int(FMUL(iscale, x[i]));
        l = l < nmax ? l : nmax;
        L[i] = l & 0xFF;
        float fl = (float)l;
        sumlx = FADD(sumlx, FMUL(FMUL(qw[i], x[i]), fl));
        suml2 = FADD(suml2, FMUL(FMUL(qw[i], fl), fl));
    }
    for (int pass = 0; pass < 5; ++pass) {
        int changed = 0;
        for (int i = 0; i < N; ++i) {
            float w = qw[i], fli = (float)L[i];
            float slx = FSUB(sumlx, FMUL(FMUL(w, x[i]), fli));
            float sl2 = FSUB(suml2, FMUL(FMUL(w, fli), fli));
            if (slx > 0.0f && sl2 > 0.0f) {
                int new_l = nearest_int(FDIV(FMUL(x[i], sl2), slx));
                new_l = new_l < nmax ? new_l : nmax;
                if (new_l != L[i]) {
                    float fnl = (float)new_l;
                    slx = FADD(slx, FMUL(FMUL(w, x[i]), fnl));
                    sl2 = FADD(sl2, FMUL(FMUL(w, fnl), fnl));
                    if (FMUL(FMUL(slx, slx), suml2) > FMUL(FMUL(sumlx, sumlx), sl2)) {
                        L[i] = new_l & 0xFF;
                        sumlx = slx;
                        suml2 = sl2;
                        ++changed;
                    }
                }
            }
        }
        if (!changed) break;
    }
    return suml2 > 0.0f ? FDIV(sumlx, suml2) : 0.0f;
}

template <int N>
QK_DEV void qp_lane(const float* xt, const float* wt, int64_t K, int64_t k, int nmax, int32_t* Lt, float* scale) {
    float x[N], w[N];
    int L[N];
    for (int i = 0; i < N; ++i) { x[i] = xt[i * K + k]; w[i] = wt[i * K + k]; }
    scale[k] = qp_search<N>(x, w, nmax, L);
    for (int i = 0; i < N; ++i) Lt[i * K + k] = L[i];
}

#ifdef __CUDACC__
template <int N>
__global__ void qp_kernel(const float* xt, const float* wt, int64_t K, int nmax, int32_t* Lt, float* scale) {
    int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k < K) qp_lane<N>(xt, wt, K, k, nmax, Lt, scale);
}
#endif

std::vector<torch::Tensor> qp_quants_lanes(torch::Tensor xt, torch::Tensor wt, int64_t nmax) {
    TORCH_CHECK(xt.dtype() == torch::kFloat32 && wt.dtype() == torch::kFloat32, "float32 lanes expected");
    TORCH_CHECK(xt.is_contiguous() && wt.is_contiguous() && xt.sizes() == wt.sizes(), "contiguous [n, K] lanes");
    const int64_t n = xt.size(0), K = xt.size(1);
    TORCH_CHECK(n == 8 || n == 16, "8 or 16 sub-block scales");
    auto Lt = torch::empty({n, K}, xt.options().dtype(torch::kInt32));
    auto scale = torch::empty({K}, xt.options());
    const float* x = xt.data_ptr<float>();
    const float* w = wt.data_ptr<float>();
#ifdef __CUDACC__
    TORCH_CHECK(xt.is_cuda(), "CUDA lanes expected");
    const int threads = 128;
    const int64_t blocks = (K + threads - 1) / threads;
    auto stream = c10::cuda::getCurrentCUDAStream();
    if (K > 0) {
        if (n == 8)
            qp_kernel<8><<<blocks, threads, 0, stream>>>(x, w, K, (int)nmax, Lt.data_ptr<int32_t>(),
                                                         scale.data_ptr<float>());
        else
            qp_kernel<16><<<blocks, threads, 0, stream>>>(x, w, K, (int)nmax, Lt.data_ptr<int32_t>(),
                                                          scale.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
#else
    TORCH_CHECK(!xt.is_cuda(), "CPU lanes expected");
    for (int64_t k = 0; k < K; ++k) {
        if (n == 8) qp_lane<8>(x, w, K, k, (int)nmax, Lt.data_ptr<int32_t>(), scale.data_ptr<float>());
        else qp_lane<16>(x, w, K, k, (int)nmax, Lt.data_ptr<int32_t>(), scale.data_ptr<float>());
    }
#endif
    return {Lt, scale};
}

// ------------------------------------------------------------------------------------------------ IQ2_XXS
// quantize_row_iq2_xxs_impl fused: one thread per 32-weight sub-block (steps 1-6 of quantkit.formats.iquants: σ²,
// importance weights, sign folding, make_qp_quants, 13 trial scales with the neighbour search, the refinement pass),
// the 8 threads of a super-block then agree on its scale d (warp shuffles on CUDA) and each writes its 8 bytes.
// The float32 sequence is quantkit.kernels.iquants_numba's (_sub_block, _search, _encode_row), operation for
// operation.  Levels are kept as 2-bit lattice codes per group of 8 (u = Σ l_i << 2i, the code ggml's kmap reads).
//
// Tables (built by quantkit.kernels.gpu_encode from quantkit.formats.iq_tables):
//   kmap3[6561]: indexed by the base-3 code Σ l_i·3^i of levels 0..2: the grid index (>= 0), or for a point off
//                the grid INT32_MIN | start << 8 | count of its neighbour list in nb_index;
//   grid_codes[256]: the lattice code of each grid entry;  nb_index[]: grid indices of the neighbours, ggml's order.
// Status per sub-block: -1 empty (nothing stored), 0 encoded, 1..3 iquants_numba's abort codes.

constexpr int IQ2_KMAP3 = 6561;
constexpr int IQ2_BLOCK_BYTES = 66;

QK_DEV float sqrt_rn(float v) {
#ifdef __CUDACC__
    return __fsqrt_rn(v);
#else
    return std::sqrt(v);
#endif
}

// float32 -> IEEE half bits, round to nearest even (NaN -> sign | 0x7E00), in integer arithmetic: on CUDA the
// byte stores of __float2half_rn's 16-bit result came out wrong (the low byte was 0, or 0xFF for inf).
QK_DEV uint16_t f16_bits_rn(float v) {
    const uint32_t x = (uint32_t)f32_bits(v), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);      // 65520 and up round to inf
    if (ax >= 0x38800000u) {                                       // a normal half
        uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3FFu);
        const uint32_t rem = ax & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;    // a carry rounds up into the exponent
        return (uint16_t)(sign | h);
    }
    if (ax <= 0x33000000u) return (uint16_t)sign;                  // 2^-25 and below round to ±0
    const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u, shift = 126u - (ax >> 23);   // a subnormal half
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return (uint16_t)(sign | h);
}

// A group's distance from a lattice code c is Σ_i waux_i·(scale·(2l_i+1) − x_i)², summed in i order, l_i the
// code's level of weight i: its 24 possible terms (t[8l + i]) are computed once per group and scale.
QK_DEV void iq2_terms(const float* xval, const float* waux, float scale, float* t) {
#pragma unroll
    for (int l = 0; l < 3; ++l)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float diff = FSUB(FMUL(scale, (float)(2 * l + 1)), xval[i]);
            t[8 * l + i] = FMUL(FMUL(waux[i], diff), diff);
        }
}

// Selects, not an index computed from the code: on CUDA t stays in registers.
QK_DEV float iq2_distance(const float* t, int code) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int l = (code >> (2 * i)) & 3;
        acc = FADD(acc, l == 0 ? t[i] : (l == 1 ? t[8 + i] : t[16 + i]));
    }
    return acc;
}

// One group of 8 rounded to levels 0..2 at inv_scale: its lattice code (2 bits a weight) in *code, and its kmap3
// entry (the grid index, or negative off the grid: its neighbour list's start and length).
QK_DEV int32_t iq2_round_group(const float* xval, float inv_scale, const int32_t* kmap3, int* code) {
    int u = 0, b3 = 0, p3 = 1;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int l = nearest_int(FMUL(0.5f, FSUB(FMUL(inv_scale, xval[i]), 1.0f)));
        l = l < 0 ? 0 : (l > 2 ? 2 : l);
        u |= l << (2 * i);
        b3 += l * p3;
        p3 *= 3;
    }
    *code = u;
    return kmap3[b3];
}

// Round one group of 8 to levels at inv_scale; off the grid, move it to the listed neighbour of least distance at
// this_scale (the first strict minimum, as ggml scans).  False when every distance is inf/NaN.
QK_DEV bool iq2_snap(const float* xval, const float* waux, float inv_scale, float this_scale, const int32_t* kmap3,
                     const uint16_t* grid_codes, const uint8_t* nb_index, int* code) {
    int u = 0;
    const int32_t e = iq2_round_group(xval, inv_scale, kmap3, &u);
    if (e >= 0) { *code = u; return true; }
    const int start = (e & 0x7FFFFFFF) >> 8, count = e & 0xFF;
    float t[24];
    iq2_terms(xval, waux, this_scale, t);
    float best_d2 = 3.40282346638528859812e+38f;   // FLT_MAX
    int best_code = -1;
    for (int j = 0; j < count; ++j) {
        const int c = grid_codes[nb_index[start + j]];
        const float acc = iq2_distance(t, c);
        if (acc < best_d2) { best_d2 = acc; best_code = c; }
    }
    if (best_code < 0) return false;
    *code = best_code;
    return true;
}

// Σ w·x·q and Σ w·q² over the 32 weights, q = 2l+1 from the group codes.
QK_DEV void iq2_sums(const float* weight, const float* xval, const int* codes, float* sumqx, float* sumq2) {
    float sqx = 0.0f, sq2 = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const float q = (float)(2 * ((codes[i >> 3] >> (2 * (i & 7))) & 3) + 1);
        sqx = FADD(sqx, FMUL(FMUL(weight[i], xval[i]), q));
        sq2 = FADD(sq2, FMUL(FMUL(weight[i], q), q));
    }
    *sumqx = sqx;
    *sumq2 = sq2;
}

// One group of 8: the importance weights (ggml's qw·sqrt(σ² + x²), or x² without an imatrix) and their roots.
QK_DEV void iq2_group_weights(const float* x, const float* qw, float sigma2, float* weight, float* waux) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        weight[i] = qw ? FMUL(qw[i], sqrt_rn(FADD(sigma2, FMUL(x[i], x[i])))) : FMUL(x[i], x[i]);
        waux[i] = sqrt_rn(weight[i]);
    }
}

// Fold one group's signs into xval = |x|: an odd count of negatives flips back the cheapest weight (the grid
// stores 7 sign bits, the 8th is their parity).  Returns the 7 stored bits.
QK_DEV int iq2_fold_signs(const float* x, const float* weight, float* xval) {
    int nflip = 0, s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (x[i] >= 0.0f) xval[i] = x[i];
        else { xval[i] = -x[i]; ++nflip; s |= 1 << i; }
    }
    if (nflip & 1) {
        int imin = 0;
        float vmin = FMUL(FMUL(weight[0], x[0]), x[0]);
#pragma unroll
        for (int i = 1; i < 8; ++i) {
            const float ax = FMUL(FMUL(weight[i], x[i]), x[i]);
            if (ax < vmin) { vmin = ax; imin = i; }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i == imin) xval[i] = -xval[i];
        s ^= 1 << imin;
    }
    return s & 127;
}

// The grid index of a lattice code of levels 0..2, or a negative kmap3 entry where the point is off the grid.
QK_DEV int32_t iq2_grid_index(int code, const int32_t* kmap3) {
    int b3 = 0, p3 = 1;
    for (int i = 0; i < 8; ++i) { b3 += ((code >> (2 * i)) & 3) * p3; p3 *= 3; }
    return kmap3[b3];
}

// One sub-block (x: its 32 weights, qw: their importances or nullptr): status, and on success its scale, the
// 7-bit sign code and the grid index of each group of 8.
QK_DEV int iq2_sub_block(const float* x, const float* qw, float sigma2, const int32_t* kmap3,
                         const uint16_t* grid_codes, const uint8_t* nb_index, float* scale_out, int* signs,
                         int* grid) {
    float weight[32], waux[32], xval[32];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        iq2_group_weights(x + 8 * k, qw ? qw + 8 * k : nullptr, sigma2, weight + 8 * k, waux + 8 * k);
        signs[k] = iq2_fold_signs(x + 8 * k, weight + 8 * k, xval + 8 * k);
    }
    float mx = xval[0];
#pragma unroll
    for (int i = 1; i < 32; ++i) mx = mx > xval[i] ? mx : xval[i];
    *scale_out = 0.0f;
    if (mx < 1e-15f) return -1;
    int Lqp[32];
    float scale = qp_search<32>(xval, weight, 4, Lqp);
    const float denom = FMUL(scale, 3.0f);
    if (denom <= 0.0f) return -1;
    int best_codes[4] = {0, 0, 0, 0}, codes[4];
    float best = 0.0f;
    for (int t = -6; t <= 6; ++t) {
        const float inv_scale = FDIV(FADD(5.0f, FMUL((float)t, 0.1f)), denom);
        const float this_scale = FDIV(1.0f, inv_scale);
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (!iq2_snap(xval + 8 * k, waux + 8 * k, inv_scale, this_scale, kmap3, grid_codes, nb_index, &codes[k]))
                { *scale_out = scale; return 1; }
        float sumqx, sumq2;
        iq2_sums(weight, xval, codes, &sumqx, &sumq2);
        if (sumq2 > 0.0f && FMUL(sumqx, sumqx) > FMUL(best, sumq2)) {
            scale = FDIV(sumqx, sumq2);
            best = FMUL(scale, sumqx);
#pragma unroll
            for (int k = 0; k < 4; ++k) best_codes[k] = codes[k];
        }
    }
    if (scale > 0.0f) {                    // the refinement pass: every group re-snapped at the chosen scale
        const float inv_scale = FDIV(1.0f, scale);
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (!iq2_snap(xval + 8 * k, waux + 8 * k, inv_scale, scale, kmap3, grid_codes, nb_index,
                          &best_codes[k]))
                { *scale_out = scale; return 1; }
        float sumqx, sumq2;
        iq2_sums(weight, xval, best_codes, &sumqx, &sumq2);
        if (sumq2 > 0.0f) scale = FDIV(sumqx, sumq2);
    }
    *scale_out = scale;
    if (scale != scale) return 2;
    if (scale < 0.0f) {
        *scale_out = -scale;
#pragma unroll
        for (int k = 0; k < 4; ++k) signs[k] = ~signs[k] & 127;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int32_t e = iq2_grid_index(best_codes[k], kmap3);
        if (e < 0) return 3;
        grid[k] = e;
    }
    return 0;
}

QK_DEV void put_byte(uint8_t* p, int v) { *p = (uint8_t)(v & 0xFF); }

// A sub-block's 8 bytes (4 grid indices, the sign word with its 4-bit scale) once the super-block's largest
// scale is known; sub-block 0 also writes d.  A super-block whose scales are all 0 is all zero bytes.
QK_DEV void iq2_put(uint8_t* blk, int ib, float max_scale, float scale, int status, const int* signs,
                    const int* grid) {
    uint8_t* q = blk + 2 + 8 * ib;
    if (max_scale == 0.0f) {
        for (int b = 0; b < 8; ++b) q[b] = 0;
        if (ib == 0) { blk[0] = 0; blk[1] = 0; }
        return;
    }
    const float d = FDIV(max_scale, 31.0f);
    if (ib == 0) {
        const uint16_t h = f16_bits_rn(d);
        blk[0] = (uint8_t)(h & 0xFF);
        blk[1] = (uint8_t)(h >> 8);
    }
    int ls = nearest_int(FMUL(0.5f, FSUB(FMUL(FDIV(1.0f, d), scale), 1.0f)));
    ls = ls < 0 ? 0 : (ls > 15 ? 15 : ls);
    uint32_t word = (uint32_t)ls << 28;
    for (int k = 0; k < 4; ++k) {
        q[k] = status == 0 ? (uint8_t)grid[k] : 0;
        if (status == 0) word |= (uint32_t)signs[k] << (7 * k);
    }
    for (int b = 0; b < 4; ++b) q[4 + b] = (uint8_t)((word >> (8 * b)) & 0xFF);
}

// The sub-block's σ² (Σx² over its super-block, sequential from 0, / 256) and its encode.  The importance of the
// weight at offset o is qw[o % qn]: qn = n shares one row of importance among all rows, qn = rows·n gives each row
// its own (experts of a batch, each with its imatrix slice: rows encode independently, so the bytes are the same).
QK_DEV int iq2_lane(const float* x, const float* qw, int64_t qn, int64_t s, const int32_t* kmap3,
                    const uint16_t* grid_codes, const uint8_t* nb_index, float* scale, int* signs, int* grid) {
    const float* xb = x + (s >> 3) * 256;
    float ss = 0.0f;
    for (int i = 0; i < 256; ++i) ss = FADD(ss, FMUL(xb[i], xb[i]));
    const float sigma2 = FDIV(ss, 256.0f);
    const int64_t off = s * 32;
    return iq2_sub_block(x + off, qw ? qw + off % qn : nullptr, sigma2, kmap3, grid_codes, nb_index, scale, signs,
                         grid);
}

#ifdef __CUDACC__
constexpr int IQ2_THREADS = 128;
constexpr int IQ2_WARPS = IQ2_THREADS / 32;
constexpr unsigned IQ2_FULL = 0xffffffffu;

// On CUDA a warp encodes a super-block, lane 4s + g holding group g (8 weights) of sub-block s: per lane a quarter
// of iq2_sub_block's state, so four times the warps fit an SM (one thread per sub-block needed ~200 registers:
// 8 warps per SM, too few to hide the latency of the neighbour searches, which are most of the work).  The steps
// are iq2_sub_block's, group by group; what it sums over the sub-block's 32 weights goes from lane to lane of the
// quad in weight order (iq2_quad_fold), so every float operation is the same one, in the same order.

// op folded over the quad's 32 values in weight order (lane g holds v = values 8g..8g+7), from acc: every lane of
// the quad gets the result.  Every lane of the warp must call it.
template <class Op>
__device__ __forceinline__ float iq2_quad_fold(float acc, const float* v, Op op) {
    const int lane = threadIdx.x & 31, base = lane & ~3;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if ((lane & 3) == k) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc = op(acc, v[i]);
        }
        acc = __shfl_sync(IQ2_FULL, acc, base + k);
    }
    return acc;
}

__device__ __forceinline__ bool iq2_quad_any(bool b) {
    int v = b;
    v |= __shfl_xor_sync(IQ2_FULL, v, 1);
    v |= __shfl_xor_sync(IQ2_FULL, v, 2);
    return v != 0;
}

// iq2_sums for the quad: Σ w·x·q and Σ w·q² over the sub-block, each lane's group with its code.
__device__ __forceinline__ void iq2_quad_sums(const float* weight, const float* xval, int code, float* sumqx,
                                              float* sumq2) {
    float pqx[8], pq2[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float q = (float)(2 * ((code >> (2 * i)) & 3) + 1);
        pqx[i] = FMUL(FMUL(weight[i], xval[i]), q);
        pq2[i] = FMUL(FMUL(weight[i], q), q);
    }
    const auto add = [](float a, float b) { return FADD(a, b); };
    *sumqx = iq2_quad_fold(0.0f, pqx, add);
    *sumq2 = iq2_quad_fold(0.0f, pq2, add);
}

// The warp's 32 lanes (32 groups) share their neighbour searches: lists are 2-150 long, and one lane per list
// keeps the warp for its longest.  All candidates are numbered in lane order and taken 32 at a time; each gives
// the key (distance bits << 32 | place in its list): for non-negative floats the bits order as the values, so the
// least key is iq2_snap's first strict minimum (distances >= FLT_MAX, inf and NaN never win there; left out here).
// Per warp in shared memory: each lane's 24 terms (lane-minor: no bank conflicts), its list's start, its first
// candidate's number, its best key so far.
struct Iq2Search {
    float terms[24 * 32];
    int start[32];
    int first[32];
    unsigned long long best[32];
};

// iq2_snap of each live lane's group; every lane of the warp must call it.
__device__ __forceinline__ bool iq2_snap_warp(const float* xval, const float* waux, float inv_scale,
                                              float this_scale, bool live, const int32_t* kmap3,
                                              const uint16_t* grid_codes, const uint8_t* nb_index, Iq2Search* w,
                                              int* code) {
    constexpr unsigned long long NONE = ~0ull;
    const int lane = threadIdx.x & 31;
    int count = 0, start = 0;
    if (live) {
        int u = 0;
        const int32_t e = iq2_round_group(xval, inv_scale, kmap3, &u);
        if (e >= 0) *code = u;
        else { start = (e & 0x7FFFFFFF) >> 8; count = e & 0xFF; }
    }
    int upto = count;                       // inclusive prefix sum of the counts
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(IQ2_FULL, upto, d);
        if (lane >= d) upto += v;
    }
    const int total = __shfl_sync(IQ2_FULL, upto, 31);
    if (total == 0) return true;
    if (count) {
        float t[24];
        iq2_terms(xval, waux, this_scale, t);
#pragma unroll
        for (int j = 0; j < 24; ++j) w->terms[j * 32 + lane] = t[j];
    }
    w->start[lane] = start;
    w->first[lane] = upto - count;
    w->best[lane] = NONE;
    __syncwarp();
    for (int base = 0; base < total; base += 32) {
        const int j = base + lane;
        int owner = -1;
        unsigned long long key = NONE;
        if (j < total) {
            owner = 0;                      // the last lane whose first candidate is at or before j
#pragma unroll
            for (int step = 16; step; step >>= 1)
                if (w->first[owner + step] <= j) owner += step;
            const int place = j - w->first[owner];
            const int c = grid_codes[nb_index[w->start[owner] + place]];
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc = FADD(acc, w->terms[(8 * ((c >> (2 * i)) & 3) + i) * 32 + owner]);
            if (acc < 3.40282346638528859812e+38f)
                key = (unsigned long long)(uint32_t)f32_bits(acc) << 32 | (uint32_t)place;
        }
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {  // least key of each owner's run of lanes, at its first lane
            const unsigned long long other = __shfl_down_sync(IQ2_FULL, key, d);
            const int other_owner = __shfl_down_sync(IQ2_FULL, owner, d);
            if (lane + d < 32 && other_owner == owner && other < key) key = other;
        }
        const int before = __shfl_up_sync(IQ2_FULL, owner, 1);
        if (owner >= 0 && (lane == 0 || before != owner) && key < w->best[owner]) w->best[owner] = key;
        __syncwarp();
    }
    bool ok = true;
    if (count) {
        const unsigned long long key = w->best[lane];
        if (key == NONE) ok = false;
        else *code = grid_codes[nb_index[start + (int)(key & 0xFFFFFFFFu)]];
    }
    __syncwarp();                           // before the next call reuses the scratch
    return ok;
}

// Persistent blocks: kmap3 and the grid codes go to shared memory once per block (the neighbour lists, 113 KB, are
// read through the cache), then each warp strides over the super-blocks.  stage: a warp's 256 values handed to
// one lane (σ²'s sequential sum; make_qp_quants of a sub-block, on lane 0 of its quad).  3 blocks per SM: 168
// registers, a few bytes spilled.  On an H200: 1.24x the kernel of a thread per sub-block it replaced (1.87 G
// weights/s; bench/results/iq2-gpu-kernel-2026-12-04.md).
__global__ void __launch_bounds__(IQ2_THREADS, 3) iq2_xxs_kernel(const float* x, const float* qw, int64_t qn,
        int64_t n_super, const int32_t* kmap3_g, const uint16_t* grid_codes_g, const uint8_t* nb_index,
        uint8_t* out, int8_t* status_out) {
    __shared__ int32_t kmap3[IQ2_KMAP3];
    __shared__ uint16_t grid_codes[256];
    __shared__ union { float stage[2][256]; Iq2Search search; } scratch[IQ2_WARPS];
    for (int i = threadIdx.x; i < IQ2_KMAP3; i += blockDim.x) kmap3[i] = kmap3_g[i];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) grid_codes[i] = grid_codes_g[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, sub = lane >> 2, g = lane & 3;
    float* xs = scratch[threadIdx.x >> 5].stage[0];
    float* ws = scratch[threadIdx.x >> 5].stage[1];
    Iq2Search* search = &scratch[threadIdx.x >> 5].search;
    const auto larger = [](float m, float v) { return m > v ? m : v; };
    for (int64_t sb = (int64_t)blockIdx.x * IQ2_WARPS + (threadIdx.x >> 5); sb < n_super;
         sb += (int64_t)gridDim.x * IQ2_WARPS) {
        const int64_t off = sb * 256 + lane * 8;        // this lane's 8 weights
        float v[8], weight[8], waux[8], xval[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[i] = x[off + i];
            xs[lane * 8 + i] = FMUL(v[i], v[i]);
        }
        __syncwarp();
        float ss = 0.0f;
        if (lane == 0)
            for (int i = 0; i < 256; ++i) ss = FADD(ss, xs[i]);
        const float sigma2 = FDIV(__shfl_sync(IQ2_FULL, ss, 0), 256.0f);
        iq2_group_weights(v, qw ? qw + off % qn : nullptr, sigma2, weight, waux);
        int sign = iq2_fold_signs(v, weight, xval);
        const float mx = iq2_quad_fold(-INFINITY, xval, larger);   // = iq2_sub_block's, xval[0] first
        int status = mx < 1e-15f ? -1 : 0;
        __syncwarp();                                  // lane 0 has summed xs
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            xs[lane * 8 + i] = xval[i];
            ws[lane * 8 + i] = weight[i];
        }
        __syncwarp();
        float scale = 0.0f;
        if (g == 0 && status == 0) {
            int Lqp[32];
            scale = qp_search<32>(xs + 32 * sub, ws + 32 * sub, 4, Lqp);
        }
        scale = __shfl_sync(IQ2_FULL, scale, lane & ~3);
        const float denom = FMUL(scale, 3.0f);
        if (status == 0 && denom <= 0.0f) status = -1;
        float scale_out = 0.0f, best = 0.0f;
        int code = 0, best_code = 0;
#pragma unroll 1
        for (int t = -6; t <= 6; ++t) {
            const float inv_scale = FDIV(FADD(5.0f, FMUL((float)t, 0.1f)), denom);
            const float this_scale = FDIV(1.0f, inv_scale);
            const bool failed = !iq2_snap_warp(xval, waux, inv_scale, this_scale, status == 0, kmap3, grid_codes,
                                               nb_index, search, &code);
            if (iq2_quad_any(failed) && status == 0) { scale_out = scale; status = 1; }
            float sumqx, sumq2;
            iq2_quad_sums(weight, xval, code, &sumqx, &sumq2);
            if (status == 0 && sumq2 > 0.0f && FMUL(sumqx, sumqx) > FMUL(best, sumq2)) {
                scale = FDIV(sumqx, sumq2);
                best = FMUL(scale, sumqx);
                best_code = code;
            }
        }
        const bool refine = status == 0 && scale > 0.0f;   // every group re-snapped at the chosen scale
        const bool failed = !iq2_snap_warp(xval, waux, FDIV(1.0f, scale), scale, refine, kmap3, grid_codes, nb_index,
                                           search, &best_code);
        if (iq2_quad_any(failed) && status == 0) { scale_out = scale; status = 1; }
        float sumqx, sumq2;
        iq2_quad_sums(weight, xval, best_code, &sumqx, &sumq2);
        if (refine && status == 0 && sumq2 > 0.0f) scale = FDIV(sumqx, sumq2);
        int grid = 0;
        if (status == 0) {
            scale_out = scale;
            if (scale != scale) status = 2;
            else if (scale < 0.0f) { scale_out = -scale; sign = ~sign & 127; }
            grid = iq2_grid_index(best_code, kmap3);
        }
        if (iq2_quad_any(status == 0 && grid < 0) && status == 0) status = 3;
        int signs[4], grids[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            signs[k] = __shfl_sync(IQ2_FULL, sign, (lane & ~3) + k);
            grids[k] = __shfl_sync(IQ2_FULL, grid, (lane & ~3) + k);
        }
        float max_scale = 0.0f;
        for (int j = 0; j < 8; ++j) {       // ggml's running MAX over the stored (non-empty) sub-blocks, in order
            const float sj = __shfl_sync(IQ2_FULL, scale_out, 4 * j);
            const int stj = __shfl_sync(IQ2_FULL, status, 4 * j);
            if (stj != -1) max_scale = max_scale > sj ? max_scale : sj;
        }
        if (g == 0) {
            iq2_put(out + sb * IQ2_BLOCK_BYTES, sub, max_scale, scale_out, status, signs, grids);
            status_out[sb * 8 + sub] = (int8_t)status;
        }
        __syncwarp();                                  // before the next super-block overwrites stage
    }
}
#endif

std::vector<torch::Tensor> iq2_xxs_encode(torch::Tensor x, torch::Tensor qw, torch::Tensor kmap3,
                                          torch::Tensor grid_codes, torch::Tensor nb_index) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) % 256 == 0,
                "contiguous float32 rows of whole super-blocks expected");
    TORCH_CHECK(qw.numel() == 0 || (qw.dtype() == torch::kFloat32 && qw.is_contiguous() &&
                                    (qw.numel() == x.size(1) || qw.numel() == x.numel())),
                "importance: float32[n], or [rows, n] (a row of importance per row)");
    TORCH_CHECK(kmap3.dtype() == torch::kInt32 && kmap3.numel() == IQ2_KMAP3 && grid_codes.numel() == 256 &&
                grid_codes.dtype() == torch::kInt16 && nb_index.dtype() == torch::kUInt8, "IQ2_XXS tables");
    const int64_t rows = x.size(0), n = x.size(1), n_sub = rows * n / 32, qn = qw.numel() ? qw.numel() : n;
    auto out = torch::empty({rows, n / 256 * IQ2_BLOCK_BYTES}, x.options().dtype(torch::kUInt8));
    auto status = torch::empty({rows, n / 32}, x.options().dtype(torch::kInt8));
    const float* xp = x.data_ptr<float>();
    const float* qp = qw.numel() ? qw.data_ptr<float>() : nullptr;
    const int32_t* km = kmap3.data_ptr<int32_t>();
    const uint16_t* gc = reinterpret_cast<const uint16_t*>(grid_codes.data_ptr<int16_t>());
    const uint8_t* nb = nb_index.data_ptr<uint8_t>();
    uint8_t* op = out.data_ptr<uint8_t>();
    int8_t* sp = status.data_ptr<int8_t>();
#ifdef __CUDACC__
    TORCH_CHECK(x.is_cuda(), "CUDA rows expected");
    if (n_sub > 0) {
        int per_sm = 0, sms = 0, dev = 0;
        C10_CUDA_CHECK(cudaGetDevice(&dev));
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, iq2_xxs_kernel, IQ2_THREADS, 0));
        const int64_t needed = (n_sub / 8 + IQ2_WARPS - 1) / IQ2_WARPS;
        const int64_t blocks = std::min<int64_t>(needed, (int64_t)std::max(per_sm, 1) * sms);
        iq2_xxs_kernel<<<(unsigned)blocks, IQ2_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
            xp, qp, qn, n_sub / 8, km, gc, nb, op, sp);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
#else
    TORCH_CHECK(!x.is_cuda(), "CPU rows expected");
    for (int64_t blk = 0; blk < n_sub / 8; ++blk) {
        float scale[8];
        int signs[8][4], grid[8][4], st[8];
        float max_scale = 0.0f;
        for (int ib = 0; ib < 8; ++ib) {
            st[ib] = iq2_lane(xp, qp, qn, blk * 8 + ib, km, gc, nb, &scale[ib], signs[ib], grid[ib]);
            if (st[ib] != -1) max_scale = max_scale > scale[ib] ? max_scale : scale[ib];
        }
        for (int ib = 0; ib < 8; ++ib) {
            iq2_put(op + blk * IQ2_BLOCK_BYTES, ib, max_scale, scale[ib], st[ib], signs[ib], grid[ib]);
            sp[blk * 8 + ib] = (int8_t)st[ib];
        }
    }
#endif
    return {out, status};
}

// ------------------------------------------------------------------------------------------------ Q2_K / Q4_K +imatrix
// quantize_row_q2_K_impl / quantize_row_q4_K_impl fused (kquants_numba._q2_k_row / _k4_row with use_qw): per
// sub-block of N weights (16: Q2_K, 32: Q4_K) σ², the importance weights and their sum, make_qkx3_quants; per
// super-block make_qp_quants of the scales and of the mins, f16 d/dmin; per sub-block the final re-quantization
// with the f16-rounded factors; then the packing.  On CUDA one thread per sub-block, a super-block's S = 256/N
// threads sharing its scales through shared memory; on the CPU the same phases in a loop.

constexpr int KQ_THREADS = 256;

// ggml's f16 of the x86 default NaN is 0xFE00 (quantkit.kernels.gpu_encode.f16_bytes does the same).
QK_DEV uint16_t f16_bits_x86(float v) { return v != v ? (uint16_t)0xFE00 : f16_bits_rn(v); }

QK_DEV float f16_value(uint16_t h) {
#ifdef __CUDACC__
    return __half2float(__ushort_as_half(h));
#else
    return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

template <int N> struct KQuant;
template <> struct KQuant<16> {      // Q2_K: scales[16] | qs[64] | d | dmin
    static constexpr int S = 16, NMAX = 3, QP_NMAX = 15, BYTES = 84;
    static constexpr int D = 80, DMIN = 82, SCALES = 0, QS = 16;
    static constexpr float SIGMA_FACTOR = 1.0f;
};
template <> struct KQuant<32> {      // Q4_K: d | dmin | scales[12] | qs[128]
    static constexpr int S = 8, NMAX = 15, QP_NMAX = 63, BYTES = 144;
    static constexpr int D = 0, DMIN = 2, SCALES = 4, QS = 16;
    static constexpr float SIGMA_FACTOR = 2.0f;
};

// Phase 1, sub-block j of the super-block at xb: its quants L (search), scale, min and weight sum.
template <int N>
QK_DEV void kq_search_sub(const float* xb, const float* qwb, int j, int* L, float* scale, float* mn, float* sw) {
    float ss = 0.0f;
    for (int i = 0; i < 256; ++i) ss = FADD(ss, FMUL(xb[i], xb[i]));
    const float sf = KQuant<N>::SIGMA_FACTOR;
    const float sigma2 = FDIV(sf == 1.0f ? ss : FMUL(sf, ss), 256.0f);
    float x[N], w[N], sumw = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        x[i] = xb[N * j + i];
        w[i] = FMUL(qwb[N * j + i], sqrt_rn(FADD(sigma2, FMUL(x[i], x[i]))));
        sumw = FADD(sumw, w[i]);
    }
    float qi, qm;
    qkx_search<N>(x, w, KQuant<N>::NMAX, -0.9f, 0.05f, 36, false, scale, mn, &qi, &qm);
#pragma unroll
    for (int i = 0; i < N; ++i) L[i] = (int)level(qi, x[i], qm, KQuant<N>::NMAX);
    *sw = sumw;
}

// Phase 2 (two lanes of a super-block: which 0 the scales, 1 the mins): make_qp_quants weighted by the sub-block
// weight sums; the 4/6-bit codes into q[S] and the f16 bits of d (or dmin) into blk.
template <int N>
QK_DEV void kq_scales(const float* v, const float* sw, int which, int* q, uint8_t* blk) {
    constexpr int S = KQuant<N>::S;
    const float d = qp_search<S>(v, sw, KQuant<N>::QP_NMAX, q);
    const uint16_t h = f16_bits_x86(d);
    const int at = which ? KQuant<N>::DMIN : KQuant<N>::D;
    blk[at] = (uint8_t)(h & 0xFF);
    blk[at + 1] = (uint8_t)(h >> 8);
}

// Phase 3 (one lane per super-block, after phase 2): the scale bytes from the codes.
template <int N>
QK_DEV void kq_pack_scales(const int* ls, const int* lm, uint8_t* blk) {
    uint8_t* y = blk + KQuant<N>::SCALES;
    if constexpr (N == 16) {
        for (int j = 0; j < 16; ++j) y[j] = (uint8_t)((ls[j] | (lm[j] << 4)) & 0xFF);
    } else {                          // _pack_k4_scale, sub-blocks in order
        for (int j = 0; j < 8; ++j) {
            if (j < 4) { y[j] = (uint8_t)(ls[j] & 0xFF); y[j + 4] = (uint8_t)(lm[j] & 0xFF); }
            else {
                y[j + 4] = (uint8_t)(((ls[j] & 0xF) | ((lm[j] & 0xF) << 4)) & 0xFF);
                y[j - 4] = (uint8_t)((y[j - 4] | ((ls[j] >> 4) << 6)) & 0xFF);
                y[j] = (uint8_t)((y[j] | ((lm[j] >> 4) << 6)) & 0xFF);
            }
        }
    }
}

// Phase 4, sub-block j: re-quantize with the f16-rounded d·scale and dmin·min read back from the block bytes (a
// sub-block whose d·scale is 0 keeps its search quants); the quants into Lb[256] (block order).
template <int N>
QK_DEV void kq_requantize_sub(const float* xb, const uint8_t* blk, int j, const int* L, uint8_t* Lb) {
    const float dd = f16_value((uint16_t)(blk[KQuant<N>::D] | (blk[KQuant<N>::D + 1] << 8)));
    const float dmm = f16_value((uint16_t)(blk[KQuant<N>::DMIN] | (blk[KQuant<N>::DMIN + 1] << 8)));
    const uint8_t* y = blk + KQuant<N>::SCALES;
    int sc, m;
    if constexpr (N == 16) { sc = y[j] & 0xF; m = y[j] >> 4; }
    else if (j < 4) { sc = y[j] & 63; m = y[j + 4] & 63; }
    else { sc = (y[j + 4] & 0xF) | ((y[j - 4] >> 6) << 4); m = (y[j + 4] >> 4) | ((y[j] >> 6) << 4); }
    const float d = FMUL(dd, (float)sc), dm = FMUL(dmm, (float)m);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        int l = nearest_int(FDIV(FADD(xb[N * j + i], dm), d));
        l = l < 0 ? 0 : (l > KQuant<N>::NMAX ? KQuant<N>::NMAX : l);
        Lb[N * j + i] = (uint8_t)(d == 0.0f ? L[i] : l);
    }
}

// Phase 5: qs bytes [b0, b1) of the block from its quants.
template <int N>
QK_DEV void kq_pack_qs(const uint8_t* Lb, int b0, int b1, uint8_t* blk) {
    for (int b = b0; b < b1; ++b) {
        int v;
        if constexpr (N == 16) {       // _pack_2bit: byte 32h + l holds quants l, l+32, l+64, l+96 of chunk h
            const int h = b >> 5, l = b & 31, o = 128 * h + l;
            v = Lb[o] | (Lb[o + 32] << 2) | (Lb[o + 64] << 4) | (Lb[o + 96] << 6);
        } else {                       // _q4_k_pack: byte 32c + l holds quants l and l+32 of chunk c
            const int c = b >> 5, l = b & 31, o = 64 * c + l;
            v = Lb[o] | (Lb[o + 32] << 4);
        }
        blk[KQuant<N>::QS + b] = (uint8_t)(v & 0xFF);
    }
}

#ifdef __CUDACC__
template <int N>
__global__ void __launch_bounds__(KQ_THREADS) kq_imatrix_kernel(const float* x, const float* qw, int64_t qn,
                                                                int64_t n_blocks, uint8_t* out) {
    constexpr int S = KQuant<N>::S, PER = KQ_THREADS / S, BYTES = KQuant<N>::BYTES;
    __shared__ float scales[KQ_THREADS], mins[KQ_THREADS], sws[KQ_THREADS];
    __shared__ int codes[2][KQ_THREADS];
    __shared__ uint8_t blk[PER][BYTES];
    __shared__ uint8_t Lb[PER][256];
    const int t = threadIdx.x, sb = t / S, j = t % S;
    const int64_t g = (int64_t)blockIdx.x * PER + sb;
    const bool valid = g < n_blocks;
    const float* xb = x + g * 256;
    const float* qwb = qw + (g * 256) % qn;
    int L[N];
    if (valid) kq_search_sub<N>(xb, qwb, j, L, &scales[t], &mins[t], &sws[t]);
    __syncthreads();
    if (valid && j < 2)
        kq_scales<N>(j ? &mins[sb * S] : &scales[sb * S], &sws[sb * S], j, &codes[j][sb * S], blk[sb]);
    __syncthreads();
    if (valid && j == 0) kq_pack_scales<N>(&codes[0][sb * S], &codes[1][sb * S], blk[sb]);
    __syncthreads();
    if (valid) kq_requantize_sub<N>(xb, blk[sb], j, L, Lb[sb]);
    __syncthreads();
    constexpr int QS_BYTES = N == 16 ? 64 : 128, PER_LANE = QS_BYTES / S;
    if (valid) kq_pack_qs<N>(Lb[sb], PER_LANE * j, PER_LANE * (j + 1), blk[sb]);
    __syncthreads();
    for (int i = t; i < PER * BYTES; i += KQ_THREADS) {        // coalesced copy-out of the finished blocks
        const int64_t gb = (int64_t)blockIdx.x * PER + i / BYTES;
        if (gb < n_blocks) out[gb * BYTES + i % BYTES] = blk[i / BYTES][i % BYTES];
    }
}
#endif

template <int N>
void kq_imatrix_run(const float* x, const float* qw, int64_t qn, int64_t n_blocks, uint8_t* out) {
#ifdef __CUDACC__
    constexpr int PER = KQ_THREADS / KQuant<N>::S;
    if (n_blocks > 0) {
        kq_imatrix_kernel<N><<<(unsigned)((n_blocks + PER - 1) / PER), KQ_THREADS, 0,
                               c10::cuda::getCurrentCUDAStream()>>>(x, qw, qn, n_blocks, out);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
#else
    constexpr int S = KQuant<N>::S, BYTES = KQuant<N>::BYTES;
    for (int64_t g = 0; g < n_blocks; ++g) {
        const float* xb = x + g * 256;
        const float* qwb = qw + (g * 256) % qn;
        uint8_t* blk = out + g * BYTES;
        int L[S][N], codes[2][S];
        float scales[S], mins[S], sws[S];
        uint8_t Lb[256];
        for (int j = 0; j < S; ++j) kq_search_sub<N>(xb, qwb, j, L[j], &scales[j], &mins[j], &sws[j]);
        kq_scales<N>(scales, sws, 0, codes[0], blk);
        kq_scales<N>(mins, sws, 1, codes[1], blk);
        kq_pack_scales<N>(codes[0], codes[1], blk);
        for (int j = 0; j < S; ++j) kq_requantize_sub<N>(xb, blk, j, L[j], Lb);
        kq_pack_qs<N>(Lb, 0, N == 16 ? 64 : 128, blk);
    }
#endif
}

torch::Tensor kquant_imatrix_encode(torch::Tensor x, torch::Tensor qw, int64_t sub) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) % 256 == 0,
                "contiguous float32 rows of whole super-blocks expected");
    TORCH_CHECK(qw.dtype() == torch::kFloat32 && qw.is_contiguous() && (qw.numel() == x.size(1) || qw.numel() == x.numel()),
                "importance: float32[n], or [rows, n] (a row of importance per row)");
    TORCH_CHECK(sub == 16 || sub == 32, "sub-blocks of 16 (Q2_K) or 32 (Q4_K)");
    TORCH_CHECK(x.is_cuda() == qw.is_cuda(), "rows and importance on one device");
#ifdef __CUDACC__
    TORCH_CHECK(x.is_cuda(), "CUDA rows expected");
#else
    TORCH_CHECK(!x.is_cuda(), "CPU rows expected");
#endif
    const int64_t rows = x.size(0), n = x.size(1), n_blocks = rows * n / 256, qn = qw.numel();
    const int bytes = sub == 16 ? KQuant<16>::BYTES : KQuant<32>::BYTES;
    auto out = torch::empty({rows, n / 256 * bytes}, x.options().dtype(torch::kUInt8));
    if (sub == 16) kq_imatrix_run<16>(x.data_ptr<float>(), qw.data_ptr<float>(), qn, n_blocks, out.data_ptr<uint8_t>());
    else kq_imatrix_run<32>(x.data_ptr<float>(), qw.data_ptr<float>(), qn, n_blocks, out.data_ptr<uint8_t>());
    return out;
}
