/* One fp32 row times a weight matrix: y[n] = W[n, k] . x[k] (+ b[n]), the product a decode step is made of.
 *
 * Why a kernel of gpt2port's own: a decode step streams every weight once, so its speed is how fast the memory
 * delivers them. On the CPUs measured, memory delivers most when each core reads several long, far-apart runs of
 * addresses at once. The libraries PyTorch ships read each thread's share of the rows front to back, one run, and
 * at GPT-2's narrow rows (768 numbers, 3 KB) that gets ~70% of what a large product gets; here each thread's rows
 * are split into STREAMS runs that are read in lockstep (scripts/bench_matvec.py measures both).
 *
 * Each row's sum is formed the same way whatever the thread count (LANES partial sums over the row, added in
 * order, then the tail, in one compiled copy of `finish`), so results do not depend on threads. Built by
 * gpt2port/native.py with the machine's C compiler (-O3 -march=native -fopenmp). The partial sums are vectors of
 * the compiler's vector extension (GCC and Clang), one named variable per stream, so that they stay in registers
 * whatever the target: written as a [STREAMS][LANES] array, GCC 12 with AVX-512 kept them in memory, and every
 * step of the loop waited on a store and a load (~30 GB/s where the registers give ~47 on the same CPU). The
 * threads are OpenMP's: loaded into a PyTorch process, the library shares PyTorch's OpenMP runtime and its threads.
 */
#include <stdint.h>
#include <omp.h>

#define LANES 16
#define STREAMS 4 /* the four runs are spelled out in `rows` */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
/* The same vector read from any float address (rows start anywhere): alignment of one float, may alias floats. */
typedef float unaligned_vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)), may_alias));
#define load(p) (*(const unaligned_vec *)(p))

/* A row's LANES partial sums added in order, then the columns past the last whole vector. Not inlined: one copy,
 * so every caller rounds the tail the same way. */
__attribute__((noinline)) static float finish(const vec *acc, const float *w, const float *x, int64_t from, int64_t k) {
    float v = 0.f;
    for (int l = 0; l < LANES; l++) v += (*acc)[l];
    for (int64_t j = from; j < k; j++) v += w[j] * x[j];
    return v;
}

static void put(float *y, const float *b, int64_t r, float v) { y[r] = b ? v + b[r] : v; }

/* Rows [r0, r1): STREAMS runs of `run` rows each, row i of every run together, then the rows left over. */
static void rows(const float *W, const float *x, const float *b, float *y, int64_t r0, int64_t r1, int64_t k) {
    int64_t run = (r1 - r0) / STREAMS, body = k - k % LANES;
    for (int64_t i = 0; i < run; i++) {
        int64_t r = r0 + i;
        const float *w0 = W + r * k, *w1 = w0 + run * k, *w2 = w1 + run * k, *w3 = w2 + run * k;
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t j = 0; j < body; j += LANES) {
            vec xj = load(x + j);
            a0 += load(w0 + j) * xj;
            a1 += load(w1 + j) * xj;
            a2 += load(w2 + j) * xj;
            a3 += load(w3 + j) * xj;
        }
        put(y, b, r, finish(&a0, w0, x, body, k));
        put(y, b, r + run, finish(&a1, w1, x, body, k));
        put(y, b, r + 2 * run, finish(&a2, w2, x, body, k));
        put(y, b, r + 3 * run, finish(&a3, w3, x, body, k));
    }
    for (int64_t r = r0 + STREAMS * run; r < r1; r++) {
        const float *w = W + r * k;
        vec a = {0};
        for (int64_t j = 0; j < body; j += LANES) a += load(w + j) * load(x + j);
        put(y, b, r, finish(&a, w, x, body, k));
    }
}

void gpt2port_matvec(const float *W, const float *x, const float *b, float *y, int64_t n, int64_t k, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t per = (n + T - 1) / T, r0 = t * per, r1 = r0 + per < n ? r0 + per : n;
        if (r0 < r1) rows(W, x, b, y, r0, r1, k);
    }
}
