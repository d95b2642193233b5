// Row operations of a decode step in one call each: RMSNorm (after the residual add) and RoPE.
//
// Read `rows.py` first. For a decode row of SmolLM2 (576 numbers) PyTorch spends its time in
// dispatch, not arithmetic: `torch.rms_norm` is about seven calls inside, RoPE about six. Here
// each is one loop per row, in float32:
//
//   rmsnorm:  x = x + residual (elementwise);  ss = sum x_c x_c (8 lanes of fused multiply-adds,
//             c in order, lanes added as ((0+4)+(2+6))+((1+5)+(3+7)));  r = 1 / sqrt(ss / n + eps);
//             out_c = (x_c r) w_c
//   rope:     out_c = x_c cos_c + x_swapped_c sin_c, each product rounded, then the sum (the torch
//             tier's operations in its order: the same bits)
//
// A row is computed the same way whatever the number of rows: batch-invariant. Rows are shared
// among OpenMP's threads only when there are many (a thread per row block).

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int LANES = 8;

float sum_of_squares(const float *x, int64_t n) {
    float acc[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = fmaf(x[c + l], x[c + l], acc[l]);
    for (; c < n; ++c) acc[c % LANES] = fmaf(x[c], x[c], acc[c % LANES]);
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

int threads_for(int64_t work, int threads) { return work < (1 << 16) ? 1 : threads; }

}  // namespace

extern "C" {

// out [T, n] = rmsnorm(x (+ residual)) * weight; with a residual, sum [T, n] = x + residual.
void sw_rmsnorm(const float *x, const float *residual, const float *weight, float *out, float *sum,
                int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * n, threads)) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *xr = x + t * n;
        if (residual != nullptr) {
            float *s = sum + t * n;
            const float *rr = residual + t * n;
            for (int64_t c = 0; c < n; ++c) s[c] = xr[c] + rr[c];
            xr = s;
        }
        float r = 1.0f / sqrtf(sum_of_squares(xr, n) / (float)n + eps);
        float *o = out + t * n;
        for (int64_t c = 0; c < n; ++c) o[c] = (xr[c] * r) * weight[c];
    }
}

// out [T, heads, d] = rope(x [T, heads, d]) at positions [T]; wide [max_pos, 2 d] = [cos, cos,
// -sin, sin] per position (stages/rope_torch.py's table). Returns 1 for a position past the table.
int sw_rope(const float *x, const int64_t *positions, const float *wide, int64_t max_pos, float *out,
            int64_t tokens, int64_t heads, int64_t d, int threads) {
    for (int64_t t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_pos) return 1;
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads_for(tokens * heads * d, threads)) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *cw = wide + positions[t] * 2 * d, *sw = cw + d;
        for (int64_t h = 0; h < heads; ++h) {
            const float *xr = x + (t * heads + h) * d;
            float *o = out + (t * heads + h) * d;
            for (int64_t c = 0; c < d; ++c) {
                float a = xr[c] * cw[c];
                float b = xr[c < half ? c + half : c - half] * sw[c];
                o[c] = a + b;
            }
        }
    }
    return 0;
}

}  // extern "C"
