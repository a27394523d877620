/* One row times a weight matrix: y[n] = W[n, k] . x[k] (+ b[n]), the product a decode step is made of, in fp32 or
 * bf16 (bf16 numbers widened to fp32 as they are read, the sums in fp32, each result rounded to bf16 once).
 *
 * Why a kernel of gpt2port's own: a decode step streams every weight once, so its speed is how fast the memory
 * delivers them. On the CPUs measured, memory delivers most when each core reads several long, far-apart runs of
 * addresses at once. The libraries PyTorch ships read each thread's share of the rows front to back, one run, and
 * at GPT-2's narrow rows (768 numbers, 3 KB) that gets ~70% of what a large product gets; here each thread's rows
 * are split into STREAMS runs that are read in lockstep (scripts/bench/matvec.py measures both).
 *
 * Each row's sum is formed the same way whatever the thread count (LANES partial sums over the row, added in
 * order, then the tail, in one compiled copy of `finish`), so results do not depend on threads. Built by
 * gpt2port/fast/native.py with the machine's C compiler (-O3 -march=native -fopenmp). The partial sums are vectors of
 * the compiler's vector extension (GCC and Clang), one named variable per stream, so that they stay in registers
 * whatever the target: written as a [STREAMS][LANES] array, GCC 12 with AVX-512 kept them in memory, and every
 * step of the loop waited on a store and a load (docs/performance.md has the figures). The
 * threads are OpenMP's: loaded into a PyTorch process, the library shares PyTorch's OpenMP runtime and its threads.
 */
#include <omp.h>
#include <stdint.h>

#include "vectors.h"

#define STREAMS 4 /* the four runs are spelled out in `rows` */

/* A row's LANES partial sums added in order, then the columns past the last whole vector. Compiled once per type
 * (the two functions after it, never inlined), so every caller rounds the tail the same way. */
static inline __attribute__((always_inline)) float finish(const vec *acc, const void *w, const float *x,
                                                          int64_t from, int64_t k, int half) {
    float v = 0.f;
    for (int l = 0; l < LANES; l++) v += (*acc)[l];
    for (int64_t j = from; j < k; j++) v += ELEM(w, j, half) * x[j];
    return v;
}
__attribute__((noinline)) static float finish_f32(const vec *acc, const void *w, const float *x, int64_t from,
                                                  int64_t k) { return finish(acc, w, x, from, k, 0); }
__attribute__((noinline)) static float finish_bf16(const vec *acc, const void *w, const float *x, int64_t from,
                                                   int64_t k) { return finish(acc, w, x, from, k, 1); }

static inline __attribute__((always_inline)) void put(void *y, const void *b, int64_t r, const vec *acc,
                                                      const void *w, const float *x, int64_t from, int64_t k,
                                                      int half) {
    float v = half ? finish_bf16(acc, w, x, from, k) : finish_f32(acc, w, x, from, k);
    if (b) v += ELEM(b, r, half);
    if (half) ((uint16_t *)y)[r] = f32_to_bf16(v);
    else ((float *)y)[r] = v;
}

/* Rows [r0, r1): STREAMS runs of `run` rows each, row i of every run together, then the rows left over. Inlined
 * into one copy per type, where `half` is a constant. */
static inline __attribute__((always_inline)) void rows(const void *W, const float *x, const void *b, void *y,
                                                       int64_t r0, int64_t r1, int64_t k, int half) {
    int64_t run = (r1 - r0) / STREAMS, body = k - k % LANES, size = half ? 2 : 4;
    for (int64_t i = 0; i < run; i++) {
        int64_t r = r0 + i;
        const char *w0 = (const char *)W + r * k * size, *w1 = w0 + run * k * size, *w2 = w1 + run * k * size,
                   *w3 = w2 + run * k * size;
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t j = 0; j < body; j += LANES) {
            vec xj = load(x + j);
            a0 += VEC(w0, j, half) * xj;
            a1 += VEC(w1, j, half) * xj;
            a2 += VEC(w2, j, half) * xj;
            a3 += VEC(w3, j, half) * xj;
        }
        put(y, b, r, &a0, w0, x, body, k, half);
        put(y, b, r + run, &a1, w1, x, body, k, half);
        put(y, b, r + 2 * run, &a2, w2, x, body, k, half);
        put(y, b, r + 3 * run, &a3, w3, x, body, k, half);
    }
    for (int64_t r = r0 + STREAMS * run; r < r1; r++) {
        const char *w = (const char *)W + r * k * size;
        vec a = {0};
        for (int64_t j = 0; j < body; j += LANES) a += VEC(w, j, half) * load(x + j);
        put(y, b, r, &a, w, x, body, k, half);
    }
}

static void rows_f32(const void *W, const float *x, const void *b, void *y, int64_t r0, int64_t r1, int64_t k) {
    rows(W, x, b, y, r0, r1, k, 0);
}
static void rows_bf16(const void *W, const float *x, const void *b, void *y, int64_t r0, int64_t r1, int64_t k) {
    rows(W, x, b, y, r0, r1, k, 1);
}

static void split(void (*part)(const void *, const float *, const void *, void *, int64_t, int64_t, int64_t),
                  const void *W, const float *x, const void *b, void *y, int64_t n, int64_t k, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t per = (n + T - 1) / T, r0 = t * per, r1 = r0 + per < n ? r0 + per : n;
        if (r0 < r1) part(W, x, b, y, r0, r1, k);
    }
}

/* fp32: W (n, k), x (k), b (n) or NULL, y (n). */
void gpt2port_matvec(const float *W, const float *x, const float *b, float *y, int64_t n, int64_t k, int threads) {
    split(rows_f32, W, x, b, y, n, k, threads);
}

/* bf16 (as uint16 bits): the same, with x already widened to fp32 by the caller (exactly: bf16 is the upper half of an
 * fp32), so that each row's products read it as the fp32 kernel does and nothing here allocates. */
void gpt2port_matvec_bf16(const uint16_t *W, const float *x, const uint16_t *b, uint16_t *y, int64_t n, int64_t k,
                          int threads) {
    split(rows_bf16, W, x, b, y, n, k, threads);
}
