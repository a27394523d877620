/* The quantizer of gpt2port's int4 weights (gpt2port/quant4.py gives the layout, int4.c multiplies by it): each
 * group of GROUP numbers of a row fitted to codes of 4, 6 or 8 bits, a scale byte and a zero byte under the row's
 * fp32 base, at load. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "int4.h"


/* One group's scale and minimum, unrounded (see gpt2port/quant4.py): over candidate scales span / (levels + step *
 * i), the codes rounded from the minimum, the scale and minimum refitted by least squares, the least squared error
 * kept. A constant group: the scale that puts its value at the range's end. Then at least the scale whose codes and
 * zero reach the whole group. */
typedef struct {
    float s, m, lo, hi;  /* the fitted scale and minimum; the group's range */
} group_fit;

static void fit_group(const float *x, int bits, int candidates, float step, group_fit *out) {
    float levels = (float)((1 << bits) - 1), top = zero_codes(127, bits), bottom = zero_codes(-128, bits);
    float lo = x[0], hi = x[0], sum_x = 0.f;
    #pragma omp simd reduction(min : lo) reduction(max : hi) reduction(+ : sum_x)
    for (int i = 0; i < GROUP; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        sum_x += x[i];
    }
    out->lo = lo, out->hi = hi;
    if (!isfinite(sum_x)) {  /* a NaN or an infinity: the row is marked (gpt2port_quantize_int4) */
        out->s = out->m = NAN;
        return;
    }
    float best_s = (hi - lo) / levels, best_m = lo, best_err = INFINITY;
    if (!(hi > lo)) best_s = fabsf(lo) / levels;
    else
        for (int c = -candidates; c <= candidates; c++) {
            float inv = (levels + step * (float)c) / (hi - lo), sl = 0.f, sl2 = 0.f, sxl = 0.f, l[GROUP];
            #pragma omp simd reduction(+ : sl, sl2, sxl)  /* sums in lanes: the quantizer's time at load */
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
            #pragma omp simd reduction(+ : err)
            for (int i = 0; i < GROUP; i++) {
                float d = l[i] * s + m - x[i];
                err += d * d;
            }
            if (err < best_err) best_err = err, best_s = s, best_m = m;
        }
    /* a group the zero cannot reach at that scale (all of it far to one side of 0): the least scale that reaches */
    float reach = fmaxf(hi > 0.f ? hi / (levels + top) : 0.f, lo < 0.f ? lo / bottom : 0.f);
    if (best_s < reach) best_s = reach, best_m = fminf(fmaxf(lo, reach * bottom), reach * top);
    out->s = best_s;
    out->m = best_m;
}

static inline float clampf(float v, float a, float b) { return !(v >= a) ? a : v > b ? b : v; }  /* NaN: a */

/* The codes of x against scale s and a zero of zu codes (int4.h's zero_codes): w = s (code + zu), each code rounded,
 * clamped. Returns the squared error. */
static float codes_for(const float *x, float s, float zu, float levels, uint8_t *codes) {
    float err = 0.f, inv = 1.f / s, q[GROUP];
    #pragma omp simd reduction(+ : err)
    for (int i = 0; i < GROUP; i++) {
        q[i] = clampf(nearbyintf(x[i] * inv - zu), 0.f, levels);
        float d = s * (q[i] + zu) - x[i];
        err += d * d;
    }
    for (int i = 0; i < GROUP; i++) codes[i] = (uint8_t)q[i];
    return err;
}

/* One group against its row's base: of the stored scales next to the fitted one (scale bytes c0 - 2 .. c0 + 1), with
 * each zero near the fitted minimum (rounded down and up, and the nearest that leaves no number outside the codes'
 * range), the codes rounded against the pair, the zero refitted once to the codes' mean error and the codes rounded
 * again: the pair with the least squared error. */
