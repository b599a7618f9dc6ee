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

/* attn_core_<T>: scores, softmax and p @ V for one (row, KV head) when a vectorised path exists
 * (returns 1), else 0 and the portable loops of DEFINE_ATTENTION run. q: G x D (fp32 values
 * that are bf16-exact: the rounded RoPE output), K/V: n cache rows of D from the row's first
 * valid column; out: p (G x n, unnormalised exp), a (G x D, unnormalised), inv (1 / row sums). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#ifdef __AVX512F__
#define VW 16
typedef __m512 vfl;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSET1 _mm512_set1_ps
#define VHSUM _mm512_reduce_add_ps
static inline __m256 half_sum(__m512 v) {               /* lanes i and i + 8 added: 8 lanes */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
#else
#define VW 8
typedef __m256 vfl;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSET1 _mm256_set1_ps
static inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#define VHSUM hsum256
static inline __m256 half_sum(__m256 v) { return v; }
#endif
/* the four horizontal sums of a, b, c, d, in that order */
static inline __m128 hsum4(vfl a, vfl b, vfl c, vfl d) {
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(half_sum(a), half_sum(b)), _mm256_hadd_ps(half_sum(c), half_sum(d)));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}
/* fp32, D a multiple of the vector width up to 256 (16 AVX-512 or 32 AVX2 vectors): q·k as D/VW
 * FMAs and one horizontal sum per (column, query head), p @ V as FMAs into G accumulator rows in
 * registers. The portable loops reduce D lanes per score with a scalar tail of the simd
 * reduction; this is ~5x faster at SmolLM2's D = 64, G = 3 (batch-32 decode on a 2-core Xeon).
 * The cache rows of one (row, KV head) start a new stream every step, which the hardware
 * prefetchers pick up late (they stop at 4 KiB pages): the score pass prefetches K 8 columns
 * ahead and V of its own columns, and p @ V the next item's first K columns (`kn`, or NULL).
 * Batch-32 attention over 30 layers of cached columns: 1.2-1.4x as fast (fp32, AVX2 or AVX-512). */
static inline int attn_core_f32(const float *q, int G, int D, const float *K, const float *V, int n,
                                float scale, float *p, float *a, float *inv, const float *kn) {
    const int nv = D / VW;
    if (D % VW || nv > 256 / VW || G > 8) return 0;
    int t = 0;
    for (; t + 4 <= n; t += 4) {                         /* four columns a pass: one reduction */
        const float *kt = K + (size_t)t * D;
        for (int j = 0; j < 4 * D; j += 16) {            /* K 8 columns ahead, V of these 4 */
            _mm_prefetch((const char *)(kt + 8 * D + j), _MM_HINT_T0);
            _mm_prefetch((const char *)(V + (size_t)t * D + j), _MM_HINT_T1);
        }
        for (int g = 0; g < G; ++g) {
            const float *qg = q + g * D;
            vfl acc[4];
            for (int j = 0; j < 4; ++j) acc[j] = VMUL(VLOAD(qg), VLOAD(kt + j * D));
            for (int i = 1; i < nv; ++i) {
                const vfl qi = VLOAD(qg + VW * i);
                for (int j = 0; j < 4; ++j) acc[j] = VFMA(qi, VLOAD(kt + j * D + VW * i), acc[j]);
            }
            _mm_storeu_ps(p + g * n + t, _mm_mul_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
        }
    }
    for (; t < n; ++t) {
        const float *kt = K + (size_t)t * D;
        for (int g = 0; g < G; ++g) {
            const float *qg = q + g * D;
            vfl acc = VMUL(VLOAD(qg), VLOAD(kt));
            for (int i = 1; i < nv; ++i) acc = VFMA(VLOAD(qg + VW * i), VLOAD(kt + VW * i), acc);
            p[g * n + t] = VHSUM(acc) * scale;
        }
    }
    for (int g = 0; g < G; ++g) {                        /* softmax in fp32 */
        float *pg = p + (size_t)g * n, m = pg[0], sum = 0.f;
        for (int t = 1; t < n; ++t) m = pg[t] > m ? pg[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int t = 0; t < n; ++t) { pg[t] = expf(pg[t] - m); sum += pg[t]; }
        inv[g] = 1.f / sum;
    }
    /* p @ V: G x (up to) 4 vectors of D in registers per pass, so 4G FMA chains run side by side */
    for (int i0 = 0; i0 < nv; i0 += 4) {
        const int ni = nv - i0 < 4 ? nv - i0 : 4;
        vfl acc[8][4];
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < 4; ++i) acc[g][i] = VSET1(0.f);
        for (int t = 0; t < n; ++t) {
            const float *vt = V + (size_t)t * D + VW * i0;
            if (kn && i0 == 0 && t < 64) _mm_prefetch((const char *)(kn + 16 * t), _MM_HINT_T0);
            for (int g = 0; g < G; ++g) {
                const vfl w = VSET1(p[g * n + t]);
                for (int i = 0; i < ni; ++i) acc[g][i] = VFMA(w, VLOAD(vt + VW * i), acc[g][i]);
            }
        }
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < ni; ++i) VSTORE(a + g * D + VW * (i0 + i), acc[g][i]);
    }
    return 1;
}
#else
static inline int attn_core_f32(const float *q, int G, int D, const float *K, const float *V, int n,
                                float scale, float *p, float *a, float *inv, const float *kn) {
    (void)kn; (void)q; (void)G; (void)D; (void)K; (void)V; (void)n; (void)scale; (void)p; (void)a; (void)inv;
    return 0;
}
#endif
#ifdef __AVX512BF16__
#include <immintrin.h>
/* bf16, D a multiple of 32 up to 256: q·k with vdpbf16ps (products of bf16 values summed in fp32:
 * the same terms as the portable loop, q being bf16-exact), V rows widened to fp32 by shifts and
 * accumulated with FMAs. About 6x faster than the portable loops at SmolLM2's D = 64, G = 3. */
