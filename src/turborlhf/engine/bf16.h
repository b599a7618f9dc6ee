/* bf16 <-> fp32 conversions shared by the C sources of turborlhf/engine (cbuild.py puts the text of
 * every header a source includes this way into its build's cache key). Integer operations only,
 * so they vectorise and mean the same with or without -ffast-math. */
#ifndef TURBORLHF_BF16_H
#define TURBORLHF_BF16_H

#include <stdint.h>

typedef uint16_t bf16;

static inline uint32_t f2u(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    return v.u;
}

static inline float u2f(uint32_t u) {
    union { uint32_t u; float f; } v;
    v.u = u;
    return v.f;
}

/* bf16 -> fp32, exact (the bf16 bits are the top half of the float) */
static inline float bf2f(bf16 h) { return u2f(((uint32_t)h) << 16); }

/* fp32 -> bf16, round to nearest even (torch's .to(torch.bfloat16)); NaN stays a quiet NaN, tested
 * on the bits (which -ffast-math cannot fold away) */
static inline bf16 f2bf(float f) {
    const uint32_t u = f2u(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)(((u & 0x7fffffffu) > 0x7f800000u) ? ((u >> 16) | 0x40u) : rounded);
}

#endif
