/* Weights of 4, 6 or 8 bits, group-wise (gpt2port/quant4.py): one row times a weight, y[n] = W[n, k] . x[k]
 * (+ b[n]), and a block of rows dequantized to fp32 (for products of many rows, which a GEMM does better).
 *
 * A packed row of k numbers (k a multiple of GROUP) is its codes, 4 * bits bytes per group, then k / GROUP scale
 * bytes c, then k / GROUP zero bytes z (int8), then the row's fp32 base: w[GROUP g + i] = s[g] (code + zu[g]),
 * s[g] = base 2^(-c[g] / 32) (int4.h's group_scale), zu[g] = z[g] 2^bits / 256 - 2^(bits - 1) (zero_codes).
 * 8-bit codes are one byte each.
 * Narrower codes keep their low four bits as nibbles, byte i of a group holding element i in its low nibble and
 * element i + 16 in its high one (so that one vector of bytes widens into the group's two halves); a 6-bit code's
 * two higher bits follow in 8 bytes, byte j holding those of elements j, j + 8, j + 16, j + 24 from its low bits up
 * (one byte per lane after a shift that depends only on the lane). The width of a row says which: k * bits / 8 + k /
 * 16 + 4 bytes, bits 4, 6 or 8.
 *
 * The activations are rounded first, per group of GROUP: d = max|x_g| / 127, q = round(x / d) (ties to even; 0 where
 * d is 0; a group holding a NaN or an infinity gives NaN), as llama.cpp rounds them for its 4-bit types, and gpt2port's
 * quant4.round_activations in PyTorch. The product is then y = sum_g s[g] d[g] (codes_g . q_g) + sum_g s[g] zu[g] d[g]
 * (sum of q_g): every group's dot product of codes and q is an integer (at most 32 x 255 x 127 < 2^24, so exact in
 * fp32 too), so the result is the fp32 product of the dequantized weight by the rounded activations up to the order
 * of its sums, whichever of the two ways below forms it. Where the CPU has AVX-512 VNNI, codes of every width meet q in
 * integer dot products, two groups at a time (vpdpbusd: 64 unsigned codes by 64 signed bytes), ~4x fewer instructions
 * a weight than widening both to floats, which is what bounded the step (docs/performance.md); elsewhere codes and q
 * are widened to fp32. Rows are read STREAMS at a time from far-apart runs, as matvec.c does
 * (and each slice of q loaded once for the four), each run prefetched AHEAD bytes ahead: without it a step's products
 * (100 MB at 124M, none in cache) ran at half of what one core reads (scripts/bench/int4_kernel.py).
 * With AVX-512, nibbles become floats by a lookup in {0, ..., 15} (vpermps reads an index's low four bits, so the
 * low nibble needs no mask and no conversion), and a 6-bit code's high bits by a lookup in {0, 16, 32, 48}: fewer
 * instructions per group where the narrow rows are bound by them (a masked add per bit, bit planes, took 1.6x the
 * time of 8-bit codes in cache). Written in the vector extension of GCC and Clang: with
 * -march=native the compiler maps it onto AVX-512, AVX2 or NEON, without it onto SSE; every row's sum is formed in
 * the same order whatever the thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int4.h"
#include "vectors.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define STREAMS 4
#define AHEAD 2048 /* bytes: a prefetch's distance along each run of rows */

typedef uint8_t bytes16 __attribute__((vector_size(16)));

/* 16 bytes from any address widened to 16 int32: one instruction where the compiler is told it may (a plain
 * conversion of an unaligned vector was compiled byte by byte). */
static inline __attribute__((always_inline)) i32_vec widen_bytes(const uint8_t *p) {
#ifdef __AVX512F__
    return (i32_vec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    bytes16 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, i32_vec);
#endif
}

/* The row's group scales times the groups' d into `scales`, and sum_g s[g] zu[g] sums[g] (the minimums' part of the
 * product) as a vector of partial sums, which the row's own sums then take in before their one reduction: 16 groups
 * at a time with AVX-512. */