static inline int attn_core_bf16(const float *q, int G, int D, const bf16 *K, const bf16 *V, int n,
                                 float scale, float *p, float *a, float *inv, const bf16 *kn) {
    if (D % 32 || D > 256) return 0;
    const int nv = D / 32;
    __m512bh qb[G][8];
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < nv; ++i)
            qb[g][i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * D + 32 * i + 16), _mm512_loadu_ps(q + g * D + 32 * i));
    for (int t = 0; t < n; ++t) {
        const bf16 *kt = K + (size_t)t * D;
        for (int j = 0; j < D; j += 32) {                /* K 8 columns ahead, V of this one */
            _mm_prefetch((const char *)(kt + 8 * D + j), _MM_HINT_T0);
            _mm_prefetch((const char *)(V + (size_t)t * D + j), _MM_HINT_T1);
        }
        __m512bh kv[8];
        for (int i = 0; i < nv; ++i) kv[i] = (__m512bh)_mm512_loadu_si512(kt + 32 * i);
        for (int g = 0; g < G; ++g) {
            __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kv[0]);
            for (int i = 1; i < nv; ++i) acc = _mm512_dpbf16_ps(acc, qb[g][i], kv[i]);
            p[g * n + t] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    for (int g = 0; g < G; ++g) {                        /* softmax in fp32 */
        float *pg = p + (size_t)g * n, m = pg[0], sum = 0.f;
        for (int t = 1; t < n; ++t) m = pg[t] > m ? pg[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int t = 0; t < n; ++t) { pg[t] = expf(pg[t] - m); sum += pg[t]; }
        inv[g] = 1.f / sum;
    }
    const int nf = D / 16;
    memset(a, 0, sizeof(float) * G * D);
    for (int t = 0; t < n; ++t) {
        const bf16 *vt = V + (size_t)t * D;
        if (kn && t < 64) _mm_prefetch((const char *)(kn + 32 * t), _MM_HINT_T0);   /* next item's K */
        __m512 vf[16];
        for (int i = 0; i < nf; ++i)
            vf[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vt + 16 * i))), 16));
        for (int g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(p[g * n + t]);
            float *ag = a + g * D;
            for (int i = 0; i < nf; ++i)
                _mm512_storeu_ps(ag + 16 * i, _mm512_fmadd_ps(w, vf[i], _mm512_loadu_ps(ag + 16 * i)));
        }
    }
    return 1;
}
#else
static inline int attn_core_bf16(const float *q, int G, int D, const bf16 *K, const bf16 *V, int n,
                                 float scale, float *p, float *a, float *inv, const bf16 *kn) {
    (void)kn; (void)q; (void)G; (void)D; (void)K; (void)V; (void)n; (void)scale; (void)p; (void)a; (void)inv;
    return 0;
}
#endif

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
        T *kc = Kh + (size_t)col * D;                    /* RoPE in two halves: no modulo, so */  \
        _Pragma("omp simd")                              /* the loops vectorise */                \
        for (int d = 0; d < half; ++d)                                                            \
            kc[d] = st_##SUF(rnd_##SUF(ld_##SUF(k[d]) * ld_##SUF(c[d]))                           \
                             + rnd_##SUF(ld_##SUF(k[d + half]) * ld_##SUF(s[d])));               \
        _Pragma("omp simd")                                                                       \
        for (int d = half; d < D; ++d)                                                            \
            kc[d] = st_##SUF(rnd_##SUF(ld_##SUF(k[d]) * ld_##SUF(c[d]))                           \
                             + rnd_##SUF(ld_##SUF(k[d - half]) * ld_##SUF(s[d])));               \
        memcpy(Vh + (size_t)col * D, v, sizeof(T) * D);                                           \
        const int t0 = (int)start[b], n = col - t0 + 1;                                           \
        float q[G * D], p[G * n], a[G * D];                                                       \
        for (int g = 0; g < G; ++g) {                                                             \
            const T *qs = row + (size_t)(h * G + g) * D;                                          \
            float *qg = q + g * D;                                                                \
            _Pragma("omp simd")                                                                   \
            for (int d = 0; d < half; ++d)                                                        \
                qg[d] = rnd_##SUF(rnd_##SUF(ld_##SUF(qs[d]) * ld_##SUF(c[d]))                     \
                                  + rnd_##SUF(ld_##SUF(qs[d + half]) * ld_##SUF(s[d])));          \
            _Pragma("omp simd")                                                                   \
            for (int d = half; d < D; ++d)                                                        \
                qg[d] = rnd_##SUF(rnd_##SUF(ld_##SUF(qs[d]) * ld_##SUF(c[d]))                     \
                                  + rnd_##SUF(ld_##SUF(qs[d - half]) * ld_##SUF(s[d])));          \
        }                                                                                         \
        float inv[G];                                                                             \
        const int bn = (bh + 1) / KV, hn = (bh + 1) % KV;  /* the next item's first K columns */ \
        const T *kn = bh + 1 < B * KV ? K + (((size_t)bn * KV + hn) * Tmax + start[bn]) * D : 0;  \
        if (!attn_core_##SUF(q, G, D, Kh + (size_t)t0 * D, Vh + (size_t)t0 * D, n, scale, p, a, inv, kn)) { \
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

int turborlhf_kernels_version(void) { return 3; }

/* ---- bf16 linears for decode steps (few rows, weight reads bound the time) -----------------
 * bf16_linear: y = x Wᵀ (+ b) for M rows with AVX-512-BF16 dot products (vdpbf16ps: products of
 * bf16 pairs summed in fp32), weights pre-packed by bf16_linear_pack into 32-output blocks so
 * each thread streams its share of W once, and the post-ops of a Llama layer fused: + residual,
 * or silu(gate)·up from the fused [gate; up] matrix. Why: oneDNN's packed bf16 linear at 1-32
 * rows reads weights at about half of the memory bandwidth on the 2-core CPU (docs/rollout.md).
 * Built only where the compiler targets avx512bf16; bf16_linear_available() says which. Where it
 * also targets AMX, the same packed weights go through AMX tiles instead (amx_block below):
 * faster at every row count, several times the dot products' rate at 8-32 rows. */
#ifdef __AVX512BF16__
#include <immintrin.h>
int bf16_linear_available(void) { return 1; }

/* bf16_linear_pack_rows: write rows [row0, row0 + n) of an N x K weight (src: those n rows,
 * row-major bf16) into its packed layout `out` (zero-filled by the caller, so padding stays 0):
 * blocks of 32 output rows, K in pairs, out[((nb*K2 + k2)*32 + c)*2 + e] = W[row(nb, c)][2*k2 + e].
 * swiglu: W is the fused [gate; up] (N = 2I rows); block nb holds gate rows nb*16 + c (c < 16) and
 * up rows I + nb*16 + c - 16 (c >= 16), so one block yields 16 outputs silu(g)*u. Rows map to
 * disjoint places, so q/k/v (or gate/up) can be packed one at a time, straight from the trainer's
 * tensors, with no dense fused copy. */
void bf16_linear_pack_rows(const bf16 *src, bf16 *out, int n, int row0, int N, int K, int swiglu) {
    const int K2 = (K + 1) / 2, I = N / 2;
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < n; ++r) {
        const int g = row0 + r;
        int nb, c;
        if (swiglu) { const int j = g < I ? g : g - I; nb = j / 16; c = j % 16 + (g < I ? 0 : 16); }
        else { nb = g / 32; c = g % 32; }
        bf16 *o = out + (int64_t)nb * K2 * 64 + c * 2;
        const bf16 *w = src + (int64_t)r * K;
        for (int k2 = 0; k2 < K / 2; ++k2) { o[k2 * 64] = w[2 * k2]; o[k2 * 64 + 1] = w[2 * k2 + 1]; }
        if (K % 2) { o[(K2 - 1) * 64] = w[K - 1]; o[(K2 - 1) * 64 + 1] = 0; }
    }
}

