/* Weights of 4, 5, 6 or 8 bits, group-wise (gpt2port/quant4.py): one row times a weight, y[n] = W[n, k] . x[k]
 * (+ b[n]), and a block of rows dequantized to fp32 (for products of many rows, which a GEMM does better).
 *
 * A packed row of k numbers (k a multiple of GROUP) is its codes, 4 * bits bytes per group, then k / GROUP fp16
 * scales, then k / GROUP fp16 minimums: w[GROUP g + i] = code * scale[g] + min[g]. 8-bit codes are one byte each.
 * Narrower codes keep their low four bits as nibbles, byte i of a group holding element i in its low nibble and
 * element i + 16 in its high one (so that one vector of bytes widens into the group's two halves); a 5- or 6-bit
 * code's higher bits follow as one or two 32-bit little-endian planes, bit i of plane p being bit 4 + p of element
 * i (one mask register each with AVX-512). The width of a row says which: k * bits / 8 + k / 8 bytes.
 *
 * The product is taken as y = sum_g scale[g] (codes_g . x_g) + sum_g min[g] (sum of x_g): the codes widened to fp32
 * (exactly), multiplied by x in fp32, the group's partial sums scaled as vectors, so the result is the fp32 product
 * by the dequantized weight up to the order of its sums (no activation is rounded to fewer bits). The sums of x per
 * group are formed once per call. Rows are read STREAMS at a time from far-apart runs, as matvec.c does (and each
 * slice of x loaded once for the four), each run prefetched AHEAD bytes ahead: without it a step's products (107 MB
 * at 124M, none in cache) ran at half of what one core reads, the 8-bit rows most (scripts/bench/int4_kernel.py).
 * With AVX-512, nibbles become floats by a lookup in {0, ..., 15} (vpermps reads an index's low four bits, so the
 * low nibble needs no mask and no conversion) and each higher bit is a masked add of 16 or 32: fewer instructions
 * per group where the narrow rows are bound by them. Written in the vector extension of GCC and Clang: with
 * -march=native the compiler maps it onto AVX-512, AVX2 or NEON, without it onto SSE; every row's sum is formed in
 * the same order whatever the thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define GROUP 32
#define STREAMS 4
#define AHEAD 2048 /* bytes: a prefetch's distance along each run of rows */

typedef uint8_t bytes16 __attribute__((vector_size(16)));
typedef int32_t int_vec __attribute__((vector_size(LANES * sizeof(int32_t))));

/* 16 bytes from any address widened to 16 int32: one instruction where the compiler is told it may (a plain
 * conversion of an unaligned vector was compiled byte by byte). */
static inline __attribute__((always_inline)) int_vec widen_bytes(const uint8_t *p) {
#ifdef __AVX512F__
    return (int_vec)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    bytes16 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, int_vec);
#endif
}

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

/* The row's scales widened to fp32 into `scales`, and sum_g min[g] * sums[g]: 16 or 8 groups at a time where the
 * CPU converts halves itself (F16C, AVX-512), which a decode step otherwise spends a third of its time on. */
static inline float row_setup(const uint8_t *row, const float *sums, float *scales, int64_t groups, int64_t codes) {
    const uint16_t *s = (const uint16_t *)(row + codes), *m = s + groups;
    float offset = 0.f;
    int64_t g = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; g + 16 <= groups; g += 16) {
        _mm512_storeu_ps(scales + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + g))));
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g))),
                              _mm512_loadu_ps(sums + g), acc);
    }
    offset = _mm512_reduce_add_ps(acc);
#endif
#if defined(__F16C__) && defined(__AVX__)
    __m256 acc8 = _mm256_setzero_ps();
    for (; g + 8 <= groups; g += 8) {
        _mm256_storeu_ps(scales + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g))));
        acc8 = _mm256_add_ps(acc8, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g))),
                                                 _mm256_loadu_ps(sums + g)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc8);
    for (int l = 0; l < 8; l++) offset += lanes[l];
#endif
    for (; g < groups; g++) {
        uint16_t sg, mg;
        memcpy(&sg, s + g, 2);  /* rows start at any even byte: read unaligned */
        memcpy(&mg, m + g, 2);
        scales[g] = half_to_float(sg);
        offset += half_to_float(mg) * sums[g];
    }
    return offset;
}

/* One group's codes (`bits` < 8) as two vectors of integers: elements 0..15 and 16..31. */
static inline __attribute__((always_inline)) void narrow_codes(const uint8_t *codes, int bits, int_vec *lo,
                                                               int_vec *hi) {
    int_vec v = widen_bytes(codes);
    *lo = v & 15;
    *hi = v >> 4;
    for (int p = 0; p < bits - 4; p++) {
        const int_vec bit = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
        uint32_t plane;
        memcpy(&plane, codes + 16 + 4 * p, 4);
        int_vec low = (int_vec){0} + (int32_t)(plane & 0xffff), high = (int_vec){0} + (int32_t)(plane >> 16);
        *lo |= ((low & bit) != 0) & (16 << p);
        *hi |= ((high & bit) != 0) & (16 << p);
    }
}