static inline vec row_setup(const uint8_t *row, const float *d, const float *sums, float *scales, int64_t groups,
                            int64_t codes, int bits) {
    const uint8_t *c = row + codes;
    const int8_t *z = (const int8_t *)(c + groups);
    float base, offset = 0.f;
    vec partial = {0};
    memcpy(&base, c + 2 * groups, 4);  /* rows start at any even byte: read unaligned */
    int64_t g = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    __m512 acc = _mm512_setzero_ps(), b = _mm512_set1_ps(base), steps = _mm512_loadu_ps(SCALE_STEP),
           steps2 = _mm512_loadu_ps(SCALE_STEP + 16), u = _mm512_set1_ps(zero_unit(bits)),
           h = _mm512_set1_ps(zero_middle(bits));
    for (; g < groups; g += 16) {  /* the last 1-15 groups under a mask (one scalar call each cost a third of a row) */
        __mmask16 on = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1);
        __m512i cs = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(on, c + g));
        /* 2^(-(c % 32) / 32) looked up, 2^(-(c / 32)) subtracted from its exponent (exact: no table entry is near
         * underflow), then times the base: the same product as group_scale's but where it underflows */
        __m512i e = _mm512_slli_epi32(_mm512_srli_epi32(cs, 5), 23);
        __m512 s = _mm512_mul_ps(b, _mm512_castsi512_ps(_mm512_sub_epi32(
                                        _mm512_castps_si512(_mm512_permutex2var_ps(steps, cs, steps2)), e)));
        __m512 zu = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(on, z + g))), u, h);
        _mm512_mask_storeu_ps(scales + g, on, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(on, d + g)));
        acc = _mm512_fmadd_ps(_mm512_mul_ps(s, zu), _mm512_maskz_loadu_ps(on, sums + g), acc);
    }
    partial = (vec)acc;
#endif
    for (; g < groups; g++) {
        float s = group_scale(base, c[g]);
        scales[g] = s * d[g];
        offset += s * zero_codes(z[g], bits) * sums[g];
    }
    partial[0] += offset;
    return partial;
}

/* A 6-bit group's high bits: 8 bytes, byte j holding element j + 8 m's two bits at bits 2 m, 2 m + 1 (m = 0..3).
 * Read twice into 16 lanes (lane i: byte i % 8), then shifted per lane, each lane's low two bits are element i's
 * (shift 0 or 2) or element i + 16's (4 or 6). */
static const i32_vec CRUMB_LO = {0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2};
static const i32_vec CRUMB_HI = {4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6};

/* One group's codes (4 or 6 bits) as two vectors of integers: elements 0..15 and 16..31. */
static inline __attribute__((always_inline)) void narrow_codes(const uint8_t *codes, int bits, i32_vec *lo,
                                                               i32_vec *hi) {
    i32_vec v = widen_bytes(codes);
    *lo = v & 15;
    *hi = v >> 4;
    if (bits == 6) {
        uint8_t twice[16];
        memcpy(twice, codes + 16, 8);
        memcpy(twice + 8, codes + 16, 8);
        i32_vec c = widen_bytes(twice);
        *lo |= ((c >> CRUMB_LO) & 3) << 4;
        *hi |= ((c >> CRUMB_HI) & 3) << 4;
    }
}