static inline __m512 exp_ps(__m512 x) {   /* e^x, |rel err| < 2e-7 on [-87, 88] */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 ld_bf(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* One tile: MB rows x 32 packed outputs of block wp, K2 pairs. acc[2m], acc[2m+1]. */
#define TILE(MB)                                                                                   \
static inline void tile##MB(const uint32_t *x32, int64_t xs, const bf16 *wp, int K2, __m512 *acc) {\
    _Pragma("GCC unroll 16") for (int i = 0; i < 2 * MB; ++i) acc[i] = _mm512_setzero_ps();        \
    for (int k2 = 0; k2 < K2; ++k2) {                                                              \
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + k2 * 64);                                  \
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + k2 * 64 + 32);                             \
        _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {                                     \
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x32[m * xs + k2]);                      \
            acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], xb, w0);                                     \
            acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], xb, w1);                             \
        }                                                                                          \
    }                                                                                              \
}
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)

/* The post-ops of rows [m0, m0 + mb) of output block nb, whose fp32 sums are acc[2m] (packed
 * outputs 0-15 of the block) and acc[2m + 1] (16-31): + bias, then op 0 → y; 1 → y + other;
 * 2 → silu(gate)·up (the block's 16 gate and 16 up rows); stored as bf16, or fp32 if out_f32. */
static inline void bf16_block_out(const __m512 *acc, int64_t m0, int mb, int nb, int N, int NO, int op,
                                  const bf16 *bias, const bf16 *other, void *out, int out_f32) {
    for (int m = 0; m < mb; ++m) {
        const int64_t row = m0 + m;
        if (op == 2) {
            const int c0 = nb * 16, n = NO - c0 < 16 ? NO - c0 : 16;
            const __mmask16 mk = (__mmask16)((1u << n) - 1);
            __m512 g = acc[2 * m], u = acc[2 * m + 1];
            if (bias) { g = _mm512_add_ps(g, ld_bf(bias + c0, mk)); u = _mm512_add_ps(u, ld_bf(bias + NO + c0, mk)); }
            __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            __m512 y = _mm512_mul_ps(s, u);
            if (out_f32) _mm512_mask_storeu_ps((float *)out + row * NO + c0, mk, y);
            else _mm256_mask_storeu_epi16((bf16 *)out + row * NO + c0, mk, (__m256i)_mm512_cvtneps_pbh(y));
        } else {
            for (int h = 0; h < 2; ++h) {
                const int c0 = nb * 32 + h * 16;
                if (c0 >= N) break;
                const int n = N - c0 < 16 ? N - c0 : 16;
                const __mmask16 mk = (__mmask16)((1u << n) - 1);
                __m512 y = acc[2 * m + h];
                if (bias) y = _mm512_add_ps(y, ld_bf(bias + c0, mk));
                if (op == 1) y = _mm512_add_ps(y, ld_bf(other + row * N + c0, mk));
                if (out_f32) _mm512_mask_storeu_ps((float *)out + row * N + c0, mk, y);
                else _mm256_mask_storeu_epi16((bf16 *)out + row * N + c0, mk, (__m256i)_mm512_cvtneps_pbh(y));
            }
        }
    }
}

/* ---- AMX tiles (Intel Sapphire Rapids and later), where the compiler targets them ----------
 * The same packed layout serves AMX's tile multiply: rows of K pairs, 32 outputs × 2 bf16 per
 * row (128 bytes), so a 16-output half of a block is a B tile of 16 K-pair rows of 64 bytes at a
 * 128-byte stride. Per output block and 32 rows of x: tiles 0/1 hold x rows [0,16)/[16,32) × 32 K
 * values, 2/3 the block's two halves × the same 32 K values, 4-7 the four 16×16 fp32 sums
 * (tdpbf16ps: products of bf16 pairs summed in fp32, as vdpbf16ps). Linux hands out the tile
 * state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process: `amx_enable`), and
 * each thread loads its tile configuration for the rows it multiplies. Used where K is a
 * multiple of 32 (else the vdpbf16ps tiles). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define TURBORLHF_AMX 1
static int amx_on = 0;

/* on: 1 use the tiles (if granted), 0 do not, -1 leave as is. Returns 1 if AMX tiles are now
 * in use, else 0. */
int amx_enable(int on) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    if (on >= 0) amx_on = on && granted;
    return amx_on;
}

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_cfg;

/* This thread's tiles for `rows` (1-32) rows of x; *configured: the rows they are set for in
 * this call (-1: none yet). Each call configures afresh and releases at its end, since other
 * AMX users in the process (oneDNN) configure and release the same threads' tiles. */
