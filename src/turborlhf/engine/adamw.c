/* AdamW with bf16 moments (turborlhf.engine.optim.BF16StateAdamW), built once per machine by
 * turborlhf/engine/cbuild.py and called through ctypes with raw data pointers.
 *
 * Why: fp32 AdamW keeps 8 bytes of moments per trainable parameter; PPO trains two models
 * (actor and critic), so on SmolLM2-135M that is 2 GiB of the step's peak. Stored in bf16 the
 * moments take 4 bytes. The update itself is fp32 (the moments are widened, updated, used, then
 * stored), and the stores use stochastic rounding: exp_avg_sq moves by (1 - beta2) = 0.1% per
 * step at beta2 = 0.999, below bf16's 0.4% resolution, so round-to-nearest would freeze it;
 * stochastic rounding keeps every store unbiased. The rounding bits come from a counter-based
 * hash of (seed, element index), so a step is deterministic and independent of threading.
 *
 * The maths is torch.optim.AdamW's (decoupled weight decay, bias correction):
 *   p   <- p * (1 - lr*wd)
 *   m   <- b1*m + (1-b1)*g ;  v <- b2*v + (1-b2)*g^2
 *   p   <- p - (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps),   bc_k = 1 - b_k^step
 * with m and v the fp32 values before they are rounded for storage; g is first multiplied by
 * grad_scale (the gradient-clipping coefficient, 1 without clipping), which is what torch's
 * clip_grads_with_norm_ writes into the gradient before the step, without that extra pass.
 * The step returns how many updated weights are NaN/inf (the trainers' check after each step,
 * otherwise a second pass over every weight).
 *
 * `sumsq_f32` and `count_nonfinite_f32` are the passes around a step that the trainers need
 * whatever the optimizer (turborlhf.engine.train.clip_and_step): the squared norm of a gradient
 * (squares in fp32, as torch's fp32 norm, summed in fp64) and the check of a weight after the step.
 */
#include <math.h>
#include <string.h>

#include "bf16.h"

/* lowbias32 (Chris Wellons' integer hash): full avalanche, vectorises (32-bit multiplies). */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352dU;
    x ^= x >> 15; x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* fp32 -> bf16, stochastic rounding with 16 random bits r: the dropped low half is carried into
 * the kept half with probability (low half)/65536, so E[result] = f. Inf/NaN are kept. */
static inline bf16 f2bf_sr(float f, uint32_t r) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u)
        return (bf16)((v.u >> 16) | ((v.u & 0xffffu) ? 0x40u : 0u));
    return (bf16)((v.u + (r & 0xffffu)) >> 16);
}

/* 512-bit vectors (gcc defaults to 256 on Intel); a 32-bit inner index keeps the hash in 32-bit lanes */
__attribute__((target("prefer-vector-width=512")))
int64_t adamw_bf16_step(float *p, const float *g, bf16 *m, bf16 *v, int64_t n, float lr, float b1, float b2,
                        float eps, float wd, float step_size, float inv_sqrt_bc2, uint32_t seed, float grad_scale) {
    const float decay = 1.0f - lr * wd, c1 = 1.0f - b1, c2 = 1.0f - b2;
    const int64_t chunk = 1 << 16;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+:bad)
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        float *pc = p + c0;
        const float *gc = g + c0;
        bf16 *mc = m + c0, *vc = v + c0;
        const uint32_t len = (uint32_t)(n - c0 < chunk ? n - c0 : chunk), base = (uint32_t)c0;
        int32_t bad_c = 0;
#pragma omp simd reduction(+:bad_c)
        for (uint32_t j = 0; j < len; j++) {
            const float gi = gc[j] * grad_scale;
            const float mi = b1 * bf2f(mc[j]) + c1 * gi;
            const float vi = b2 * bf2f(vc[j]) + c2 * gi * gi;
            const uint32_t r = mix32((base + j) * 0x9e3779b9U ^ seed);
            mc[j] = f2bf_sr(mi, r);
            vc[j] = f2bf_sr(vi, r >> 16);
            const float pi = pc[j] * decay - step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
            pc[j] = pi;
            bad_c += !isfinite(pi);
        }
        bad += bad_c;
    }
    return bad;
}

/* sum of x[i]^2: squares in fp32 (|x| >= ~1.8e19 gives inf, as torch's fp32 norm), sums in fp64;
 * NaN and inf propagate */
__attribute__((target("prefer-vector-width=512")))
double sumsq_f32(const float *x, int64_t n) {
    const int64_t chunk = 1 << 16;
    double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+:total)
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const float *xc = x + c0;
        const int64_t len = n - c0 < chunk ? n - c0 : chunk;
        double acc = 0.0;
#pragma omp simd reduction(+:acc)
        for (int64_t j = 0; j < len; j++) {
            const float sq = xc[j] * xc[j];
            acc += (double)sq;
        }
        total += acc;
    }
    return total;
}

/* how many of x[0..n) are NaN or inf */
__attribute__((target("prefer-vector-width=512")))
int64_t count_nonfinite_f32(const float *x, int64_t n) {
    const int64_t chunk = 1 << 16;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+:bad)
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const float *xc = x + c0;
        const int32_t len = (int32_t)(n - c0 < chunk ? n - c0 : chunk);
        int32_t bad_c = 0;
#pragma omp simd reduction(+:bad_c)
        for (int32_t j = 0; j < len; j++)
            bad_c += !isfinite(xc[j]);
        bad += bad_c;
    }
    return bad;
}

int turborlhf_adamw_version(void) { return 2; }
