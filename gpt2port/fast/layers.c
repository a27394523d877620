/* The small layers of a decode step, fp32, on the rows they are given: LayerNorm and GPT-2's tanh GELU.
 *
 * Why: on one row PyTorch's layer_norm and gelu spend many times their arithmetic on dispatch and set-up, and a
 * decode step makes two LayerNorms and a GELU a block (docs/performance.md). gpt2port.fast swaps these in for
 * nn.LayerNorm and for the MLP's tanh GELU, each only after a probe against PyTorch's (gpt2port/fast/native.py).
 *
 * LayerNorm as PyTorch forms it: the mean and the biased variance of each row, rstd = 1 / sqrt(var + eps), then
 * y = (x rstd - mean rstd) w + b; the sums in fp32, two passes (the variance around the mean), LANES at a time.
 * GELU: 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), written with t = e^(-2 |u|) as x / (1 + t) where
 * u >= 0 and x t / (1 + t) where u < 0 (the same function; the second keeps the small values that 1 + tanh(u) would
 * round away). A NaN gives NaN, as PyTorch's; x = +inf gives +inf and -inf NaN, as PyTorch's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vectors.h"

/* x, y (rows, n); w, b (n) or NULL (then 1 and 0). */
void gpt2port_layer_norm(const float *x, const float *w, const float *b, float *y, int64_t rows, int64_t n,
                         float eps) {
    int64_t body = n - n % LANES;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        vec s = {0};
        for (int64_t i = 0; i < body; i += LANES) s += load(xr + i);
        float sum = lanes_sum(s);
        for (int64_t i = body; i < n; i++) sum += xr[i];
        float mean = sum / (float)n;
        vec v = {0};
        for (int64_t i = 0; i < body; i += LANES) {
            vec d = load(xr + i) - mean;
            v += d * d;
        }
        float var = lanes_sum(v);
        for (int64_t i = body; i < n; i++) var += (xr[i] - mean) * (xr[i] - mean);
        float rstd = 1.f / sqrtf(var / (float)n + eps), shift = -mean * rstd;
        for (int64_t i = 0; i < body; i += LANES) {
            vec o = load(xr + i) * rstd + shift;
            if (w) o *= load(w + i);
            if (b) o += load(b + i);
            *(unaligned_vec *)(yr + i) = o;
        }
        for (int64_t i = body; i < n; i++) yr[i] = (xr[i] * rstd + shift) * (w ? w[i] : 1.f) + (b ? b[i] : 0.f);
    }
}

static inline vec gelu_lanes(vec x) {
    const vec zero = {0};
    vec u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    i32_vec negative = u < zero;
    vec t = exp_lanes(zero - 2.f * (vec)((i32_vec)u & 0x7fffffff));  /* e^(-2 |u|) */
    vec top = (vec)(((i32_vec)t & negative) | ((i32_vec)(zero + 1.f) & ~negative));
    return x * top / (1.f + t);
}

/* y = GPT-2's GELU of x (n numbers) */
void gpt2port_gelu_tanh(const float *x, float *y, int64_t n) {
    int64_t body = n - n % LANES;
    for (int64_t i = 0; i < body; i += LANES) *(unaligned_vec *)(y + i) = gelu_lanes(load(x + i));
    if (body < n) {
        vec tail = {0};
        memcpy(&tail, x + body, (n - body) * sizeof(float));
        tail = gelu_lanes(tail);
        memcpy(y + body, &tail, (n - body) * sizeof(float));
    }
}