static inline void amx_configure(int rows, int *configured) {
    if (*configured == rows) return;
    const int r0 = rows < 16 ? rows : 16, r1 = rows > 16 ? rows - 16 : 1;
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int tile_rows[8] = { r0, r1, 16, 16, r0, r0, r1, r1 };
    for (int t = 0; t < 8; ++t) { c.rows[t] = (uint8_t)tile_rows[t]; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
    *configured = rows;
}

/* The fp32 sums of rows [0, rows) of x (row stride K) × output block w into acc (2 per row). */
static inline void amx_block(const bf16 *x, int rows, int K, const bf16 *w, __m512 *acc, int *configured) {
    float sums[32 * 32];
    amx_configure(rows, configured);
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int kc = 0; kc < K / 32; ++kc) {
        _tile_loadd(2, w + (int64_t)kc * 16 * 64, 128);
        _tile_loadd(3, w + (int64_t)kc * 16 * 64 + 32, 128);
        _tile_loadd(0, x + kc * 32, K * 2);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (rows > 16) {
            _tile_loadd(1, x + (int64_t)16 * K + kc * 32, K * 2);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, sums, 128);
    _tile_stored(5, sums + 16, 128);
    if (rows > 16) { _tile_stored(6, sums + 16 * 32, 128); _tile_stored(7, sums + 16 * 32 + 16, 128); }
    for (int m = 0; m < rows; ++m) { acc[2 * m] = _mm512_loadu_ps(sums + m * 32); acc[2 * m + 1] = _mm512_loadu_ps(sums + m * 32 + 16); }
}
#else
int amx_enable(int on) { (void)on; return 0; }
#endif

/* y = x W^T (+ bias) then: op 0 → y; 1 → y + other; 2 (swiglu-packed W) → silu(g)*u.
 * x: M x K bf16 (K even), other/out: M x N_out (bf16, or fp32 if out_f32), bias bf16 or NULL
 * (swiglu: bias of the fused [gate; up], 2*N_out). */
void bf16_linear(const bf16 *x, const bf16 *wp, const bf16 *bias, const bf16 *other, void *out,
                 int M, int K, int N, int op, int out_f32) {
    const int K2 = K / 2, swiglu = op == 2;
    const int NO = swiglu ? N / 2 : N;                 /* output columns */
    const int NB = swiglu ? (NO + 15) / 16 : (N + 31) / 32;
    const uint32_t *x32 = (const uint32_t *)x;
#ifdef TURBORLHF_AMX
    const int amx = amx_on && K % 32 == 0;
#else
    const int amx = 0;
#endif
    /* (row chunk, output block) pairs: a chunk of MC rows of x stays in L2 while the weight
     * blocks stream past it (for a prefill's thousands of rows; a decode step is one chunk) */
    const int MC = 256, n_chunks = (M + MC - 1) / MC, step = amx ? 32 : 8;
    #pragma omp parallel
    {
    int configured = -1;                               /* this thread's AMX tile rows (amx_configure) */
    #pragma omp for schedule(static)
    for (int64_t it = 0; it < (int64_t)n_chunks * NB; ++it) {
        const int nb = (int)(it % NB), mc = (int)(it / NB);
        const int m_end = (mc + 1) * MC < M ? (mc + 1) * MC : M;
        const bf16 *w = wp + (int64_t)nb * K2 * 64;
        __m512 acc[64];
        for (int m0 = mc * MC; m0 < m_end; m0 += step) {
            const int mb = m_end - m0 < step ? m_end - m0 : step;
#ifdef TURBORLHF_AMX
            if (amx) {
                amx_block(x + (int64_t)m0 * K, mb, K, w, acc, &configured);
                bf16_block_out(acc, m0, mb, nb, N, NO, op, bias, other, out, out_f32);
                continue;
            }
#endif
            const uint32_t *xm = x32 + (int64_t)m0 * K2;
            switch (mb) {
                case 1: tile1(xm, K2, w, K2, acc); break; case 2: tile2(xm, K2, w, K2, acc); break;
                case 3: tile3(xm, K2, w, K2, acc); break; case 4: tile4(xm, K2, w, K2, acc); break;
                case 5: tile5(xm, K2, w, K2, acc); break; case 6: tile6(xm, K2, w, K2, acc); break;
                case 7: tile7(xm, K2, w, K2, acc); break; default: tile8(xm, K2, w, K2, acc); break;
            }
            bf16_block_out(acc, m0, mb, nb, N, NO, op, bias, other, out, out_f32);
        }
    }
#ifdef TURBORLHF_AMX
    if (configured >= 0) _tile_release();
#else
    (void)configured;
#endif
    }
}

/* decode_layers_bf16: all L decoder layers of one decode step in one call (no Python, torch
 * allocation or ctypes cost between the ~7 kernels of a layer: ~1 ms per step at batch 1). x (B x E,
 * in/out) is the residual stream; per layer l, w[10 l ...] = {ln1, qkv (packed), b_qkv, o (packed),
 * b_o, ln2, gate/up (packed swiglu), b_gu, down (packed), b_d} (biases may be NULL):
 *   h = rms(x, ln1); qkv = h Wqkv + b; a = attention (RoPE, cache write at `col`, over
 *   [start_b, col]) with the layer's cache K + l * layer_stride; x2 = x + a Wo + b;
 *   h = rms(x2, ln2); m = silu(h Wg + bg) * (h Wu + bu); x = x2 + m Wd + bd.
 * scratch: at least B * (2E + (H + 2KV) D + H D + I) bf16. */
void decode_layers_bf16(bf16 *x, int B, int L, const void *const *w, const bf16 *cos_BD,
                        const bf16 *sins_BD, bf16 *K, bf16 *V, int64_t layer_stride, const int64_t *start,
                        int E, int H, int KV, int D, int I, int Tmax, int col, float scale, float eps,
                        bf16 *scratch) {
    const int W = (H + 2 * KV) * D, HD = H * D;
    bf16 *h = scratch, *qkv = h + (size_t)B * E, *a = qkv + (size_t)B * W, *m = a + (size_t)B * HD,
         *x2 = m + (size_t)B * I;
    for (int l = 0; l < L; ++l) {
        const void *const *wl = w + 10 * l;
        rms_norm_bf16(x, (const bf16 *)wl[0], h, B, E, eps);
        bf16_linear(h, (const bf16 *)wl[1], (const bf16 *)wl[2], 0, qkv, B, E, W, 0, 0);
        decode_attention_bf16(qkv, cos_BD, sins_BD, K + l * layer_stride, V + l * layer_stride, start, a,
                              B, H, KV, D, Tmax, col, scale);
        bf16_linear(a, (const bf16 *)wl[3], (const bf16 *)wl[4], x, x2, B, HD, E, 1, 0);
        rms_norm_bf16(x2, (const bf16 *)wl[5], h, B, E, eps);
        bf16_linear(h, (const bf16 *)wl[6], (const bf16 *)wl[7], 0, m, B, E, 2 * I, 2, 0);
        bf16_linear(m, (const bf16 *)wl[8], (const bf16 *)wl[9], x2, x, B, I, E, 1, 0);
    }
}

/* sample_rows_f32: one draw per row from softmax(x / temperature) by inverting the CDF, as
 * turborlhf.rollout.sampling.inverse_cdf_sample does with torch ops (amax, exp, cumsum,
 * searchsorted: six passes over B x V floats and a B x V cdf) in three passes without the cdf:
 * the max, the exp and sums of blocks of 16, then a walk over the block sums to the block where
 * the cumulative sum passes u * total (its 16 exps recomputed, bit-identical), the first column
 * whose cumulative sum exceeds it being drawn. -inf logits have probability 0. u: one uniform in
 * [0, 1) per row. Out: ids (int64), logp = (x - max)·(1/T) at the id - log(total) <= 0.
 * The max is taken over x itself and every exponent is (x - max)·(1/T): the most likely token's is
 * exactly 0. Scaling first (x/T - max/T) left rounding errors of x/T's size, which -ffast-math's
 * FMAs kept unrounded in one place and not in another: at T = 1e-3 (x/T near 3000) the drawn
 * token's log-prob was up to 5e-4 off, above 0 for the most likely token. */
static inline __m512 block_x(const float *xb, int j, int V) {  /* x of columns 16j.. (-inf past V) */
    const int n = V - 16 * j < 16 ? V - 16 * j : 16;
    const __mmask16 mk = (__mmask16)((1u << n) - 1);
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mk, xb + 16 * j);
}

static inline __m512 block_exp(const float *xb, int j, int V, __m512 invT, __m512 M) {  /* exp((x - max)/T), 0 at -inf */
    const __m512 x = block_x(xb, j, V);
    return _mm512_mask_mov_ps(exp_ps(_mm512_mul_ps(_mm512_sub_ps(x, M), invT)),
                              _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), _mm512_setzero_ps());
}

