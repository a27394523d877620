/* What gpt2port's C kernels (matvec.c, attention.c, int4.c, layers.c) share: vectors of LANES fp32 numbers in the
 * vector extension of GCC and Clang (whatever the target, the compiler maps them onto its registers), bf16 <-> fp32 as
 * PyTorch converts, the reading of a row of either as fp32, the sum of a vector's lanes and e^x lane by lane. */
#ifndef GPT2PORT_VECTORS_H
#define GPT2PORT_VECTORS_H

#include <stdint.h>
#include <string.h>

#define LANES 16

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
/* The same vectors read from any element's address (rows start anywhere): alignment of one element, may alias. */
typedef float unaligned_vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)), may_alias));
typedef uint16_t unaligned_bf16_vec
    __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(sizeof(uint16_t)), may_alias));
typedef uint32_t u32_vec __attribute__((vector_size(LANES * sizeof(uint32_t))));

#define load(p) (*(const unaligned_vec *)(p))

/* bf16 is the upper half of an fp32's bits: widening is exact. */
#define widen(p) ((vec)(__builtin_convertvector(*(const unaligned_bf16_vec *)(p), u32_vec) << 16))

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Rounded to the nearest bf16, ties to even, NaN kept a NaN: as PyTorch converts. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element j of a row of fp32 or bf16 numbers, widened to fp32, and the LANES elements from j on: `half` says bf16 (a
 * constant wherever these are inlined, so each kernel has one copy per type). */
#define ELEM(p, j, half) ((half) ? bf16_to_f32(((const uint16_t *)(p))[j]) : ((const float *)(p))[j])
#define VEC(p, j, half) ((half) ? widen((const uint16_t *)(p) + (j)) : (vec)load((const float *)(p) + (j)))

typedef float half_vec __attribute__((vector_size(LANES * sizeof(float) / 2)));
typedef float quarter_vec __attribute__((vector_size(LANES * sizeof(float) / 4)));

/* The sum of a vector's lanes, halving it (the halves copied out, which compilers turn into register moves): a few
 * dependent additions instead of LANES. */
static inline float lanes_sum(vec a) {
    half_vec lo, hi;
    memcpy(&lo, &a, sizeof lo);
    memcpy(&hi, (char *)&a + sizeof lo, sizeof hi);
    lo += hi;
    quarter_vec q0, q1;
    memcpy(&q0, &lo, sizeof q0);
    memcpy(&q1, (char *)&lo + sizeof q0, sizeof q1);
    q0 += q1;
    float t = 0.f;
    for (int l = 0; l < LANES / 4; l++) t += q0[l];
    return t;
}

typedef int32_t i32_vec __attribute__((vector_size(LANES * sizeof(int32_t))));

/* e^x for each of x's lanes, x <= 0 (a score minus the largest; minus twice a magnitude), to a relative 1e-7
 * (measured against exp in double over [-87, 0]): x = n ln2 + r with n whole and |r| <= ln2 / 2, e^r by a polynomial,
 * 2^n put into the exponent's bits. Below -87, where e^x < 2^-125 is nothing beside 1, it gives 0; a NaN stays a
 * NaN. expf one number at a time took a third of a 1024-position head's time (attention.c). */
static inline vec exp_lanes(vec x) {
    const vec zero = {0};
    i32_vec under = x < zero - 87.f;
    /* taken as -87 there, so that n converts to a whole number in range (the result is masked to 0 after) */
    x = (vec)(((i32_vec)x & ~under) | ((i32_vec)(zero - 87.f) & under));
    vec n = (x * 1.44269504f + 12582912.f) - 12582912.f;  /* x / ln2 rounded to a whole number (1.5 * 2^23's trick) */
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;    /* ln2 in two parts, the first exact in a few bits */
    vec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    i32_vec bits = (__builtin_convertvector(n, i32_vec) + 127) << 23;
    return (vec)((i32_vec)(p * (vec)bits) & ~under);
}

#endif
