/* The quantizer of gpt2port's int4 weights (gpt2port/quant4.py gives the layout, int4.c multiplies by it): each
 * group of GROUP numbers of a row fitted to codes of 4, 6 or 8 bits with an fp16 scale and minimum, at load. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "int4.h"


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

/* W (n, k) fp32, k a multiple of GROUP -> P packed rows of `bits` (4, 6 or 8) codes; `candidates` scales each side
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
            if (bits == 6)
                for (int j = 0; j < 8; j++)
                    at[16 + j] = (uint8_t)(codes[j] >> 4 | (codes[j + 8] >> 4) << 2 | (codes[j + 16] >> 4) << 4 |
                                           (codes[j + 24] >> 4) << 6);
            memcpy(row + codes_bytes + 2 * g, &s, 2);
            memcpy(row + codes_bytes + 2 * (groups + g), &m, 2);
        }
    }
}