/* One group's codes times x's 32 numbers: a vector of LANES partial sums. */
static inline __attribute__((always_inline)) vec group_dot(const uint8_t *codes, vec x_lo, vec x_hi, int bits) {
    if (bits == 8)
        return __builtin_convertvector(widen_bytes(codes), vec) * x_lo +
               __builtin_convertvector(widen_bytes(codes + 16), vec) * x_hi;
#ifdef __AVX512F__
    /* vpermps reads an index's low four bits: the nibbles need no mask, the high bits' lookup ignores bits 2, 3 */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    __m512 lo = _mm512_permutexvar_ps(b, iota), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), iota);
    if (bits == 6) {
        const __m512 high = _mm512_setr_ps(0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48);
        __m128i c8 = _mm_loadl_epi64((const __m128i *)(codes + 16));
        __m512i c = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(c8, c8));
        lo = _mm512_add_ps(lo, _mm512_permutexvar_ps(_mm512_srlv_epi32(c, (__m512i)CRUMB_LO), high));
        hi = _mm512_add_ps(hi, _mm512_permutexvar_ps(_mm512_srlv_epi32(c, (__m512i)CRUMB_HI), high));
    }
    return (vec)lo * x_lo + (vec)hi * x_hi;
#else
    i32_vec lo, hi;
    narrow_codes(codes, bits, &lo, &hi);
    return __builtin_convertvector(lo, vec) * x_lo + __builtin_convertvector(hi, vec) * x_hi;
#endif
}

static inline float total(vec acc) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)acc);  /* a tree of adds: shorter than 16 in a row, once per row */
#else
    return lanes_sum(acc);
#endif
}

/* The totals of four rows' sums at once, into t[0..3]: with AVX-512 the four vectors are interleaved and added in
 * one tree, a third of the instructions of four reductions (a 768-wide 4-bit row has few to spare). */
static inline void totals(vec a0, vec a1, vec a2, vec a3, float t[4]) {
#ifdef __AVX512F__
    __m512 x = _mm512_add_ps(_mm512_unpacklo_ps((__m512)a0, (__m512)a1), _mm512_unpackhi_ps((__m512)a0, (__m512)a1)),
           y = _mm512_add_ps(_mm512_unpacklo_ps((__m512)a2, (__m512)a3), _mm512_unpackhi_ps((__m512)a2, (__m512)a3));
    /* each 128-bit lane: a0, a1, a2, a3's partial sums */
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xee));
    __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));  /* AVX-512F alone */
    __m256 w = _mm256_add_ps(_mm512_castps512_ps256(z), upper);
    _mm_storeu_ps(t, _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1)));
#else
    t[0] = total(a0), t[1] = total(a1), t[2] = total(a2), t[3] = total(a3);
#endif
}

/* The activations of one call, rounded (see the top): per group d and d * sum(q); q as floats (the widening path),
 * as bytes, and as bytes in the order 4-bit rows meet them two groups at a time (q_g[0:16], q_g+1[0:16], q_g[16:32],
 * q_g+1[16:32]: a pair's 32 code bytes' low nibbles, then their high ones). */
typedef struct {
    const float *d, *sums, *qf;
    const int8_t *q, *q4;
} activations;

/* One group's activations rounded (see the top): q as floats and bytes, d, and sum(q); d NaN where the group holds a
 * NaN or an infinity (q zeros then). */