void sample_rows_f32(const float *x, int B, int V, float temperature, const float *u, int64_t *ids,
                     float *logp) {
    const int nb = (V + 15) / 16;
    const float inv_t = 1.f / temperature;
    const __m512 T = _mm512_set1_ps(inv_t);
    #pragma omp parallel for schedule(static) if (B > 1)
    for (int b = 0; b < B; ++b) {
        const float *xb = x + (size_t)b * V;
        float bsum[nb];
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < nb; ++j) mv = _mm512_max_ps(mv, block_x(xb, j, V));
        const float m = _mm512_reduce_max_ps(mv);
        const __m512 M = _mm512_set1_ps(m);
        float total = 0.f;
        for (int j = 0; j < nb; ++j) {
            bsum[j] = _mm512_reduce_add_ps(block_exp(xb, j, V, T, M));
            total += bsum[j];
        }
        float target = u[b] * total;
        if (target >= total) target = nextafterf(total, 0.f);
        int id = -1;
        float acc = 0.f;
        for (int j = 0; j < nb && id < 0; ++j) {
            if (j < nb - 1 && acc + bsum[j] <= target) { acc += bsum[j]; continue; }
            /* the crossing block: its exps again (bit-identical), the first column past the target;
             * if rounding keeps its terms below the target, the walk goes on with the next block */
            const int n = V - 16 * j < 16 ? V - 16 * j : 16;
            float ev[16];
            _mm512_storeu_ps(ev, block_exp(xb, j, V, T, M));
            for (int k = 0; k < n; ++k) {
                acc += ev[k];
                if (ev[k] > 0.f && acc > target) { id = 16 * j + k; break; }
            }
        }
        if (id < 0)                                      /* rounding: the last column of positive probability */
            for (int k = V - 1; k >= 0 && id < 0; --k) if (xb[k] / temperature > -INFINITY) id = k;
        ids[b] = id;
        logp[b] = fminf((xb[id] - m) * inv_t - logf(total), 0.f);  /* total >= 1: the max's term is 1 */
    }
}
int sampler_vectorised(void) { return 1; }
#else
int bf16_linear_available(void) { return 0; }
int amx_enable(int on) { (void)on; return 0; }
int sampler_vectorised(void) { return 0; }

/* sample_rows_f32 without AVX-512: the same three passes and the same walk, in plain loops that
 * GCC vectorises (blocks of 16, expf from libmvec under -ffast-math). -inf logits are tested on
 * the integer bits, which -ffast-math cannot fold away. */
static inline int is_neg_inf(float f) { union { float f; uint32_t u; } v = { f }; return v.u == 0xff800000u; }

static inline float block_exps(const float *xb, int j, int V, float inv_t, float m, float *ev) {
    const int n = V - 16 * j < 16 ? V - 16 * j : 16;
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int k = 0; k < n; ++k) {
        ev[k] = is_neg_inf(xb[16 * j + k]) ? 0.f : expf((xb[16 * j + k] - m) * inv_t);
        s += ev[k];
    }
    return s;
}

void sample_rows_f32(const float *x, int B, int V, float temperature, const float *u, int64_t *ids,
                     float *logp) {
    const int nb = (V + 15) / 16;
    const float inv_t = 1.f / temperature;
    #pragma omp parallel for schedule(static) if (B > 1)
    for (int b = 0; b < B; ++b) {
        const float *xb = x + (size_t)b * V;
        float bsum[nb], ev[16];
        float m = -INFINITY;                             /* (at least one finite logit per row) */
        #pragma omp simd reduction(max:m)
        for (int v = 0; v < V; ++v) m = xb[v] > m ? xb[v] : m;
        float total = 0.f;
        for (int j = 0; j < nb; ++j) { bsum[j] = block_exps(xb, j, V, inv_t, m, ev); total += bsum[j]; }
        float target = u[b] * total;
        if (target >= total) target = nextafterf(total, 0.f);
        int id = -1;
        float acc = 0.f;
        for (int j = 0; j < nb && id < 0; ++j) {
            if (j < nb - 1 && acc + bsum[j] <= target) { acc += bsum[j]; continue; }
            const int n = V - 16 * j < 16 ? V - 16 * j : 16;
            block_exps(xb, j, V, inv_t, m, ev);
            for (int k = 0; k < n; ++k) {
                acc += ev[k];
                if (ev[k] > 0.f && acc > target) { id = 16 * j + k; break; }
            }
        }
        if (id < 0)                                      /* rounding: the last column of positive probability */
            for (int k = V - 1; k >= 0 && id < 0; --k) if (!is_neg_inf(xb[k])) id = k;
        ids[b] = id;
        logp[b] = fminf((xb[id] - m) * inv_t - logf(total), 0.f);  /* total >= 1: the max's term is 1 */
    }
}
#endif

/* ---- fp32 linears for decode steps (CPUs without native bf16: AVX2 + FMA suffice) -----------
 * f32_linear: y = x Wᵀ (+ b) for M rows with fp32 FMAs on weights packed into 16-output blocks
 * (f32_linear_pack_rows), post-ops fused as in bf16_linear: + residual, or silu(gate)·up from
 * the fused [gate; up] matrix, in register tiles of AVX2 or, where the compiler targets it,
 * AVX-512 (below). Why: an fp32 engine's F.linear and oneDNN calls at 1-32 rows cost ~1,000
 * dispatches per decode step; with these, all layers of a step are one C call (decode_layers_f32).
 * The w16_ variants keep the weights in bf16 and compute in fp32 (engines with bf16 weight
 * storage on CPUs without bf16 arithmetic). f32_linear_available() says whether they were built. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
int f32_linear_available(void) { return 1; }

/* f32_linear_pack_rows: rows [row0, row0 + n) of an N x K weight (src: those n rows, row-major
 * fp32) into the packed layout (zero-filled by the caller): out[(nb*K + k)*16 + c] = W[row(nb, c)][k];
 * plain: row(nb, c) = nb*16 + c; swiglu (W = [gate; up], N = 2I rows): block nb holds gate rows
 * nb*8 + c (c < 8) and up rows I + nb*8 + c - 8 (c >= 8), so a block yields 8 outputs silu(g)*u.
 * w16_linear_pack_rows: the same blocks of bf16 elements (src: bf16 rows), for w16_linear, with
 * the steps k, k + 1 (k even) of a block interleaved by fours: the 32 weights at (nb*K + k)*16 are,
 * per 128-bit lane L = c / 4, step k's outputs 4L..4L+3 then step k + 1's (`w16_at`). Unpacking a
 * lane's low or high four 16-bit words against zero (`_mm*_unpack{lo,hi}_epi16`) then yields
 * step k's or k + 1's fp32 weights in output order, one instruction per vector where widening
 * (`vpmovzxwd` + `vpslld`) takes two. An odd K's last step keeps the plain order. */
