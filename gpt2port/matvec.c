/* One fp32 row times a weight matrix: y[n] = W[n, k] . x[k] (+ b[n]), the product a decode step is made of.
 *
 * Why a kernel of gpt2port's own: a decode step streams every weight once, so its speed is how fast the memory
 * delivers them. On the CPUs measured, memory delivers most when each core reads several long, far-apart runs of
 * addresses at once. The libraries PyTorch ships read each thread's share of the rows front to back, one run, and
 * at GPT-2's narrow rows (768 numbers, 3 KB) that gets ~70% of what a large product gets; here each thread's rows
 * are split into STREAMS runs that are read in lockstep (scripts/bench_matvec.py measures both).
 *
 * Each row's sum is formed the same way whatever the thread count (LANES partial sums over the row, added in
 * order, then the tail), so results do not depend on threads. Built by gpt2port/native.py with the machine's
 * C compiler (-O3 -march=native -fopenmp); the loops are plain C that compilers vectorise. The threads are
 * OpenMP's: loaded into a PyTorch process, the library shares PyTorch's OpenMP runtime and its threads.
 */
#include <stdint.h>
#include <omp.h>

#define LANES 16
#define STREAMS 4

static float finish(const float *acc, const float *w, const float *x, int64_t from, int64_t k) {
    float v = 0.f;
    for (int l = 0; l < LANES; l++) v += acc[l];
    for (int64_t j = from; j < k; j++) v += w[j] * x[j];
    return v;
}

/* Rows [r0, r1): STREAMS runs of `run` rows each, row i of every run together, then the rows left over. */
static void rows(const float *W, const float *x, const float *b, float *y, int64_t r0, int64_t r1, int64_t k) {
    int64_t run = (r1 - r0) / STREAMS, body = k - k % LANES;
    for (int64_t i = 0; i < run; i++) {
        float acc[STREAMS][LANES] = {{0.f}};
        const float *w[STREAMS];
        for (int s = 0; s < STREAMS; s++) w[s] = W + (r0 + s * run + i) * k;
        for (int64_t j = 0; j < body; j += LANES)
            for (int s = 0; s < STREAMS; s++)
                for (int l = 0; l < LANES; l++) acc[s][l] += w[s][j + l] * x[j + l];
        for (int s = 0; s < STREAMS; s++) {
            int64_t r = r0 + s * run + i;
            float v = finish(acc[s], w[s], x, body, k);
            y[r] = b ? v + b[r] : v;
        }
    }
    for (int64_t r = r0 + STREAMS * run; r < r1; r++) {
        float acc[LANES] = {0.f};
        const float *w = W + r * k;
        for (int64_t j = 0; j < body; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += w[j + l] * x[j + l];
        float v = finish(acc, w, x, body, k);
        y[r] = b ? v + b[r] : v;
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