static inline void round_group(const float *x, float *qf, int8_t *q, float *d, int32_t *sum_q) {
#ifdef __AVX512F__
    /* the same numbers 16 at a time: max is exact, the division and the rounding (ties to even) IEEE's */
    const __m512 zero = _mm512_setzero_ps();
    __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    /* x - x is 0 for every finite x, NaN for a NaN or an infinity */
    int all_finite = (__mmask16)(_mm512_cmp_ps_mask(_mm512_sub_ps(x0, x0), zero, _CMP_EQ_OQ) &
                                 _mm512_cmp_ps_mask(_mm512_sub_ps(x1, x1), zero, _CMP_EQ_OQ)) == (__mmask16)0xffff;
    float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))), step = top / 127.f;
    if (!all_finite || !(step > 0.f)) {
        memset(qf, 0, GROUP * sizeof(float));
        if (q) memset(q, 0, GROUP);
        *d = all_finite ? step : NAN;
        *sum_q = 0;
        return;
    }
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 by = _mm512_set1_ps(step), v0 = _mm512_roundscale_ps(_mm512_div_ps(x0, by), nearest),
           v1 = _mm512_roundscale_ps(_mm512_div_ps(x1, by), nearest);
    _mm512_storeu_ps(qf, v0);
    _mm512_storeu_ps(qf + 16, v1);
    __m512i i0 = _mm512_cvtps_epi32(v0), i1 = _mm512_cvtps_epi32(v1);
    if (q) {
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(i1));
    }
    *d = step;
    *sum_q = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
    float amax = 0.f;
    int finite = 1;
    for (int i = 0; i < GROUP; i++) {
        float v = fabsf(x[i]);
        finite &= isfinite(x[i]) != 0;
        amax = v > amax ? v : amax;
    }
    float dg = amax / 127.f;
    int32_t total_q = 0;
    for (int i = 0; i < GROUP; i++) {
        float v = finite && dg > 0.f ? nearbyintf(x[i] / dg) : 0.f;  /* ties to even: torch.round */
        qf[i] = v;
        if (q) q[i] = (int8_t)v;
        total_q += (int32_t)v;
    }
    *d = finite ? dg : NAN;
    *sum_q = total_q;
#endif
}

/* Rows (rows, k) of activations as the products take them, q * d (gpt2port.quant4.round_activations), for the
 * products of many rows, which multiply dequantized weights by them. */
void gpt2port_round_int4(const float *x, float *out, int64_t rows, int64_t k, int threads) {
    int64_t groups = k / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float *o = out + r * k + g * GROUP, d;
            int32_t sum_q;
            round_group(x + r * k + g * GROUP, o, NULL, &d, &sum_q);
            for (int i = 0; i < GROUP; i++) o[i] *= d;
        }
}

/* Rounds x (k) into a: 0, or -1 where memory could not be had. */
static int round_activations(const float *x, int64_t k, void **block, activations *a, int64_t extra_floats) {
    int64_t groups = k / GROUP;
    float *f = malloc(sizeof(float) * (2 * groups + k + extra_floats) + 2 * k);
    if (!f) return -1;
    float *d = f, *sums = d + groups, *qf = sums + groups;
    int8_t *q = (int8_t *)(qf + k + extra_floats), *q4 = q + k;
    for (int64_t g = 0; g < groups; g++) {
        int32_t sum_q;
        round_group(x + g * GROUP, qf + g * GROUP, q + g * GROUP, d + g, &sum_q);
        sums[g] = d[g] * (float)sum_q;
    }
    for (int64_t g = 0; g + 1 < groups; g += 2) {
        int8_t *out = q4 + g * GROUP;
        const int8_t *a0 = q + g * GROUP, *a1 = a0 + GROUP;
        memcpy(out, a0, 16);
        memcpy(out + 16, a1, 16);
        memcpy(out + 32, a0 + 16, 16);
        memcpy(out + 48, a1 + 16, 16);
    }
    *block = f;
    a->d = d, a->sums = sums, a->qf = qf, a->q = q, a->q4 = q4;
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INTEGER_DOTS 1
/* A pair of 6-bit groups' high bits in the 4-bit pair's byte order (g's elements 0-15, g + 1's 0-15, g's 16-31,
 * g + 1's 16-31): the byte of the group's 8 that holds element e (e % 8, g + 1's 8 after g's), then the shift of its
 * two bits (2 (e / 8)), the same for both bytes of each 16-bit lane. */
static const uint8_t CRUMB_BYTE[64] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
                                       8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15,
                                       0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7,
                                       8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15};
static const uint16_t CRUMB_SHIFT[32] = {0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2,
                                         4, 4, 4, 4, 6, 6, 6, 6, 4, 4, 4, 4, 6, 6, 6, 6};

/* Two groups' dot products of codes and q (g, g + 1), scaled by the row's scales (times d), added to acc. 8-bit:
 * int32 lanes 0-7 are group g's, 8-15 group g + 1's; 4- and 6-bit: lanes 0-3 and 8-11 group g's (low, then high
 * nibbles), q in that order (activations.q4). */
