/* Backward of the SwiGLU product h = silu(gate) * up (turborlhf.models.fused.silu_mul), built once
 * per machine by turborlhf/engine/cbuild.py (with -ffast-math: glibc's vectorised expf) and
 * called through ctypes with raw data pointers.
 *
 * Why: with torch ops the backward is five element-wise passes over N x I values (a product,
 * silu_backward, SiLU recomputed, a product), each reading and writing bf16 tensors through fp32;
 * here one pass reads gate, up and dh once and writes both gradients.
 *
 * Per element, in fp32, with R the rounding of the tensors' dtype (bf16: nearest even; fp32: none),
 * the same roundings as the torch ops (so the results match them up to expf's last bit):
 *   e = exp(clamp(-g, -80, 80)), s = 1 / (1 + e)
 * (the clamp keeps e finite and normal: under -ffast-math 1 / (1 + inf) is NaN, and denormals are
 * slow; it changes gradients below 1e-33 in magnitude)
 *   dgate = R(R(dh * u) * s * (1 + g * (1 - s)))      (aten's silu_backward of R(dh * u))
 *   dup   = R(dh * R(g / (1 + e)))                     (dh times SiLU's rounded output)
 * A NaN gate gives NaN gradients through the products with g (the clamp may drop it from e).
 */
#ifdef __AVX512F__
/* 16 lanes: half the time of gcc's default 8 at bf16 (the conversions dominate) */
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>

#include "bf16.h"

static inline float rnd_bf16(float f) { return bf2f(f2bf(f)); }
static inline float f32_id(float f) { return f; }

#define BACKWARD(NAME, T, LOAD, STORE, RND)                                                    \
void NAME(const T *gate, const T *up, const T *dh, T *dgate, T *dup, int64_t n) {              \
    _Pragma("omp parallel for simd schedule(static)")                                          \
    for (int64_t k = 0; k < n; k++) {                                                          \
        const float g = LOAD(gate[k]), u = LOAD(up[k]), d = LOAD(dh[k]);                       \
        float a = -g;                                                                          \
        a = a > 80.0f ? 80.0f : (a < -80.0f ? -80.0f : a);                                     \
        const float e = expf(a), s = 1.0f / (1.0f + e);                                        \
        dgate[k] = STORE(RND(d * u) * s * (1.0f + g * (1.0f - s)));                            \
        dup[k] = STORE(d * RND(g / (1.0f + e)));                                               \
    }                                                                                          \
}

BACKWARD(swiglu_bwd_bf16, bf16, bf2f, f2bf, rnd_bf16)
BACKWARD(swiglu_bwd_f32, float, f32_id, f32_id, f32_id)

int turborlhf_swiglu_version(void) { return 1; }