/* One group's codes times x's 32 numbers: a vector of LANES partial sums. */
static inline __attribute__((always_inline)) vec group_dot(const uint8_t *codes, vec x_lo, vec x_hi, int bits) {
    if (bits == 8)
        return __builtin_convertvector(widen_bytes(codes), vec) * x_lo +
               __builtin_convertvector(widen_bytes(codes + 16), vec) * x_hi;
#ifdef __AVX512F__
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    __m512 lo = _mm512_permutexvar_ps(b, iota), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), iota);
    for (int p = 0; p < bits - 4; p++) {
        uint32_t plane;
        memcpy(&plane, codes + 16 + 4 * p, 4);
        const __m512 add = _mm512_set1_ps((float)(16 << p));
        lo = _mm512_mask_add_ps(lo, (__mmask16)plane, lo, add);
        hi = _mm512_mask_add_ps(hi, (__mmask16)(plane >> 16), hi, add);
    }
    return (vec)lo * x_lo + (vec)hi * x_hi;
#else
    int_vec lo, hi;
    narrow_codes(codes, bits, &lo, &hi);
    return __builtin_convertvector(lo, vec) * x_lo + __builtin_convertvector(hi, vec) * x_hi;
#endif
}

static inline float total(vec acc) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)acc);  /* a tree of adds: shorter than 16 in a row, once per row */
#else
    float v = 0.f;
    for (int l = 0; l < LANES; l++) v += acc[l];
    return v;
#endif
}

/* Rows [r0, r1) of y: STREAMS runs of rows at a time, then the rows left over. `scratch`: STREAMS * groups floats.
 * Inlined into one copy per code width, where `bits` is a constant. */
static inline __attribute__((always_inline)) void rows(const uint8_t *P, const float *x, const float *sums,
                                                       const float *b, float *y, int64_t r0, int64_t r1, int64_t k,
                                                       float *scratch, int bits) {
    int64_t groups = k / GROUP, codes = k * bits / 8, per = 4 * bits;
    int64_t stride = codes + 4 * groups, run = (r1 - r0) / STREAMS;
    float *s0 = scratch, *s1 = s0 + groups, *s2 = s1 + groups, *s3 = s2 + groups;
    for (int64_t i = 0; i < run; i++) {
        int64_t r = r0 + i;
        const uint8_t *w0 = P + r * stride, *w1 = w0 + run * stride, *w2 = w1 + run * stride, *w3 = w2 + run * stride;
        float o0 = row_setup(w0, sums, s0, groups, codes), o1 = row_setup(w1, sums, s1, groups, codes),
              o2 = row_setup(w2, sums, s2, groups, codes), o3 = row_setup(w3, sums, s3, groups, codes);
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t g = 0; g < groups; g++) {
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
        y[r] = total(a0) + o0 + (b ? b[r] : 0.f);
        y[r + run] = total(a1) + o1 + (b ? b[r + run] : 0.f);
        y[r + 2 * run] = total(a2) + o2 + (b ? b[r + 2 * run] : 0.f);
        y[r + 3 * run] = total(a3) + o3 + (b ? b[r + 3 * run] : 0.f);
    }
    for (int64_t r = r0 + STREAMS * run; r < r1; r++) {
        const uint8_t *w = P + r * stride;
        float o = row_setup(w, sums, s0, groups, codes);
        vec a = {0};
        for (int64_t g = 0; g < groups; g++, __builtin_prefetch(w + g * per + AHEAD))
            a += s0[g] * group_dot(w + g * per, load(x + g * GROUP), load(x + g * GROUP + 16), bits);
        y[r] = total(a) + o + (b ? b[r] : 0.f);
    }
}

#define ROWS(bits)                                                                                                \
    static void rows##bits(const uint8_t *P, const float *x, const float *sums, const float *b, float *y, int64_t r0, \
                           int64_t r1, int64_t k, float *scratch) {                                                   \
        rows(P, x, sums, b, y, r0, r1, k, scratch, bits);                                                             \
    }
ROWS(4)
ROWS(5)
ROWS(6)
ROWS(8)

/* P (n, k * bits / 8 + k / 8) packed rows of `bits`-bit codes (4, 5, 6 or 8), x (k), b (n) or NULL, y (n); k a
 * multiple of GROUP. 0, or -1 where memory for the scratch could not be had (nothing written). */
int gpt2port_matvec_int4(const uint8_t *P, const float *x, const float *b, float *y, int64_t n, int64_t k, int bits,
                         int threads) {
    int64_t groups = k / GROUP;
    float *sums = malloc(sizeof(float) * groups * (1 + STREAMS * (int64_t)threads));
    if (!sums) return -1;
    for (int64_t g = 0; g < groups; g++) {
        float v = 0.f;
        for (int i = 0; i < GROUP; i++) v += x[g * GROUP + i];
        sums[g] = v;
    }
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t per = (n + T - 1) / T, r0 = t * per, r1 = r0 + per < n ? r0 + per : n;
        void (*run)(const uint8_t *, const float *, const float *, const float *, float *, int64_t, int64_t, int64_t,
                    float *) = bits == 8 ? rows8 : bits == 6 ? rows6 : bits == 5 ? rows5 : rows4;
        if (r0 < r1) run(P, x, sums, b, y, r0, r1, k, sums + groups * (1 + STREAMS * t));
    }
    free(sums);
    return 0;
}