static inline int64_t w16_at(int nb, int c, int k, int K) {
    if ((K & 1) && k == K - 1) return ((int64_t)nb * K + k) * 16 + c;
    return ((int64_t)nb * K + (k & ~1)) * 16 + (c / 4) * 8 + (k & 1) * 4 + c % 4;
}
static inline int64_t f32_at(int nb, int c, int k, int K) { return ((int64_t)nb * K + k) * 16 + c; }
#define DEFINE_F32_PACK(NAME, WT, AT)                                                              \
void NAME(const WT *src, WT *out, int n, int row0, int N, int K, int swiglu) {                     \
    const int I = N / 2;                                                                           \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int r = 0; r < n; ++r) {                                                                  \
        const int g = row0 + r;                                                                    \
        int nb, c;                                                                                 \
        if (swiglu) { const int j = g < I ? g : g - I; nb = j / 8; c = j % 8 + (g < I ? 0 : 8); }  \
        else { nb = g / 16; c = g % 16; }                                                          \
        const WT *w = src + (int64_t)r * K;                                                        \
        for (int k = 0; k < K; ++k) out[AT(nb, c, k, K)] = w[k];                                   \
    }                                                                                              \
}
DEFINE_F32_PACK(f32_linear_pack_rows, float, f32_at)
DEFINE_F32_PACK(w16_linear_pack_rows, bf16, w16_at)

/* The post-op of one 16-output block nb for rows [m0, m0 + mb): r holds 16 sums per row. */
static inline void f32_block_out(const float *r, int mb, int64_t m0, int nb, int N, int NO, int swiglu, int op,
                                 const float *bias, const float *other, float *out) {
    for (int m = 0; m < mb; ++m, r += 16) {
        const int64_t row = m0 + m;
        if (swiglu) {
            const int c0 = nb * 8, n = NO - c0 < 8 ? NO - c0 : 8;
            for (int c = 0; c < n; ++c) {
                float g = r[c], u = r[8 + c];
                if (bias) { g += bias[c0 + c]; u += bias[NO + c0 + c]; }
                out[row * NO + c0 + c] = g / (1.f + expf(-g)) * u;
            }
        } else {
            const int c0 = nb * 16, n = N - c0 < 16 ? N - c0 : 16;
            for (int c = 0; c < n; ++c) {
                float y = r[c];
                if (bias) y += bias[c0 + c];
                if (op == 1) y += other[row * N + c0 + c];
                out[row * N + c0 + c] = y;
            }
        }
    }
}

/* Software prefetch of the weights the thread reads next: `pfl` blocks' worth per k step from
 * `pf` (16 · pfl weights of WSZ bytes: with bf16 weights one line every other step; 0: none). A
 * decode step streams every weight from memory once; without it the first row tile of each block
 * waits on memory and the later tiles compute from cache, one after the other. */
#define W_PREFETCH(pf, pfl, k, WSZ)                                                                \
    if (pfl) {                                                                                     \
        const int64_t st_ = 16 * (WSZ) * (pfl), o_ = (int64_t)(k) * st_;                           \
        if (o_ % 64 < st_) _mm_prefetch((const char *)(pf) + o_, _MM_HINT_T1);                     \
        if (st_ > 64) _mm_prefetch((const char *)(pf) + o_ + 64, _MM_HINT_T1);                     \
    }

/* Weight loads of the tiles, by storage type: fp32, or bf16 widened to fp32 exactly (the bf16 bits
 * are the top half of the float). The arithmetic is fp32 FMAs either way. The w16 tiles take two
 * steps k, k + 1 per iteration from the interleaved layout of w16_linear_pack_rows: UNPK_LO gives
 * step k's vector, UNPK_HI step k + 1's, one unpack against zero (z_) each; LDW_w16 widens the
 * plain-order last step of an odd K. */
#ifdef __AVX512F__
#define LDW_f32(p) _mm512_loadu_ps(p)
#define LDW_w16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(                    \
                       _mm256_loadu_si256((const __m256i *)(p))), 16))
#define UNPK_LO(p) _mm512_castsi512_ps(_mm512_unpacklo_epi16(z_, _mm512_loadu_si512(p)))
#define UNPK_HI(p) _mm512_castsi512_ps(_mm512_unpackhi_epi16(z_, _mm512_loadu_si512(p)))
#define ZERO_I _mm512_setzero_si512()
typedef __m512i wveci;
#else
#define LDW_f32(p) _mm256_loadu_ps(p)
#define LDW_w16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(                    \
                       _mm_loadu_si128((const __m128i *)(p))), 16))
#define UNPK_LO(p) _mm256_castsi256_ps(_mm256_unpacklo_epi16(z_, _mm256_loadu_si256((const __m256i *)(p))))
#define UNPK_HI(p) _mm256_castsi256_ps(_mm256_unpackhi_epi16(z_, _mm256_loadu_si256((const __m256i *)(p))))
#define ZERO_I _mm256_setzero_si256()
typedef __m256i wveci;
#endif

/* The k loop of a tile, by weight type: FMA_ROWS(MB, NBT, W0, W1, k) (per ISA, below) adds
 * x[:, k] times the weight vectors W0 and W1 to the tile's accumulators. W0 is read at the
 * tile's block `wp`, W1 at the offset O1_* from it (AVX-512: the next block; AVX2: the same
 * block's outputs 8-15, 8 fp32 or 16 interleaved bf16 on). */
#define KLOOP_f32(MB, NBT)                                                                         \
    for (int k = 0; k < K; ++k) {                                                                  \
        W_PREFETCH(pf, pfl, k, 4)                                                                  \
        FMA_ROWS(MB, NBT, LDW_f32(wp + k * 16), LDW_f32(wp + O1_PLAIN + k * 16), k)                \
    }
#define KLOOP_w16(MB, NBT)                                                                         \
    const wveci z_ = ZERO_I;                                                                       \
    for (int k = 0; k + 1 < K; k += 2) {                                                           \
        W_PREFETCH(pf, pfl, k, 2) W_PREFETCH(pf, pfl, k + 1, 2)                                    \
        FMA_ROWS(MB, NBT, UNPK_LO(wp + k * 16), UNPK_LO(wp + O1_PAIRS + k * 16), k)                \
        FMA_ROWS(MB, NBT, UNPK_HI(wp + k * 16), UNPK_HI(wp + O1_PAIRS + k * 16), k + 1)            \
    }                                                                                              \
    if (K & 1) {                                                                                   \
        W_PREFETCH(pf, pfl, K - 1, 2)                                                              \
        FMA_ROWS(MB, NBT, LDW_w16(wp + (K - 1) * 16), LDW_w16(wp + O1_PLAIN + (K - 1) * 16), K - 1) \
    }

