/* The linear kernel for one block format (blocks.h), included by kernels.c once per format with
 * BFORMAT (its FMT_ id) and BNAME (the suffix of the functions) defined. The walk over weight rows
 * is linear.h's: a thread's share of the rows as long streams for one row of x, tiles of X_ROWS
 * rows of x over 48 weight rows at a time (so they stay in L2) for more. */
#define BCONCAT_(a, b) a##_##b
#define BCONCAT(a, b) BCONCAT_(a, b)
#define BFN(f) BCONCAT(f, BNAME)

/* y[r][m * ldy] for `rows` rows of x and the `wr` weight rows w[r] (both constants once inlined;
 * only the `valid` ones are written), each group of each weight row unpacked once for all rows of x. */
static inline __attribute__((always_inline)) void BFN(block_tile)(const xquant_t *x, const uint8_t *const *w,
                                                                   const int *valid, float *const *y, const int wr,
                                                                   const int rows, int64_t ldy, int64_t blocks) {
    enum { ELEMS = BFORMAT == FMT_Q4_K || BFORMAT == FMT_Q5_K || BFORMAT == FMT_Q6_K ? 256
                   : BFORMAT == FMT_W4G128 ? 128 : 32,
           GROUPS = ELEMS / 32, LINES = 4 };
    const int64_t bytes = block_bytes(BFORMAT);
    gsum_t acc[4][X_ROWS];
    float mins[4][X_ROWS];
    for (int r = 0; r < wr; r++)
        for (int m = 0; m < rows; m++) acc[r][m] = gsum_zero(), mins[r][m] = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        head_t h[4];
        for (int r = 0; r < wr; r++) {
            for (int l = 0; l < LINES && l * 64 < bytes; l++) /* the lines this block spans, BLOCK_AHEAD on */
                __builtin_prefetch(w[r] + b * bytes + l * 64 + BLOCK_AHEAD);
            unpack_head(BFORMAT, w[r] + b * bytes, &h[r]);
        }
        /* The K formats' eight groups: every group's factors (weight times x) and the minimums' share
         * at once, in vectors, instead of a multiply, a broadcast and a minimum a group and row. */
        float factors[4][X_ROWS][16];
        for (int r = 0; GROUPS == 8 && r < wr; r++)
            for (int m = 0; m < rows; m++)
                block_factors(BFORMAT, &h[r], x->d + m * x->groups + b * 8, x->s + m * x->groups + b * 8,
                              factors[r][m], &mins[r][m]);
        /* Groups in pairs, the pair's second unrolled: j % 2 (Q4_K / Q5_K's nibble) is then a constant,
         * not a branch a group. Unrolling all eight spilled the accumulators (Q4_K 3.9 -> 6.5 ns a group). */
        enum { PAIR = GROUPS > 1 ? 2 : 1 };
        for (int pair = 0; pair < GROUPS / PAIR; pair++)
#pragma GCC unroll 2
        for (int second = 0; second < PAIR; second++) {
            const int j = PAIR * pair + second;
            group_t g[4];
            for (int r = 0; r < wr; r++) unpack_group(BFORMAT, w[r] + b * bytes, j, &g[r]);
            int64_t at = b * GROUPS + j;
            for (int m = 0; m < rows; m++) {
                const int16_t *xq = x->q + m * x->k + 32 * at;
                if (GROUPS == 8) {
                    for (int r = 0; r < wr; r++)
                        acc[r][m] = group_dot(BFORMAT, &g[r], xq, factors[r][m][2 * j], factors[r][m][2 * j + 1],
                                              acc[r][m]);
                    continue;
                }
                float dx = x->d[m * x->groups + at];
                for (int r = 0; r < wr; r++)
                    acc[r][m] = group_dot(BFORMAT, &g[r], xq, h[r].d[2 * j] * dx, h[r].d[2 * j + 1] * dx, acc[r][m]);
                if (has_minimum(BFORMAT)) {
                    float sx = x->s[m * x->groups + at];
                    for (int r = 0; r < wr; r++) mins[r][m] += h[r].m[j] * sx;
                }
            }
        }
    }
    for (int r = 0; r < wr; r++)
        for (int m = 0; m < rows; m++)
            if (valid[r]) y[r][m * ldy] = gsum_total(acc[r][m]) + mins[r][m];
}

/* Weight rows [n0, n1) for x rows [m0, m0 + rows), `wr` at a time: rows i, i + span, i + 2 span, ...
 * together, so each is a long stream through the range (linear.h's PAIRS_BEGIN). One row of x
 * takes four weight rows: x's group is loaded once for all four, and the per-row work (clearing
 * and summing the accumulators) is shared by more weights: the bench model's 896-wide rows read at
 * 10 GB/s two at a time (gate/up, AVX2 EPYC, 2 threads). More rows of x take two, to keep the
 * accumulators in registers. */
