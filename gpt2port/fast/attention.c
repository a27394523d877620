/* Attention for one new token of one sequence, the part of a decode step between its qkv product and its output
 * projection: the token's key and value written into the layer's cache at `length`, then for each head
 * softmax(q . keys[0..length] * scale) . values[0..length]. In fp32 or bf16 (bf16 numbers widened as they are read,
 * the sums in fp32, each result rounded to bf16 once).
 *
 * Why a kernel of gpt2port's own: PyTorch's scaled_dot_product_attention is built for many queries; for one, its
 * setup and the cache writes, slices and reshapes around it cost more than the reading itself (docs/performance.md).
 * Here it is one call that reads each cached key and value once.
 *
 * Layouts: qkv (3 C): q, k, v, each H heads of D numbers (C = H D), as the model's qkv product makes them; keys and
 * values (H, T, D), the layer's cache for one sequence (T positions of room); y (C), heads in order, as the model's
 * output projection takes them. scratch: H (length + 1 + 2 D) fp32 numbers (a head's scores, its query widened,
 * its sums). Each head is computed whole by one thread, the same way whatever the thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "vectors.h"

/* Keys are prefetched this many rows ahead, and each row's value along with its key: a layer's cache was last read a
 * step ago, ~40 MB of weights back at 124M, so it comes from memory (bench_attention's cold figures halved). */
#define PF 4

static inline __attribute__((always_inline)) void head(const void *qkv, void *K, void *V, void *y, int64_t h,
                                                       int64_t H, int64_t T, int64_t D, int64_t length, float scale,
                                                       float *scratch, int half) {
    int64_t C = H * D, size = half ? 2 : 4, body = D - D % LANES;
    float *s = scratch, *q = s + length + 1, *acc = q + D;
    char *keys = (char *)K + h * T * D * size, *values = (char *)V + h * T * D * size;
    memcpy(keys + length * D * size, (const char *)qkv + (C + h * D) * size, D * size);
    memcpy(values + length * D * size, (const char *)qkv + (2 * C + h * D) * size, D * size);
    for (int64_t d = 0; d < D; d++) q[d] = ELEM(qkv, h * D + d, half);

    float top = -INFINITY;
    for (int64_t j = 0; j <= length; j++) {
        const char *key = keys + j * D * size;
        for (int64_t o = 0; o < D * size; o += 64) {
            __builtin_prefetch(key + PF * D * size + o);
            __builtin_prefetch(values + j * D * size + o);
        }
        vec a = {0};
        for (int64_t d = 0; d < body; d += LANES) a += VEC(key, d, half) * load(q + d);
        float dot = lanes_sum(a);
        for (int64_t d = body; d < D; d++) dot += ELEM(key, d, half) * q[d];
        s[j] = dot * scale;
        top = s[j] > top ? s[j] : top;
    }
    /* The largest score becomes e^0: nothing overflows. LANES scores at a time, the last few through a vector of
     * their own (its other lanes zeroed after, so they add nothing). */
    vec sums = {0};
    for (int64_t j = 0; j <= length; j += LANES) {
        int64_t n = length + 1 - j < LANES ? length + 1 - j : LANES;
        vec e = {0};
        memcpy(&e, s + j, n * sizeof(float));
        e = exp_lanes(e - top);
        for (int64_t l = n; l < LANES; l++) e[l] = 0.f;
        memcpy(s + j, &e, n * sizeof(float));
        sums += e;
    }
    float total = lanes_sum(sums);
    /* The weighted sum of values, four vectors of a row at a time held in registers across the keys (summed in
     * memory, each key's addition would wait on the previous key's store). */
    for (int64_t g = 0; g < body; g += 4 * LANES) {
        int64_t n = (body - g) / LANES;  /* vectors left from g on: this group takes up to 4 of them */
        vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t j = 0; j <= length; j++) {
            const char *value = values + j * D * size;
            vec p = {0};
            p += s[j];
            a0 += p * VEC(value, g, half);
            if (n > 1) a1 += p * VEC(value, g + LANES, half);
            if (n > 2) a2 += p * VEC(value, g + 2 * LANES, half);
            if (n > 3) a3 += p * VEC(value, g + 3 * LANES, half);
        }
        *(unaligned_vec *)(acc + g) = a0;
        if (n > 1) *(unaligned_vec *)(acc + g + LANES) = a1;
        if (n > 2) *(unaligned_vec *)(acc + g + 2 * LANES) = a2;
        if (n > 3) *(unaligned_vec *)(acc + g + 3 * LANES) = a3;
    }
    for (int64_t d = body; d < D; d++) {
        acc[d] = 0.f;
        for (int64_t j = 0; j <= length; j++) acc[d] += s[j] * ELEM(values + j * D * size, d, half);
    }
    for (int64_t d = 0; d < D; d++) {
        float out = acc[d] / total;
        if (half) ((uint16_t *)y)[h * D + d] = f32_to_bf16(out);
        else ((float *)y)[h * D + d] = out;
    }
}

static void head_f32(const void *qkv, void *K, void *V, void *y, int64_t h, int64_t H, int64_t T, int64_t D,
                     int64_t length, float scale, float *scratch) {
    head(qkv, K, V, y, h, H, T, D, length, scale, scratch, 0);
}
static void head_bf16(const void *qkv, void *K, void *V, void *y, int64_t h, int64_t H, int64_t T, int64_t D,
                      int64_t length, float scale, float *scratch) {
    head(qkv, K, V, y, h, H, T, D, length, scale, scratch, 1);
}

static void each_head(void (*one)(const void *, void *, void *, void *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  float, float *),
                      const void *qkv, void *K, void *V, void *y, int64_t H, int64_t T, int64_t D, int64_t length,
                      float scale, float *scratch, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < H; h++) one(qkv, K, V, y, h, H, T, D, length, scale, scratch + h * (length + 1 + 2 * D));
}

/* fp32: qkv (3 H D), K and V (H, T, D), y (H D), scratch H (length + 1 + 2 D); 0 <= length < T. */
void gpt2port_attend_one(const float *qkv, float *K, float *V, float *y, int64_t H, int64_t T, int64_t D,
                         int64_t length, float scale, float *scratch, int threads) {
    each_head(head_f32, qkv, K, V, y, H, T, D, length, scale, scratch, threads);
}

/* bf16 (as uint16 bits): the same; scratch is fp32 all the same. */
void gpt2port_attend_one_bf16(const uint16_t *qkv, uint16_t *K, uint16_t *V, uint16_t *y, int64_t H, int64_t T,
                              int64_t D, int64_t length, float scale, float *scratch, int threads) {
    each_head(head_bf16, qkv, K, V, y, H, T, D, length, scale, scratch, threads);
}