#ifdef __AVX512F__
/* AVX-512: a tile is up to 12 rows × two 16-output blocks (NBT = 2; 24 accumulators, 2 weight
 * vectors and a broadcast of the 32 registers), or × one block for an odd last block. Twice the
 * FMA width of the AVX2 tile: on CPUs with two 512-bit FMA units (Intel Xeon) that is twice the
 * arithmetic per cycle, where batch-32 decode steps are compute-bound. */
#define F32_MR 12
#define MR_f32 12
#define MR_w16 12
#define F32_NBT 2
#define O1_PLAIN o1
#define O1_PAIRS o1
#define FMA_ROWS(MB, NBT, W0, W1, k)                                                               \
    {                                                                                              \
        const __m512 w0_ = (W0), w1_ = NBT > 1 ? (W1) : w0_;                                       \
        _Pragma("GCC unroll 12") for (int m = 0; m < MB; ++m) {                                    \
            const __m512 xb = _mm512_set1_ps(x[m * xs + (k)]);                                     \
            acc[NBT * m] = _mm512_fmadd_ps(xb, w0_, acc[NBT * m]);                                 \
            if (NBT > 1) acc[NBT * m + 1] = _mm512_fmadd_ps(xb, w1_, acc[NBT * m + 1]);            \
        }                                                                                          \
    }
#define TILE_F32(SUF, WT, MB, NBT)                                                                 \
static inline void tile##SUF##MB##_##NBT(const float *x, int64_t xs, const WT *wp, int64_t bs, int K, \
                                         float *res, const WT *pf, int pfl) {                      \
    __m512 acc[NBT * MB];                                                                          \
    _Pragma("GCC unroll 24") for (int i = 0; i < NBT * MB; ++i) acc[i] = _mm512_setzero_ps();      \
    const int64_t o1 = NBT > 1 ? bs : 0;                                                           \
    KLOOP_##SUF(MB, NBT)                                                                           \
    _Pragma("GCC unroll 12") for (int m = 0; m < MB; ++m) {                                        \
        _mm512_storeu_ps(res + 16 * m, acc[NBT * m]);                                              \
        if (NBT > 1) _mm512_storeu_ps(res + 16 * (F32_MR + m), acc[NBT * m + 1]);                  \
    }                                                                                              \
}
#define TILES_F32(SUF, WT, NBT) TILE_F32(SUF, WT, 1, NBT) TILE_F32(SUF, WT, 2, NBT)                \
    TILE_F32(SUF, WT, 3, NBT) TILE_F32(SUF, WT, 4, NBT) TILE_F32(SUF, WT, 5, NBT)                 \
    TILE_F32(SUF, WT, 6, NBT) TILE_F32(SUF, WT, 7, NBT) TILE_F32(SUF, WT, 8, NBT)                 \
    TILE_F32(SUF, WT, 9, NBT) TILE_F32(SUF, WT, 10, NBT) TILE_F32(SUF, WT, 11, NBT)               \
    TILE_F32(SUF, WT, 12, NBT)
#define F32_CASE(SUF, MB, NBT) case MB: tile##SUF##MB##_##NBT(xm, K, w, bs, K, res, pf, pfl); break;
#define F32_CASES(SUF, NBT) F32_CASE(SUF, 1, NBT) F32_CASE(SUF, 2, NBT) F32_CASE(SUF, 3, NBT)      \
    F32_CASE(SUF, 4, NBT) F32_CASE(SUF, 5, NBT) F32_CASE(SUF, 6, NBT) F32_CASE(SUF, 7, NBT)        \
    F32_CASE(SUF, 8, NBT) F32_CASE(SUF, 9, NBT) F32_CASE(SUF, 10, NBT) F32_CASE(SUF, 11, NBT)      \
    default: tile##SUF##12_##NBT(xm, K, w, bs, K, res, pf, pfl); break;
#define DEFINE_F32_TILES(SUF, WT)                                                                  \
TILES_F32(SUF, WT, 1) TILES_F32(SUF, WT, 2)                                                        \
static inline void SUF##_tile(const float *xm, int mb, const WT *w, int64_t bs, int K, int nbt,    \
                              float *res, const WT *pf, int pfl) {                                 \
    if (nbt > 1) { switch (mb) { F32_CASES(SUF, 2) } }                                             \
    else { switch (mb) { F32_CASES(SUF, 1) } }                                                     \
}
#else
/* AVX2: a tile is up to 6 rows × one 16-output block: 12 accumulators, 2 weight vectors and a
 * broadcast, 15 of AVX2's 16 registers. The w16 tiles also hold the zero of the unpacks: at 6
 * rows GCC spilled accumulators in the k loop (25% slower at 16-32 rows), so they take 5. */
#define F32_MR 6
#define MR_f32 6
#define MR_w16 5
#define F32_NBT 1
#define O1_PLAIN 8
#define O1_PAIRS 16
#define FMA_ROWS(MB, NBT, W0, W1, k)                                                               \
    {                                                                                              \
        const __m256 w0_ = (W0), w1_ = (W1);                                                       \
        _Pragma("GCC unroll 6") for (int m = 0; m < MB; ++m) {                                     \
            const __m256 xb = _mm256_broadcast_ss(x + m * xs + (k));                               \
            acc[2 * m] = _mm256_fmadd_ps(xb, w0_, acc[2 * m]);                                     \
            acc[2 * m + 1] = _mm256_fmadd_ps(xb, w1_, acc[2 * m + 1]);                             \
        }                                                                                          \
    }
#define TILE_F32(SUF, WT, MB)                                                                      \
static inline void tile##SUF##MB(const float *x, int64_t xs, const WT *wp, int K, float *res,      \
                                 const WT *pf, int pfl) {                                          \
    __m256 acc[2 * MB];                                                                            \
    _Pragma("GCC unroll 12") for (int i = 0; i < 2 * MB; ++i) acc[i] = _mm256_setzero_ps();        \
    KLOOP_##SUF(MB, 1)                                                                             \
    _Pragma("GCC unroll 12") for (int i = 0; i < 2 * MB; ++i) _mm256_storeu_ps(res + 8 * i, acc[i]); \
}
#define DEFINE_F32_TILES(SUF, WT)                                                                  \
TILE_F32(SUF, WT, 1) TILE_F32(SUF, WT, 2) TILE_F32(SUF, WT, 3) TILE_F32(SUF, WT, 4)                \
TILE_F32(SUF, WT, 5) TILE_F32(SUF, WT, 6)                                                          \
static inline void SUF##_tile(const float *xm, int mb, const WT *w, int64_t bs, int K, int nbt,    \
                              float *res, const WT *pf, int pfl) {                                 \
    (void)bs; (void)nbt;                                 /* one block per tile */                  \
    switch (mb) {                                                                                  \
        case 1: tile##SUF##1(xm, K, w, K, res, pf, pfl); break;                                    \
        case 2: tile##SUF##2(xm, K, w, K, res, pf, pfl); break;                                    \
        case 3: tile##SUF##3(xm, K, w, K, res, pf, pfl); break;                                    \
        case 4: tile##SUF##4(xm, K, w, K, res, pf, pfl); break;                                    \
        case 5: tile##SUF##5(xm, K, w, K, res, pf, pfl); break;                                    \
        default: tile##SUF##6(xm, K, w, K, res, pf, pfl); break;                                   \
    }                                                                                              \
}
#endif
DEFINE_F32_TILES(f32, float)
DEFINE_F32_TILES(w16, bf16)

