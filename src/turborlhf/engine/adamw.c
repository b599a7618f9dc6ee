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
 * with m and v the fp32 values before they are rounded for storage.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf2f(bf16 h) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)h) << 16;
    return v.f;
}

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
void adamw_bf16_step(float *p, const float *g, bf16 *m, bf16 *v, int64_t n, float lr, float b1, float b2,
                     float eps, float wd, float step_size, float inv_sqrt_bc2, uint32_t seed) {
    const float decay = 1.0f - lr * wd, c1 = 1.0f - b1, c2 = 1.0f - b2;
    const int64_t chunk = 1 << 16;
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        float *pc = p + c0;
        const float *gc = g + c0;
        bf16 *mc = m + c0, *vc = v + c0;
        const uint32_t len = (uint32_t)(n - c0 < chunk ? n - c0 : chunk), base = (uint32_t)c0;
#pragma omp simd
        for (uint32_t j = 0; j < len; j++) {
            const float gi = gc[j];
            const float mi = b1 * bf2f(mc[j]) + c1 * gi;
            const float vi = b2 * bf2f(vc[j]) + c2 * gi * gi;
            const uint32_t r = mix32((base + j) * 0x9e3779b9U ^ seed);
            mc[j] = f2bf_sr(mi, r);
            vc[j] = f2bf_sr(vi, r >> 16);
            pc[j] = pc[j] * decay - step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
        }
    }
}

int turborlhf_adamw_version(void) { return 1; }
