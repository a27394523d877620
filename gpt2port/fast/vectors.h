/* What gpt2port's C kernels (matvec.c, attention.c) share: vectors of LANES fp32 numbers in the vector extension of
 * GCC and Clang (whatever the target, the compiler maps them onto its registers), and bf16 <-> fp32 as PyTorch
 * converts, and the reading of a row of either as fp32. */
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

#endif