static inline __attribute__((always_inline)) __m512 pair_dot(const uint8_t *codes, const int8_t *q, const float *scales,
                                                             __m512 acc, int bits) {
    __m512i c;
    if (bits == 8) {
        c = _mm512_loadu_si512(codes);
    } else {
        if (bits == 4) {
            /* one broadcast from memory, then the low nibbles kept in the lower half and the high ones, in place
             * (16 times the code), in the upper half: its lanes' sums are 16 times theirs until FOLD_HIGH */
            const __m512i nibbles = _mm512_set_epi64(~0x0f0f0f0f0f0f0f0fLL, ~0x0f0f0f0f0f0f0f0fLL,
                                                     ~0x0f0f0f0f0f0f0f0fLL, ~0x0f0f0f0f0f0f0f0fLL, 0x0f0f0f0f0f0f0f0fLL,
                                                     0x0f0f0f0f0f0f0f0fLL, 0x0f0f0f0f0f0f0f0fLL, 0x0f0f0f0f0f0f0f0fLL);
            c = _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)codes)), nibbles);
        } else {  /* a 6-bit group is 24 bytes: g + 1's nibbles start at byte 24 */
            const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);  /* upper half: the high nibbles */
            __m256i nibbles = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)codes)),
                                                      _mm_loadu_si128((const __m128i *)(codes + 24)), 1);
            __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles), nibbles, 1);
            c = _mm512_and_si512(_mm512_srlv_epi64(both, shifts), _mm512_set1_epi8(15));
        }
        if (bits == 6) {
            __m128i crumbs = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(codes + 16)),
                                                _mm_loadl_epi64((const __m128i *)(codes + 40)));
            __m512i spread = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(crumbs), _mm512_loadu_si512(CRUMB_BYTE));
            __m512i high = _mm512_and_si512(_mm512_srlv_epi16(spread, _mm512_loadu_si512(CRUMB_SHIFT)),
                                            _mm512_set1_epi8(3));
            c = _mm512_or_si512(c, _mm512_slli_epi16(high, 4));
        }
    }
    __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, _mm512_loadu_si512(q));
    const __m512i pick8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i pick4 = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 two = _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)scales)));
    __m512 s = _mm512_permutexvar_ps(bits == 8 ? pick8 : pick4, two);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), s, acc);
}
/* A 4-bit row's sums with their upper lanes (the high nibbles', taken in place) divided by 16: exact, a power of two
 * (each sum was formed 16 times as large, each rounding with it), once a row rather than a shift per pair. */
#define FOLD_HIGH(acc) _mm512_mul_ps((acc), _mm512_set_ps(0.0625f, 0.0625f, 0.0625f, 0.0625f, 0.0625f, 0.0625f, \
                                                          0.0625f, 0.0625f, 1, 1, 1, 1, 1, 1, 1, 1))
#else
#define INTEGER_DOTS 0
#endif

/* Rows [r0, r1) of y: STREAMS runs of rows at a time, then the rows left over. `scratch`: STREAMS * groups floats.
 * Inlined into one copy per code width, where `bits` is a constant; `dots`: integer dot products (pair_dot) for all
 * groups but an odd last one. */
