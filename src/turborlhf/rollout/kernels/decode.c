/* FastEngine's fused decode kernels (C, OpenMP), built once per machine by
 * turborlhf/rollout/kernels/__init__.py and called through ctypes with raw data pointers.
 *
 * Why: a decode step of a 135M model on a 2-core CPU is ~1,000 small torch ops; at batch 32 the
 * grouped-query attention alone (96 tiny matmuls per layer, plus softmax, RoPE, cache writes)
 * took ~30% of the step. These kernels do, per layer, RoPE + KV-cache write + attention in one
 * pass over the cache, and RMSNorm in one pass, with the same maths as the torch path.
 *
 * Two storage types: float (fp32 engines; exactness tests against transformers) and bf16
 * (uint16_t, the default engine dtype). Arithmetic is fp32. In bf16 the rounding points of the
 * torch path are kept where they define stored values (RoPE products and sum, the normalised
 * hidden state before the RMSNorm weight); scores and probabilities stay in fp32 (the torch
 * path rounds them to bf16), so the kernel is at least as accurate.
 *
 * Notation: B rows, H query heads, KV key/value heads, G = H / KV, D head dim, Tmax cache
 * columns, E hidden size. Caches are [B][KV][Tmax][D] (one layer of FastEngine's K_LBKTD).
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

static inline bf16 f2bf(float f) { /* round to nearest even, as c10::BFloat16 */
    union { uint32_t u; float f; } v;
    v.f = f;
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float ld_f32(float x) { return x; }
static inline float st_f32(float x) { return x; }
static inline float rnd_f32(float x) { return x; }
static inline float ld_bf16(bf16 x) { return bf2f(x); }
static inline bf16 st_bf16(float x) { return f2bf(x); }
static inline float rnd_bf16(float x) { return bf2f(f2bf(x)); }

/* decode_attention_<T>: for every row b and KV head h
 *   k = rope(qkv[b, k-part h]), v = qkv[b, v-part h]  -> written at cache column `col`
 *   q_g = rope(qkv[b, q-part h*G+g])                  (g < G)
 *   out[b, (h*G+g)*D : +D] = softmax(scale * q_g . K[b,h,t,:] for t in [start[b], col]) @ V
 * qkv: B x (H+2KV)D; cos_BD, sins_BD: B x D (cos and sin with its first half negated, at each
 * row's position); start: B int64 (first valid cache column of each row: its left padding);
 * out: B x H*D. RoPE: x*cos + roll(x, D/2)*sin+-, the 'half' layout transformers uses. */