static void BFN(block_rows)(const xquant_t *x, const uint8_t *w, float *y, int64_t m0, int64_t rows, int64_t ldy,
                            int64_t k_len, int64_t n0, int64_t n1) {
    int64_t blocks = k_len / (BFORMAT == FMT_Q4_K || BFORMAT == FMT_Q5_K || BFORMAT == FMT_Q6_K ? 256
                              : BFORMAT == FMT_W4G128 ? 128 : 32);
    int64_t row_bytes = blocks * block_bytes(BFORMAT);
    const int wr = rows == 1 ? 4 : 2;
    int64_t span = (n1 - n0 + wr - 1) / wr;
    xquant_t xm = *x;
    xm.q += m0 * x->k, xm.d += m0 * x->groups, xm.s += m0 * x->groups;
    float *ym = y + m0 * ldy;
    for (int64_t i = 0; i < span; i++) {
        const uint8_t *wr_at[4];
        float *y_at[4];
        int valid[4];
        for (int r = 0; r < wr; r++) {
            int64_t at = n0 + i + r * span;
            valid[r] = at < n1;
            wr_at[r] = w + (valid[r] ? at : n0 + i) * row_bytes;
            y_at[r] = ym + at;
        }
        switch (rows) {
            case 1: BFN(block_tile)(&xm, wr_at, valid, y_at, 4, 1, ldy, blocks); break;
            case 2: BFN(block_tile)(&xm, wr_at, valid, y_at, 2, 2, ldy, blocks); break;
            case 3: BFN(block_tile)(&xm, wr_at, valid, y_at, 2, 3, ldy, blocks); break;
#if X_ROWS > 4
            case 4: BFN(block_tile)(&xm, wr_at, valid, y_at, 2, 4, ldy, blocks); break;
            case 5: BFN(block_tile)(&xm, wr_at, valid, y_at, 2, 5, ldy, blocks); break;
            case 6: BFN(block_tile)(&xm, wr_at, valid, y_at, 2, 6, ldy, blocks); break;
            case 7: BFN(block_tile)(&xm, wr_at, valid, y_at, 2, 7, ldy, blocks); break;
#endif
            default: BFN(block_tile)(&xm, wr_at, valid, y_at, 2, X_ROWS, ldy, blocks);
        }
    }
}

/* y[m, n] (row stride ldy) = x[m, :] . w[n, :] + bias[n] for the quantized x, over n_len weight rows;
 * each thread an equal share of the rows. */
static void BFN(block_linear)(const xquant_t *x, const uint8_t *w, const float *bias, float *y, int64_t m_len,
                              int64_t n_len, int64_t k_len, int64_t ldy, int threads) {
    const int64_t block = 48;
#pragma omp parallel num_threads(threads)
    {
        int64_t parts = omp_get_num_threads(), share = (n_len + parts - 1) / parts;
        int64_t start = omp_get_thread_num() * share, end = start + share < n_len ? start + share : n_len;
        for (int64_t n0 = start; n0 < end; n0 += m_len > X_ROWS ? block : end - start) {
            int64_t n1 = m_len <= X_ROWS || n0 + block > end ? end : n0 + block;
            for (int64_t m0 = 0; m0 < m_len; m0 += X_ROWS)
                BFN(block_rows)(x, w, y, m0, m_len - m0 < X_ROWS ? m_len - m0 : X_ROWS, ldy, k_len, n0, n1);
            if (bias)
                for (int64_t m = 0; m < m_len; m++)
                    for (int64_t n = n0; n < n1; n++) y[m * ldy + n] += bias[n];
        }
    }
}

/* out[r, :] = rows [n0, n0 + rows) of w as float32, d * q + m from the unpacked integers: the
 * float products may differ from `dequantize_block`'s in the last bit (FMA), which a product over
 * thousands of terms does not see. */
static void BFN(panel_of)(const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t k_len, float *out) {
    enum { ELEMS = BFORMAT == FMT_Q4_K || BFORMAT == FMT_Q5_K || BFORMAT == FMT_Q6_K ? 256
                   : BFORMAT == FMT_W4G128 ? 128 : 32,
           GROUPS = ELEMS / 32 };
    const int64_t bytes = block_bytes(BFORMAT);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < k_len / ELEMS; b++) {
            const uint8_t *block = w + (n0 + r) * row_bytes + b * bytes;
            float *o = out + r * k_len + b * ELEMS;
            head_t h;
            unpack_head(BFORMAT, block, &h);
            for (int j = 0; j < GROUPS; j++) {
                group_t g;
                unpack_group(BFORMAT, block, j, &g);
#if defined(__AVX2__)
                __m256 m = _mm256_set1_ps(has_minimum(BFORMAT) ? h.m[j] : 0.f);
                __m256i halves[2] = {g.lo, g.hi};
                for (int half = 0; half < 2; half++)
                    for (int q = 0; q < 2; q++) {
                        __m128i part = q ? _mm256_extracti128_si256(halves[half], 1) : _mm256_castsi256_si128(halves[half]);
                        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(part));
                        _mm256_storeu_ps(o + 32 * j + 16 * half + 8 * q,
                                         _mm256_fmadd_ps(v, _mm256_set1_ps(h.d[2 * j + half]), m));
                    }
#else
                float m = has_minimum(BFORMAT) ? h.m[j] : 0.f;
                for (int i = 0; i < 32; i++) o[32 * j + i] = h.d[2 * j + i / 16] * (float)g.q[i] + m;
#endif
            }
        }
}

/* out = weight rows [n0, n0 + rows) widened to float32, on every thread: one tile of a weight for
 * a BLAS GEMM over many rows of x (prefill), never the whole layer at once. */
static void BFN(widen_rows)(const uint8_t *w, int64_t n0, int64_t rows, int64_t k_len, float *out, int threads) {
    const int64_t row_bytes = k_len / (BFORMAT == FMT_Q4_K || BFORMAT == FMT_Q5_K || BFORMAT == FMT_Q6_K ? 256
                                       : BFORMAT == FMT_W4G128 ? 128 : 32) * block_bytes(BFORMAT);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) BFN(panel_of)(w, row_bytes, n0 + r, 1, k_len, out + r * k_len);
}

#include "invariant_blocks.h"

#undef BFN
#undef BCONCAT
#undef BCONCAT_
#undef BFORMAT
#undef BNAME