static inline __attribute__((always_inline)) void rows(const uint8_t *P, const activations *act, const float *b,
                                                       float *y, int64_t r0, int64_t r1, int64_t k, float *scratch,
                                                       int bits, int dots) {
    int64_t groups = k / GROUP, codes = k * bits / 8, per = 4 * bits, paired = dots ? groups & ~(int64_t)1 : 0;
    int64_t stride = row_stride(k, bits), run = (r1 - r0) / STREAMS;
    const float *x = act->qf, *d = act->d, *sums = act->sums;
    float *s0 = scratch, *s1 = s0 + groups, *s2 = s1 + groups, *s3 = s2 + groups;
    for (int64_t i = 0; i < run; i++) {
        int64_t r = r0 + i;
        const uint8_t *w0 = P + r * stride, *w1 = w0 + run * stride, *w2 = w1 + run * stride, *w3 = w2 + run * stride;
        vec o0 = row_setup(w0, d, sums, s0, groups, codes, bits), o1 = row_setup(w1, d, sums, s1, groups, codes, bits),
            o2 = row_setup(w2, d, sums, s2, groups, codes, bits), o3 = row_setup(w3, d, sums, s3, groups, codes, bits);
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
#if INTEGER_DOTS
        if (dots) {
            const int8_t *q = bits == 8 ? act->q : act->q4;
            __m512 i0 = _mm512_setzero_ps(), i1 = i0, i2 = i0, i3 = i0;
            for (int64_t g = 0; g < paired; g += 2) {
                if (bits != 4 || !(g & 2)) {  /* once a cache line: a 4-bit pair is half of one */
                    __builtin_prefetch(w0 + g * per + AHEAD);
                    __builtin_prefetch(w1 + g * per + AHEAD);
                    __builtin_prefetch(w2 + g * per + AHEAD);
                    __builtin_prefetch(w3 + g * per + AHEAD);
                }
                i0 = pair_dot(w0 + g * per, q + g * GROUP, s0 + g, i0, bits);
                i1 = pair_dot(w1 + g * per, q + g * GROUP, s1 + g, i1, bits);
                i2 = pair_dot(w2 + g * per, q + g * GROUP, s2 + g, i2, bits);
                i3 = pair_dot(w3 + g * per, q + g * GROUP, s3 + g, i3, bits);
            }
            if (bits == 4) i0 = FOLD_HIGH(i0), i1 = FOLD_HIGH(i1), i2 = FOLD_HIGH(i2), i3 = FOLD_HIGH(i3);
            a0 = (vec)i0, a1 = (vec)i1, a2 = (vec)i2, a3 = (vec)i3;
        }
#endif
        for (int64_t g = paired; g < groups; g++) {
            vec lo = load(x + g * GROUP), hi = load(x + g * GROUP + 16);
            __builtin_prefetch(w0 + g * per + AHEAD);  /* past the last row: harmless, a prefetch never faults */
            __builtin_prefetch(w1 + g * per + AHEAD);
            __builtin_prefetch(w2 + g * per + AHEAD);
            __builtin_prefetch(w3 + g * per + AHEAD);
            a0 += s0[g] * group_dot(w0 + g * per, lo, hi, bits);
            a1 += s1[g] * group_dot(w1 + g * per, lo, hi, bits);
            a2 += s2[g] * group_dot(w2 + g * per, lo, hi, bits);
            a3 += s3[g] * group_dot(w3 + g * per, lo, hi, bits);
        }
        float t[4];
        totals(a0 + o0, a1 + o1, a2 + o2, a3 + o3, t);
        for (int j = 0; j < STREAMS; j++) y[r + j * run] = t[j] + (b ? b[r + j * run] : 0.f);
    }
    for (int64_t r = r0 + STREAMS * run; r < r1; r++) {
        const uint8_t *w = P + r * stride;
        vec o = row_setup(w, d, sums, s0, groups, codes, bits);
        vec a = {0};
#if INTEGER_DOTS
        if (dots) {
            const int8_t *q = bits == 8 ? act->q : act->q4;
            __m512 i0 = _mm512_setzero_ps();
            for (int64_t g = 0; g < paired; g += 2, __builtin_prefetch(w + g * per + AHEAD))
                i0 = pair_dot(w + g * per, q + g * GROUP, s0 + g, i0, bits);
            a = (vec)(bits == 4 ? FOLD_HIGH(i0) : i0);
        }
#endif
        for (int64_t g = paired; g < groups; g++, __builtin_prefetch(w + g * per + AHEAD))
            a += s0[g] * group_dot(w + g * per, load(x + g * GROUP), load(x + g * GROUP + 16), bits);
        y[r] = total(a + o) + (b ? b[r] : 0.f);
    }
}

