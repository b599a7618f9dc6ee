/* RMSNorm of the training forward and backward (turborlhf.models.fused), built once per machine
 * by turborlhf/engine/cbuild.py WITHOUT -ffast-math and called through ctypes with raw pointers.
 *
 * Why: with torch ops the backward of one norm over N x E values is eight element-wise passes
 * with fp32 temporaries (casts, two products, a dot product, addcmul, a scale, a column sum), and
 * the forward's tail three more; a SmolLM2-135M training step has 60 norms per trained model.
 * Here the backward reads the saved normalised input and the output gradient once and writes the
 * input gradient once; the forward's tail reads x once and writes its two outputs.
 *
 * Forward tail (the per-row rstd = rsqrt(mean(x^2) + eps) is computed by torch, with the ops
 * transformers uses, so the outputs stay bit-identical to its LlamaRMSNorm):
 *   xh = x * rstd (fp32);  y = OUT(w * xh);  xhat = OUT(xh)
 * OUT rounds to bf16 (nearest even, NaN kept) or is the identity (fp32). Exact IEEE products in
 * the order torch computes them: that is why this file is built without -ffast-math.
 *
 * Backward, per row i (fp32), from the saved xhat (bf16 or fp32) and dy (the same dtype):
 *   proj = sum_j dy_j w_j xhat_j / E;  dx_j = (dy_j w_j - xhat_j proj) * rstd_i
 *   dw_j = sum_i dy_ij xhat_ij   (per-thread partial sums in `partial`, added in thread order)
 */
#ifdef __AVX512F__
#pragma GCC target("prefer-vector-width=512")   /* 16 lanes: the bf16 conversions run in half the time */
#endif
#include <omp.h>
#include <string.h>

#include "bf16.h"

static inline float f32_id(float f) { return f; }

int rmsnorm_threads(void) { return omp_get_max_threads(); }

#define FORWARD_TAIL(NAME, T, STORE)                                                           \
void NAME(const float *x, const float *rstd, const float *w, T *y, T *xhat, int64_t N,        \
          int64_t E) {                                                                         \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t i = 0; i < N; i++) {                                                          \
        const float *xi = x + i * E;                                                           \
        T *yi = y + i * E, *hi = xhat + i * E;                                                 \
        const float r = rstd[i];                                                               \
        _Pragma("omp simd")                                                                    \
        for (int64_t j = 0; j < E; j++) {                                                      \
            const float xh = xi[j] * r;                                                        \
            yi[j] = STORE(w[j] * xh);                                                          \
            hi[j] = STORE(xh);                                                                 \
        }                                                                                      \
    }                                                                                          \
}

/* partial: at least rmsnorm_threads() x E floats of scratch; dw: E floats (written) */
#define BACKWARD(NAME, T, LOAD)                                                                \
void NAME(const T *xhat, const float *rstd, const float *w, const T *dy, float *dx, float *dw, \
          float *partial, int64_t N, int64_t E) {                                              \
    int used = 1;                                                                              \
    _Pragma("omp parallel")                                                                    \
    {                                                                                          \
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();                       \
        float *pw = partial + (int64_t)t * E;                                                  \
        memset(pw, 0, (size_t)E * sizeof(float));                                              \
        if (t == 0) used = nt;                                                                 \
        const int64_t lo = N * t / nt, hi = N * (t + 1) / nt;                                  \
        for (int64_t i = lo; i < hi; i++) {                                                    \
            const T *hi_ = xhat + i * E, *gi = dy + i * E;                                     \
            float *di = dx + i * E;                                                            \
            float s = 0.0f;                                                                    \
            _Pragma("omp simd reduction(+:s)")                                                 \
            for (int64_t j = 0; j < E; j++) {                                                  \
                const float h = LOAD(hi_[j]), g = LOAD(gi[j]);                                 \
                s += g * w[j] * h;                                                             \
                pw[j] += g * h;                                                                \
            }                                                                                  \
            const float proj = s / (float)E, r = rstd[i];                                      \
            _Pragma("omp simd")                                                                \
            for (int64_t j = 0; j < E; j++)                                                    \
                di[j] = (LOAD(gi[j]) * w[j] - LOAD(hi_[j]) * proj) * r;                        \
        }                                                                                      \
    }                                                                                          \
    for (int64_t j = 0; j < E; j++) {                                                          \
        float s = 0.0f;                                                                        \
        for (int t = 0; t < used; t++) s += partial[(int64_t)t * E + j];                       \
        dw[j] = s;                                                                             \
    }                                                                                          \
}

FORWARD_TAIL(rmsnorm_fwd_tail_bf16, bf16, f2bf)
FORWARD_TAIL(rmsnorm_fwd_tail_f32, float, f32_id)
BACKWARD(rmsnorm_bwd_bf16, bf16, bf2f)
BACKWARD(rmsnorm_bwd_f32, float, f32_id)

int turborlhf_rmsnorm_version(void) { return 1; }