#define DEFINE_ATTENTION(T, SUF)                                                                  \
void decode_attention_##SUF(const T *qkv, const T *cos_BD, const T *sins_BD, T *K, T *V,          \
                            const int64_t *start, T *out, int B, int H, int KV, int D, int Tmax,  \
                            int col, float scale) {                                               \
    const int G = H / KV, half = D / 2, width = (H + 2 * KV) * D;                                 \
    _Pragma("omp parallel for schedule(static) if (B * KV > 1)")                                  \
    for (int bh = 0; bh < B * KV; ++bh) {                                                         \
        const int b = bh / KV, h = bh % KV;                                                       \
        const T *row = qkv + (size_t)b * width;                                                   \
        const T *c = cos_BD + (size_t)b * D, *s = sins_BD + (size_t)b * D;                        \
        T *Kh = K + ((size_t)b * KV + h) * Tmax * D, *Vh = V + ((size_t)b * KV + h) * Tmax * D;   \
        const T *k = row + (size_t)(H + h) * D, *v = row + (size_t)(H + KV + h) * D;              \
        for (int d = 0; d < D; ++d) {                                                             \
            float x = ld_##SUF(k[d]), r = ld_##SUF(k[(d + half) % D]);                            \
            Kh[(size_t)col * D + d] = st_##SUF(rnd_##SUF(x * ld_##SUF(c[d]))                      \
                                               + rnd_##SUF(r * ld_##SUF(s[d])));                  \
            Vh[(size_t)col * D + d] = v[d];                                                       \
        }                                                                                         \
        const int t0 = (int)start[b], n = col - t0 + 1;                                           \
        float q[G * D], p[G * n], a[G * D];                                                       \
        for (int g = 0; g < G; ++g) {                                                             \
            const T *qs = row + (size_t)(h * G + g) * D;                                          \
            for (int d = 0; d < D; ++d) {                                                         \
                float x = ld_##SUF(qs[d]), r = ld_##SUF(qs[(d + half) % D]);                      \
                q[g * D + d] = rnd_##SUF(rnd_##SUF(x * ld_##SUF(c[d]))                            \
                                         + rnd_##SUF(r * ld_##SUF(s[d])));                        \
            }                                                                                     \
        }                                                                                         \
        for (int t = 0; t < n; ++t) {                    /* scores: one pass over K */            \
            const T *kt = Kh + (size_t)(t0 + t) * D;                                              \
            float kf[D];                                                                          \
            for (int d = 0; d < D; ++d) kf[d] = ld_##SUF(kt[d]);                                  \
            for (int g = 0; g < G; ++g) {                                                         \
                float acc = 0.f;                                                                  \
                _Pragma("omp simd reduction(+:acc)")                                              \
                for (int d = 0; d < D; ++d) acc += q[g * D + d] * kf[d];                          \
                p[g * n + t] = acc * scale;                                                       \
            }                                                                                     \
        }                                                                                         \
        float inv[G];                                                                             \
        for (int g = 0; g < G; ++g) {                    /* softmax in fp32 */                   \
            float *pg = p + (size_t)g * n, m = pg[0], sum = 0.f;                                  \
            for (int t = 1; t < n; ++t) m = pg[t] > m ? pg[t] : m;                                \
            _Pragma("omp simd reduction(+:sum)")                                                  \
            for (int t = 0; t < n; ++t) { pg[t] = expf(pg[t] - m); sum += pg[t]; }                \
            inv[g] = 1.f / sum;                                                                   \
        }                                                                                         \
        memset(a, 0, sizeof(float) * G * D);                                                      \
        for (int t = 0; t < n; ++t) {                    /* p @ V: one pass over V */            \
            const T *vt = Vh + (size_t)(t0 + t) * D;                                              \
            float vf[D];                                                                          \
            for (int d = 0; d < D; ++d) vf[d] = ld_##SUF(vt[d]);                                  \
            for (int g = 0; g < G; ++g) {                                                         \
                const float w = p[g * n + t];                                                     \
                _Pragma("omp simd")                                                               \
                for (int d = 0; d < D; ++d) a[g * D + d] += w * vf[d];                            \
            }                                                                                     \
        }                                                                                         \
        T *o = out + (size_t)b * H * D + (size_t)h * G * D;                                       \
        for (int g = 0; g < G; ++g)                                                               \
            for (int d = 0; d < D; ++d) o[g * D + d] = st_##SUF(a[g * D + d] * inv[g]);           \
    }                                                                                             \
}

/* rms_norm_<T>: out[b] = w * T(x[b] * rsqrt(mean(x[b]^2) + eps)) for the B rows of x (B x E),
 * as transformers' LlamaRMSNorm (normalise in fp32, cast to the input dtype, then scale). */
#define DEFINE_RMS(T, SUF)                                                                        \
void rms_norm_##SUF(const T *x, const T *w, T *out, int B, int E, float eps) {                    \
    _Pragma("omp parallel for schedule(static) if (B >= 16)")                                     \
    for (int b = 0; b < B; ++b) {                                                                 \
        const T *xb = x + (size_t)b * E;                                                          \
        T *ob = out + (size_t)b * E;                                                              \
        float ss = 0.f;                                                                           \
        _Pragma("omp simd reduction(+:ss)")                                                       \
        for (int e = 0; e < E; ++e) { float v = ld_##SUF(xb[e]); ss += v * v; }                   \
        const float r = 1.f / sqrtf(ss / (float)E + eps);                                         \
        for (int e = 0; e < E; ++e)                                                               \
            ob[e] = st_##SUF(ld_##SUF(w[e]) * rnd_##SUF(ld_##SUF(xb[e]) * r));                    \
    }                                                                                             \
}

DEFINE_ATTENTION(float, f32)
DEFINE_ATTENTION(bf16, bf16)
DEFINE_RMS(float, f32)
DEFINE_RMS(bf16, bf16)

int turborlhf_kernels_version(void) { return 1; }