#define ROWS(bits, dots)                                                                                           \
    static void rows##bits(const uint8_t *P, const activations *act, const float *b, float *y, int64_t r0,          \
                           int64_t r1, int64_t k, float *scratch) {                                                 \
        rows(P, act, b, y, r0, r1, k, scratch, bits, dots);                                                         \
    }
ROWS(4, INTEGER_DOTS)
ROWS(6, INTEGER_DOTS)
ROWS(8, INTEGER_DOTS)

/* Whether rows are multiplied by integer dot products here (AVX-512 VNNI): the same numbers up to the
 * order of the sums either way (tests/fast/test_int4.py builds int4.c both ways). */
int gpt2port_int4_integer_dots(void) { return INTEGER_DOTS; }

/* Bytes of a packed row of k numbers (a multiple of GROUP) of `bits`-bit codes (scripts/bench/int4_kernel.py asks). */
int64_t gpt2port_int4_row_bytes(int64_t k, int bits) { return row_stride(k, bits); }

/* P (n, k * bits / 8 + k / 16 + 4) packed rows of `bits`-bit codes (4, 6 or 8), x (k), b (n) or NULL, y (n); k a
 * multiple of GROUP. 0, or -1 where memory for the scratch could not be had (nothing written). */
int gpt2port_matvec_int4(const uint8_t *P, const float *x, const float *b, float *y, int64_t n, int64_t k, int bits,
                         int threads) {
    int64_t groups = k / GROUP;
    /* each thread's scales on cache lines of their own (64 bytes, 16 floats): a line two threads both write at every
     * row goes back and forth between their cores */
    int64_t line = 16, slice = (groups * STREAMS + line - 1) / line * line;
    void *block;
    activations act;
    if (round_activations(x, k, &block, &act, slice * (int64_t)threads + line) != 0) return -1;
    float *scratch = (float *)act.qf + k;
    scratch += (line - ((uintptr_t)scratch / sizeof(float)) % line) % line;
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t per = (n + T - 1) / T, r0 = t * per, r1 = r0 + per < n ? r0 + per : n;
        void (*run)(const uint8_t *, const activations *, const float *, float *, int64_t, int64_t, int64_t,
                    float *) = bits == 8 ? rows8 : bits == 6 ? rows6 : rows4;
        if (r0 < r1) run(P, &act, b, y, r0, r1, k, scratch + slice * t);
    }
    free(block);
    return 0;
}

/* The same rows dequantized: W (n, k) fp32, w = s (code + z u), as gpt2port/quant4.py's reference forms it. */
void gpt2port_dequantize_int4(const uint8_t *P, float *W, int64_t n, int64_t k, int bits, int threads) {
    int64_t groups = k / GROUP, codes = k * bits / 8, stride = row_stride(k, bits);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = P + r * stride, *c = row + codes;
        const int8_t *z = (const int8_t *)(c + groups);
        float base, *out = W + r * k;
        memcpy(&base, c + 2 * groups, 4);
        for (int64_t g = 0; g < groups; g++) {
            float scale = group_scale(base, c[g]), zu = zero_codes(z[g], bits);
            i32_vec v, u;
            if (bits == 8) {
                v = widen_bytes(row + g * GROUP);
                u = widen_bytes(row + g * GROUP + 16);
            } else {
                narrow_codes(row + g * 4 * bits, bits, &v, &u);
            }
            vec a = (__builtin_convertvector(v, vec) + zu) * scale, e = (__builtin_convertvector(u, vec) + zu) * scale;
            memcpy(out + g * GROUP, &a, sizeof a);
            memcpy(out + g * GROUP + 16, &e, sizeof e);
        }
    }
}