/* The same rows dequantized: W (n, k) fp32, w = code * scale + min (the compiler may fuse the two: within a rounding
 * of PyTorch's reference, gpt2port/quant4.py). */
void gpt2port_dequantize_int4(const uint8_t *P, float *W, int64_t n, int64_t k, int bits, int threads) {
    int64_t groups = k / GROUP, codes = k * bits / 8, stride = codes + 4 * groups;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = P + r * stride;
        const uint16_t *s = (const uint16_t *)(row + codes), *m = s + groups;
        float *out = W + r * k;
        for (int64_t g = 0; g < groups; g++) {
            uint16_t sg, mg;
            memcpy(&sg, s + g, 2);
            memcpy(&mg, m + g, 2);
            float scale = half_to_float(sg), low = half_to_float(mg);
            int_vec v, u;
            if (bits == 8) {
                v = widen_bytes(row + g * GROUP);
                u = widen_bytes(row + g * GROUP + 16);
            } else {
                narrow_codes(row + g * 4 * bits, bits, &v, &u);
            }
            vec a = __builtin_convertvector(v, vec) * scale + low, c = __builtin_convertvector(u, vec) * scale + low;
            memcpy(out + g * GROUP, &a, sizeof a);
            memcpy(out + g * GROUP + 16, &c, sizeof c);
        }
    }
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

/* One group's codes, scale and minimum (see gpt2port/quant4.py): over candidate scales span / (15 + step * i), the
 * codes rounded from the minimum, the scale and minimum refitted by least squares, the least squared error kept;
 * then the pair rounded to fp16 and the codes rounded against it. */
static void fit_group(const float *x, uint8_t *codes, uint16_t *scale, uint16_t *low, float levels, int candidates,
                      float step) {
    float lo = x[0], hi = x[0], sum_x = 0.f;
    for (int i = 0; i < GROUP; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        sum_x += x[i];
    }
    float best_s = (hi - lo) / levels, best_m = lo, best_err = INFINITY;
    if (hi > lo) {
        for (int c = -candidates; c <= candidates; c++) {
            float inv = (levels + step * (float)c) / (hi - lo), sl = 0.f, sl2 = 0.f, sxl = 0.f, l[GROUP];
            for (int i = 0; i < GROUP; i++) {
                float q = nearbyintf((x[i] - lo) * inv);
                l[i] = q < 0.f ? 0.f : q > levels ? levels : q;
                sl += l[i];
                sl2 += l[i] * l[i];
                sxl += l[i] * x[i];
            }
            float det = GROUP * sl2 - sl * sl;
            if (det <= 0.f) continue;
            float s = (GROUP * sxl - sl * sum_x) / det, m = (sl2 * sum_x - sl * sxl) / det, err = 0.f;
            for (int i = 0; i < GROUP; i++) {
                float d = l[i] * s + m - x[i];
                err += d * d;
            }
            if (err < best_err) best_err = err, best_s = s, best_m = m;
        }
    }
    *scale = float_to_half(best_s);
    *low = float_to_half(best_m);
    float s = half_to_float(*scale), m = half_to_float(*low);
    for (int i = 0; i < GROUP; i++) {
        float q = s != 0.f ? nearbyintf((x[i] - m) / s) : 0.f;
        codes[i] = (uint8_t)(q < 0.f ? 0.f : q > levels ? levels : q);
    }
}

/* W (n, k) fp32, k a multiple of GROUP -> P packed rows of `bits` (4, 5, 6 or 8) codes; `candidates` scales each side
 * of the range's, `step` apart (in units of one code). */
void gpt2port_quantize_int4(const float *W, uint8_t *P, int64_t n, int64_t k, int bits, int candidates, float step,
                            int threads) {
    int64_t groups = k / GROUP, codes_bytes = k * bits / 8, stride = codes_bytes + 4 * groups;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        uint8_t *row = P + r * stride, codes[GROUP];
        for (int64_t g = 0; g < groups; g++) {
            uint16_t s, m;
            fit_group(W + r * k + g * GROUP, codes, &s, &m, (float)((1 << bits) - 1), candidates, step);
            uint8_t *at = row + g * 4 * bits;
            if (bits == 8) memcpy(at, codes, GROUP);
            else for (int i = 0; i < 16; i++) at[i] = (uint8_t)((codes[i] & 15) | (codes[i + 16] & 15) << 4);
            for (int p = 0; p < bits - 4 && bits < 8; p++) {
                uint32_t plane = 0;
                for (int i = 0; i < GROUP; i++) plane |= (uint32_t)((codes[i] >> (4 + p)) & 1) << i;
                memcpy(at + 16 + 4 * p, &plane, 4);
            }
            memcpy(row + codes_bytes + 2 * g, &s, 2);
            memcpy(row + codes_bytes + 2 * (groups + g), &m, 2);
        }
    }
}
