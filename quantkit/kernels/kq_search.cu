// make_qkx2_quants / make_qkx3_quants (ggml's K-quant sub-block scale search) fused into one CUDA thread per
// sub-block, and make_qp_quants (the imatrix paths' quantization of the sub-block scales) one thread per super-block: the same float32 operation sequence as quantkit.kernels.kq_primitives.make_qkx_quants_lanes, with
// every multiply, add and divide an explicitly rounded intrinsic (no FMA contraction; built with -fmad=false
// too).  Lanes layout: sub-block k is column k of xt[n, K].  Compiled by quantkit.kernels.gpu_encode with nvcc,
// or with a C++ compiler (-ffp-contract=off) for the CPU check of the same source.
#include <torch/extension.h>
#include <cstdint>
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
