/* What int4.c (the products) and int4_fit.c (the quantizer) share: the group size of gpt2port/quant4.py's packed
 * rows, and IEEE half <-> single for their scales and minimums. */
#ifndef GPT2PORT_INT4_H
#define GPT2PORT_INT4_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32

/* IEEE half to single, exactly (normal, subnormal, zero, infinity, NaN). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13);
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) u = sign;
    else {  /* subnormal: m * 2^-24, exact in fp32 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Single to IEEE half, rounded to nearest, ties to even (as PyTorch's .half()). */
static inline uint16_t float_to_half(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  /* 65520 and up: infinity */
    if (a < 0x38800000u) {  /* below 2^-14: a subnormal half, v * 2^24 rounded (exactly representable first) */
        float v;
        memcpy(&v, &a, sizeof v);
        return (uint16_t)(sign | (uint16_t)lrintf(v * 16777216.0f));
    }
    a += 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((a - 0x38000000u) >> 13));
}

#endif
