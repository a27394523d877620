/* What int4.c (the products) and int4_fit.c (the quantizer) share: the group size of gpt2port/quant4.py's packed
 * rows and how a group's scale and zero are read from their bytes. */
#ifndef GPT2PORT_INT4_H
#define GPT2PORT_INT4_H

#include <math.h>
#include <stdint.h>

#define GROUP 32

/* 2^(-j / 32), j = 0..31, rounded to fp32 (gpt2port/quant4.py's SCALE_STEPS: the same numbers) */
static const float SCALE_STEP[32] = {
    0x1.0p+0f, 0x1.f50766p-1f, 0x1.ea4afap-1f, 0x1.dfc974p-1f, 0x1.d5818ep-1f, 0x1.cb720ep-1f,
    0x1.c199bep-1f, 0x1.b7f77p-1f, 0x1.ae89fap-1f, 0x1.a5503cp-1f, 0x1.9c4918p-1f, 0x1.93737cp-1f,
    0x1.8ace54p-1f, 0x1.82589ap-1f, 0x1.7a1148p-1f, 0x1.71f75ep-1f, 0x1.6a09e6p-1f, 0x1.6247ecp-1f,
    0x1.5ab07ep-1f, 0x1.5342b6p-1f, 0x1.4bfdaep-1f, 0x1.44e086p-1f, 0x1.3dea64p-1f, 0x1.371a74p-1f,
    0x1.306fep-1f, 0x1.29e9ep-1f, 0x1.2387a6p-1f, 0x1.1d4874p-1f, 0x1.172b84p-1f, 0x1.11301ep-1f,
    0x1.0b5586p-1f, 0x1.059b0ep-1f};

/* 2^(-j), j = 0..7 */
static const float POWER[8] = {1.f, 0.5f, 0.25f, 0.125f, 0.0625f, 0.03125f, 0.015625f, 0.0078125f};

/* A group's scale from its row's base and its scale byte c: base * 2^(-c / 32), as base * 2^(-(c % 32) / 32) rounded,
 * then times 2^(-(c / 32)) (exact but where it underflows, and then rounded as a scaling is) */
static inline float group_scale(float base, uint8_t c) { return base * SCALE_STEP[c & 31] * POWER[c >> 5]; }

/* A group's zero byte z in codes: z u - 2^(bits - 1), u = 2^(bits - ZERO_SHIFT) (its middle code's offset, so that a
 * zero reaches either side alike) */
#define ZERO_SHIFT 8
static inline float zero_unit(int bits) { return (float)(1 << bits) / (float)(1 << ZERO_SHIFT); }
static inline float zero_middle(int bits) { return (float)(1 << (bits - 1)); }
static inline float zero_codes(int8_t z, int bits) { return (float)z * zero_unit(bits) - zero_middle(bits); }

/* Bytes of a packed row of k numbers (a multiple of GROUP): codes, scale bytes, zero bytes, the fp32 base */
static inline int64_t row_stride(int64_t k, int bits) { return k * bits / 8 + 2 * (k / GROUP) + 4; }

#endif
