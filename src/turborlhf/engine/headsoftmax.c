/* Log-softmax of LM-head logits for the trainers (turborlhf.models.head_logprobs), built once per
 * machine by turborlhf/engine/cbuild.py and called through ctypes with raw data pointers.
 *
 * Why: with torch ops, the log-probs of N chosen tokens and their backward run six to eight
 * element-wise passes over N x V fp32 values (V = 49152 for SmolLM2: 200 MB per 1024 tokens)
 * between the two matmuls. Here each row of logits is read once to find its maximum and once to
 * sum its exponentials (the row stays in L2), and the backward reads it once and writes the
 * gradient once, in the logits' own dtype.
 *
 * Forward, per row i with y = logits[i] / T:
 *   lse[i]  = max(y) + log(s),  s = sum_j exp(y_j - max(y))
 *   logp[i] = y[label_i] - lse[i]
 *   ent[i]  = log(s) - sum_j exp(y_j - max) (y_j - max) / s   (two non-negative terms: no cancellation)
 * Backward: dlogits[i][j] = g[i] (onehot_j(label_i) - exp(y_j - lse[i])) / T.
 *
 * Built with -ffast-math (vectorised expf from libmvec), so NaN/inf are detected from the bits of
 * each logit and make that row's outputs NaN (a run with a NaN in its model must stop, not train on a
 * maximum that skipped it). Exponents below -80 are clamped (expf is slow on arguments that
 * underflow) and probabilities below 1e-30 are 0 (denormal floats slow the matmuls that follow):
 * changes below 1e-25 in a log-sum-exp over any vocabulary under 10^5 tokens.
 */
#include <math.h>
#include <string.h>

#include "bf16.h"

#define NAN_BITS 0x7fc00000u
#define EXP_MIN -80.0f      /* clamp before expf */
#define LOGP_ZERO -69.0f    /* exp(-69) ~ 1e-30: below, the probability is 0 */

/* One row: its maximum of y = x / T, and whether any x is NaN/inf (from the bits, which
 * -ffast-math cannot fold away). X is the element type, LOAD widens one element. */
#define ROW_MAX(X, LOAD, BITS)                                               \
    float m = -3.0e38f;                                                      \
    uint32_t bad = 0;                                                        \
    _Pragma("omp simd reduction(max:m) reduction(|:bad)")                    \
    for (int64_t j = 0; j < V; j++) {                                        \
        const float y = LOAD(x[j]) / T;                                      \
        bad |= (uint32_t)((BITS(x[j]) & 0x7f800000u) == 0x7f800000u);        \
        m = y > m ? y : m;                                                   \
    }

#define BF16_BITS(h) (((uint32_t)(h)) << 16)
#define F32_BITS(f) f2u(f)
#define F32_LOAD(f) (f)

#define FORWARD(NAME, X, LOAD, BITS)                                                           \
void NAME(const X *logits, int64_t n, int64_t V, const int64_t *labels, float T, float *lse,   \
          float *logp, float *ent) {                                                           \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t i = 0; i < n; i++) {                                                          \
        const X *x = logits + i * V;                                                           \
        ROW_MAX(X, LOAD, BITS)                                                                 \
        if (bad) {                                                                             \
            lse[i] = logp[i] = u2f(NAN_BITS);                                                  \
            if (ent) ent[i] = u2f(NAN_BITS);                                                   \
            continue;                                                                          \
        }                                                                                      \
        float s = 0.0f, sy = 0.0f;                                                             \
        _Pragma("omp simd reduction(+:s, sy)")                                                 \
        for (int64_t j = 0; j < V; j++) {                                                      \
            float y = LOAD(x[j]) / T - m;                                                      \
            y = y < EXP_MIN ? EXP_MIN : y;                                                     \
            const float e = y < LOGP_ZERO ? 0.0f : expf(y);                                    \
            s += e;                                                                            \
            sy += e * y;                                                                       \
        }                                                                                      \
        const float log_s = logf(s);                                                           \
        lse[i] = m + log_s;                                                                    \
        logp[i] = LOAD(x[labels[i]]) / T - lse[i];                                             \
        if (ent) ent[i] = log_s - sy / s;                                                      \
    }                                                                                          \
}

#define BACKWARD(NAME, X, LOAD, STORE)                                                         \
void NAME(const X *logits, int64_t n, int64_t V, const int64_t *labels, float T,              \
          const float *lse, const float *g, X *dlogits) {                                      \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t i = 0; i < n; i++) {                                                          \
        const X *x = logits + i * V;                                                           \
        X *d = dlogits + i * V;                                                                \
        const float l = lse[i], gi = g[i] / T;                                                 \
        const int64_t label = labels[i];                                                       \
        _Pragma("omp simd")                                                                    \
        for (int64_t j = 0; j < V; j++) {                                                      \
            float y = LOAD(x[j]) / T - l;                                                      \
            y = y < EXP_MIN ? EXP_MIN : y;                                                     \
            const float p = y < LOGP_ZERO ? 0.0f : expf(y);                                    \
            d[j] = STORE((j == label ? gi : 0.0f) - gi * p);                                   \
        }                                                                                      \
    }                                                                                          \
}

#define F32_STORE(f) (f)

FORWARD(head_logsoftmax_fwd_bf16, bf16, bf2f, BF16_BITS)
FORWARD(head_logsoftmax_fwd_f32, float, F32_LOAD, F32_BITS)
BACKWARD(head_logsoftmax_bwd_bf16, bf16, bf2f, f2bf)
BACKWARD(head_logsoftmax_bwd_f32, float, F32_LOAD, F32_STORE)

int turborlhf_headsoftmax_version(void) { return 1; }