static void store_group(const float *x, float base, const group_fit *fit, int bits, uint8_t *codes, uint8_t *c_out,
                        int8_t *z_out) {
    float best_err = INFINITY, lo = fit->lo, hi = fit->hi, fit_s = fit->s, fit_m = fit->m;
    float levels = (float)((1 << bits) - 1);
    float unit = zero_unit(bits), half = zero_middle(bits);
    uint8_t trial[GROUP];
    *c_out = 0, *z_out = 0;
    memset(codes, 0, GROUP);
    if (!(base > 0.f)) return;  /* a row of zeros */
    int c0 = fit_s > 0.f ? (int)clampf(nearbyintf(-32.f * log2f(fit_s / base)), 0.f, 255.f) : 255;
    for (int c = c0 - 2; c <= c0 + 1; c++) {
        if (c < 0 || c > 255) continue;
        float s = group_scale(base, (uint8_t)c);
        if (!(s > 0.f)) continue;
        /* zeros (in units) putting the minimum at fit_m, at or below lo, and the top at or above hi */
        float at = (fit_m / s + half) / unit, top = floorf((lo / s + half) / unit),
              bottom = ceilf((hi / s - levels + half) / unit);
        float zs[3] = {floorf(at), ceilf(at), bottom <= top ? clampf(nearbyintf(at), bottom, top) : floorf(at)},
              tried[6];
        int n_tried = 0;
        for (int t = 0; t < 3; t++) {
            float z = clampf(zs[t], -128.f, 127.f);
            for (int round = 0; round < 2; round++) {
                int seen = 0;
                for (int j = 0; j < n_tried; j++) seen |= tried[j] == z;
                if (seen) break;
                tried[n_tried++] = z;
                float err = codes_for(x, s, zero_codes((int8_t)z, bits), levels, trial);
                if (err < best_err) {
                    best_err = err, *c_out = (uint8_t)c, *z_out = (int8_t)z;
                    memcpy(codes, trial, GROUP);
                }
                float mean = 0.f;
                #pragma omp simd reduction(+ : mean)
                for (int i = 0; i < GROUP; i++) mean += x[i] - s * (float)trial[i];
                z = clampf(nearbyintf((mean / GROUP / s + half) / unit), -128.f, 127.f);
            }
        }
    }
}

/* W (n, k) fp32, k a multiple of GROUP -> P packed rows of `bits` (4, 6 or 8) codes; `candidates` scales each side
 * of the range's, `step` apart (in units of one code). A row holding a NaN or an infinity gets a NaN base: every
 * number of it reads back NaN, so that no product hides it. */
void gpt2port_quantize_int4(const float *W, uint8_t *P, int64_t n, int64_t k, int bits, int candidates, float step,
                            int threads) {
    int64_t groups = k / GROUP, codes_bytes = k * bits / 8, stride = row_stride(k, bits);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        uint8_t *row = P + r * stride, codes[GROUP];
        group_fit fits[256], *fitted = groups <= 256 ? fits : NULL, one;
        float base = 0.f;
        for (int pass = 0; pass < 2; pass++)
            for (int64_t g = 0; g < groups; g++) {
                const float *x = W + r * k + g * GROUP;
                group_fit *fit = fitted ? fitted + g : &one;
                if (!(fitted && pass)) fit_group(x, bits, candidates, step, fit);  /* wide rows: fitted twice */
                if (!pass) {
                    base = isnan(base) || fit->s <= base ? base : fit->s;  /* a NaN scale is kept, and stays */
                    if (g == groups - 1) base /= SCALE_STEP[2];  /* 2^(2 / 32) up: the widest group can widen too */
                    continue;
                }
                uint8_t *at = row + g * 4 * bits;
                store_group(x, base, fit, bits, codes, row + codes_bytes + g,
                            (int8_t *)(row + codes_bytes + groups + g));
                if (bits == 8) memcpy(at, codes, GROUP);
                else for (int i = 0; i < 16; i++) at[i] = (uint8_t)((codes[i] & 15) | (codes[i + 16] & 15) << 4);
                if (bits == 6)
                    for (int j = 0; j < 8; j++)
                        at[16 + j] = (uint8_t)(codes[j] >> 4 | (codes[j + 8] >> 4) << 2 | (codes[j + 16] >> 4) << 4 |
                                               (codes[j + 24] >> 4) << 6);
            }
        memcpy(row + codes_bytes + 2 * groups, &base, 4);
    }
}