/* rows of tile `tile` when `rows` are cut into `n` tiles whose heights differ by at most one */
static inline int mb_of(int rows, int n, int tile) { return rows / n + (tile < rows % n); }

/* y = x W^T (+ bias) then: op 0 → y; 1 → y + other; 2 (swiglu-packed W) → silu(g)*u.
 * x: M x K fp32; other/out: M x N_out fp32; bias fp32 or NULL (swiglu: of the fused [gate; up]).
 * f32_linear reads fp32 weights, w16_linear bf16 ones, unpacked to fp32 in the tile (half the
 * bytes; a decode step at a few rows is bound by the weight reads): same blocks, same fp32
 * arithmetic. Measured on a 2-core Xeon, 24 matrices of 1536 × 576 streamed from memory, w16
 * against f32: 1.7-2.0× as fast at 1-4 rows, 1.3-1.8× at 8-16, 1.16× at 32 (AVX-512 and AVX2;
 * docs/rollout.md). Widening a block once into an fp32 scratch shared by the row tiles measured
 * no faster, so the tiles widen as they load.
 * Work items: (row chunk, group of F32_NBT blocks). While a thread computes one item, its row
 * tiles prefetch the next item's weights (each block's K lines: one tile per block, or a lone
 * tile all of them). */
#define DEFINE_F32_LINEAR(SUF, WT)                                                           \
void SUF##_linear(const float *x, const WT *wp, const float *bias, const float *other, float *out, \
                  int M, int K, int N, int op) {                                                   \
    const int swiglu = op == 2;                                                                    \
    const int NO = swiglu ? N / 2 : N;                                                             \
    const int NB = swiglu ? (NO + 7) / 8 : (N + 15) / 16;                                          \
    const int NG = (NB + F32_NBT - 1) / F32_NBT;                                                   \
    const int64_t bs = (int64_t)K * 16;                  /* weights per packed block */            \
    const int MC = 192, n_chunks = (M + MC - 1) / MC;    /* rows of x kept in L2 while W streams */\
    const int64_t n_items = (int64_t)n_chunks * NG;                                                \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int64_t it = 0; it < n_items; ++it) {                                                     \
        const int nb = (int)(it % NG) * F32_NBT, mc = (int)(it / NG);                              \
        const int nbt = NB - nb < F32_NBT ? NB - nb : F32_NBT;                                     \
        const int m_end = (mc + 1) * MC < M ? (mc + 1) * MC : M;                                   \
        const int n_tiles = (m_end - mc * MC + MR_##SUF - 1) / MR_##SUF;                           \
        const int nb_next = it + 1 < n_items ? (int)((it + 1) % NG) * F32_NBT : NB;                \
        const int nbt_next = NB - nb_next < F32_NBT ? NB - nb_next : F32_NBT; /* 0: nothing next */\
        const WT *w = wp + nb * bs, *pf_next = wp + (int64_t)nb_next * bs;                         \
        float res[2 * F32_MR * 16];                                                                \
        /* n_tiles tiles of balanced heights (32 rows: 11 + 11 + 10, not 12 + 12 + 8): a short     \
         * tile has too few accumulators to hide the FMA latency */                                \
        for (int tile = 0, m0 = mc * MC, mb; tile < n_tiles; ++tile, m0 += mb) {                   \
            mb = mb_of(m_end - mc * MC, n_tiles, tile);                                            \
            const int pfl = n_tiles == 1 ? nbt_next : tile < nbt_next;                             \
            SUF##_tile(x + (int64_t)m0 * K, mb, w, bs, K, nbt, res, pf_next + tile * bs, pfl);     \
            for (int j = 0; j < nbt; ++j)                                                          \
                f32_block_out(res + j * F32_MR * 16, mb, m0, nb + j, N, NO, swiglu, op, bias,      \
                              other, out);                                                         \
        }                                                                                          \
    }                                                                                              \
}
DEFINE_F32_LINEAR(f32, float)
DEFINE_F32_LINEAR(w16, bf16)

/* decode_layers_f32: decode_layers_bf16 for fp32 engines (same table layout, fp32 tensors, the
 * 16-output packed weights of f32_linear_pack_rows); decode_layers_w16: the same with the bf16
 * weights of w16_linear_pack_rows. scratch: B * (2E + (H + 2KV) D + H D + I) floats. */
#define DEFINE_F32_LAYERS(SUF, WT)                                                                 \
void decode_layers_##SUF(float *x, int B, int L, const void *const *w, const float *cos_BD,        \
                         const float *sins_BD, float *K, float *V, int64_t layer_stride,           \
                         const int64_t *start, int E, int H, int KV, int D, int I, int Tmax, int col, \
                         float scale, float eps, float *scratch) {                                 \
    const int W = (H + 2 * KV) * D, HD = H * D;                                                    \
    float *h = scratch, *qkv = h + (size_t)B * E, *a = qkv + (size_t)B * W, *m = a + (size_t)B * HD, \
          *x2 = m + (size_t)B * I;                                                                 \
    for (int l = 0; l < L; ++l) {                                                                  \
        const void *const *wl = w + 10 * l;                                                        \
        rms_norm_f32(x, (const float *)wl[0], h, B, E, eps);                                       \
        SUF##_linear(h, (const WT *)wl[1], (const float *)wl[2], 0, qkv, B, E, W, 0);              \
        decode_attention_f32(qkv, cos_BD, sins_BD, K + l * layer_stride, V + l * layer_stride, start, a, \
                             B, H, KV, D, Tmax, col, scale);                                       \
        SUF##_linear(a, (const WT *)wl[3], (const float *)wl[4], x, x2, B, HD, E, 1);              \
        rms_norm_f32(x2, (const float *)wl[5], h, B, E, eps);                                      \
        SUF##_linear(h, (const WT *)wl[6], (const float *)wl[7], 0, m, B, E, 2 * I, 2);            \
        SUF##_linear(m, (const WT *)wl[8], (const float *)wl[9], x2, x, B, I, E, 1);               \
    }                                                                                              \
}
DEFINE_F32_LAYERS(f32, float)
DEFINE_F32_LAYERS(w16, bf16)
#else
int f32_linear_available(void) { return 0; }
#endif
