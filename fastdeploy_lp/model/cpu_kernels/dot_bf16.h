/* bfloat16 weights times bfloat16 activations with AVX-512 BF16's `vdpbf16ps`: each instruction
 * multiplies 32 pairs and adds them into 16 float32 sums, twice the products of a float32 FMA, with
 * no widening of the weight. x is rounded to bfloat16 once per call (round to nearest even, as a
 * bfloat16 model's activations are in transformers, oneDNN and vLLM); the products are exact and
 * the sums float32. Included by kernels.c before the bfloat16 `linear.h` when the compiler targets
 * AVX512_BF16 (`-mavx512bf16`, which cpu_features adds only where the CPU reports it);
 * `linear_bf16` takes it at every row count unless `fdlp_set_bf16_dot(0)` keeps float32 activations:
 * up to 8 rows of x here, more in panels (xpanel.h). Zen 4, 2 threads, the bench model's weights:
 * 8 rows 28 -> 58 GMAC/s, 32 rows (panels) 33 -> 104, 256 rows 35 -> 169 (MKL's float32 GEMM over
 * the widened weight: 88).
 *
 * Batch-invariant mode (`--deterministic`) runs this file's tiles at every row count, never the
 * panels: each output is sixteen `vdpbf16ps` chains (lane l over pairs l, l + 16, ... in order) added
 * in `lane_sum`'s tree, so a row's result does not depend on the rows beside it, and x's rounding is
 * per element. Tiles of 8 rows against blocks of 48 weight rows held in L2 ran 16-1024 rows at
 * 0.78-1.07x the panels' speed (Zen 4, 2 threads); panels summed in this order (x lane-major, the
 * lanes added after) ran slower than these tiles at every row count (107 against 138 GMAC/s at 32
 * rows, 118 against 160 at 256). docs/benchmarks.md, "On AVX-512 BF16". */

enum { DOT_STEP = 32 }; /* bfloat16 values a 512-bit vector holds: one weight line */

/* Rows [0, m_len) of x as bfloat16 into `out`, each padded with zeros to `k_pad` (a multiple of
 * DOT_STEP). */
static void bf16_rows(const float *x, int64_t m_len, int64_t k_len, int64_t k_pad, uint16_t *out) {
    for (int64_t m = 0; m < m_len; m++)
        for (int64_t k = 0; k < k_pad; k += DOT_STEP) {
            int64_t left = k_len - k;
            __mmask16 lo = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            __mmask16 hi = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            const float *row = x + m * k_len + k;
            __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, row + 16), _mm512_maskz_loadu_ps(lo, row));
            _mm512_storeu_si512(out + m * k_pad + k, (__m512i)both);
        }
}

/* y[m, n] = xb[m] . w[n] (times scale[n]) for `rows` (<= X_ROWS; a constant once inlined) rows of
 * bfloat16 x and weight rows [n0, n1), WEIGHT_ROWS at a time in long streams as `rows_times` walks
 * them, the weight's last partial line read under a mask (x is zero there). The next block's lines
 * are prefetched over the pass as in `rows_times`. */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t *xb, int64_t k_pad, const uint16_t *w,
                                                           const float *scale, float *y, const int rows,
                                                           int64_t k_len, int64_t n0, int64_t n1, int64_t ldy,
                                                           const char *next, int64_t next_lines) {
    enum { WR = WEIGHT_ROWS, AHEAD = 8192 / sizeof(uint16_t) };
    int64_t k_full = k_len - k_len % DOT_STEP, tail = k_len - k_full;
    int64_t stride = (n1 - n0 + WR - 1) / WR;
    int64_t points = stride * (k_full / DOT_STEP), per = points ? (next_lines + points - 1) / points : 0;
    for (int64_t i = 0; i < stride; i++) {
        int64_t at[WR];
        int valid[WR];
        const uint16_t *wr[WR];
        for (int r = 0; r < WR; r++) {
            at[r] = n0 + i + r * stride;
            valid[r] = at[r] < n1;
            wr[r] = w + (valid[r] ? at[r] : at[0]) * k_len;
        }
        __m512 a[WR][X_ROWS];
        for (int r = 0; r < WR; r++)
            for (int m = 0; m < rows; m++) a[r][m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < k_full; k += DOT_STEP) {
            __m512bh v[WR];
            for (int r = 0; r < WR; r++) {
                v[r] = (__m512bh)_mm512_loadu_si512(wr[r] + k);
                __builtin_prefetch(wr[r] + k + AHEAD);
            }
            for (int64_t j = 0; j < per && next_lines > 0; j++, next_lines--, next += 64) __builtin_prefetch(next);
            for (int m = 0; m < rows; m++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * k_pad + k);
                for (int r = 0; r < WR; r++) a[r][m] = _mm512_dpbf16_ps(a[r][m], v[r], xv);
            }
        }
        if (tail) {
            __m512bh v[WR];
            for (int r = 0; r < WR; r++) v[r] = (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << tail) - 1), wr[r] + k_full);
            for (int m = 0; m < rows; m++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * k_pad + k_full);
                for (int r = 0; r < WR; r++) a[r][m] = _mm512_dpbf16_ps(a[r][m], v[r], xv);
            }
        }
        for (int m = 0; m < rows; m++)
            for (int r = 0; r < WR; r++)
                if (valid[r]) y[m * ldy + at[r]] = lane_sum((vec)a[r][m]) * (scale ? scale[at[r]] : 1.f);
    }
}

/* Weight rows [n0, n1) for every row of x, a tile of X_ROWS rows of x at a time, then the bias. */
static void dot_linear_rows(const uint16_t *xb, int64_t k_pad, const uint16_t *w, const float *scale,
                            const float *bias, float *y, int64_t m_len, int64_t ldy, int64_t k_len, int64_t n0,
                            int64_t n1, const char *next, int64_t next_lines) {
    int64_t tiles = (m_len + X_ROWS - 1) / X_ROWS, share = (next_lines + tiles - 1) / tiles;
    for (int64_t m0 = 0; m0 < m_len; m0 += X_ROWS) {
        const uint16_t *xm = xb + m0 * k_pad;
        float *ym = y + m0 * ldy;
        const char *ahead = next + (m0 / X_ROWS) * share * 64;
        switch (m_len - m0 < X_ROWS ? m_len - m0 : X_ROWS) {
            case 1: dot_rows(xm, k_pad, w, scale, ym, 1, k_len, n0, n1, ldy, ahead, share); break;
            case 2: dot_rows(xm, k_pad, w, scale, ym, 2, k_len, n0, n1, ldy, ahead, share); break;
            case 3: dot_rows(xm, k_pad, w, scale, ym, 3, k_len, n0, n1, ldy, ahead, share); break;
            case 4: dot_rows(xm, k_pad, w, scale, ym, 4, k_len, n0, n1, ldy, ahead, share); break;
            case 5: dot_rows(xm, k_pad, w, scale, ym, 5, k_len, n0, n1, ldy, ahead, share); break;
            case 6: dot_rows(xm, k_pad, w, scale, ym, 6, k_len, n0, n1, ldy, ahead, share); break;
            case 7: dot_rows(xm, k_pad, w, scale, ym, 7, k_len, n0, n1, ldy, ahead, share); break;
            default: dot_rows(xm, k_pad, w, scale, ym, X_ROWS, k_len, n0, n1, ldy, ahead, share);
        }
    }
    if (bias)
        for (int64_t m = 0; m < m_len; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldy + n] += bias[n];
}

/* `linear_bf16` with bfloat16 activations: the threads split the weight rows as `linear_bf16` does
 * (one tile of x: each thread's whole share in long streams; more: blocks of 48 weight rows that
 * stay in L2 across the tiles of x while the next block streams in). -1 if x's buffer cannot grow
 * (the caller then multiplies in float32, or in batch-invariant mode fails the call). */
static int dot_linear(const float *x, const uint16_t *w, const float *scale, const float *bias, float *y,
                      int64_t m_len, int64_t n_len, int64_t k_len, int64_t ldy, int threads) {
    const int64_t block = 48;
    int64_t k_pad = (k_len + DOT_STEP - 1) / DOT_STEP * DOT_STEP;
    /* A long prefill takes x a slice of rows at a time, so the rounded copy stays in the thread's
     * kept buffer: rows are independent, and a fresh buffer the call could not get would leave it
     * to float32 activations, another result. */
    int64_t slice = SCRATCH_KEPT / (int64_t)(k_pad * sizeof(uint16_t));
    slice = slice > PANEL ? slice - slice % PANEL : 1;
    if (m_len > slice) {
        for (int64_t m0 = 0; m0 < m_len; m0 += slice)
            if (dot_linear(x + m0 * k_len, w, scale, bias, y + m0 * ldy, m_len - m0 < slice ? m_len - m0 : slice,
                           n_len, k_len, ldy, threads))
                return -1;
        return 0;
    }
    void *fresh;
    uint16_t *xb = call_scratch(SCRATCH_BF16_ROWS, (size_t)(m_len * k_pad) * sizeof(uint16_t), &fresh);
    if (!xb) return -1;
    bf16_rows(x, m_len, k_len, k_pad, xb);
    if (!batch_invariant && X_PANELS && m_len >= PANEL_MIN_ROWS &&
        !panel_linear((const uint32_t *)xb, k_pad / 2, w, scale, bias, y, m_len, n_len, k_len, ldy, threads, 1)) {
        free(fresh);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t parts = omp_get_num_threads(), share = (n_len + parts - 1) / parts;
        share += (6 - share % 6) % 6;
        int64_t start = omp_get_thread_num() * share, end = start + share < n_len ? start + share : n_len;
        if (m_len <= X_ROWS && start < end)
            dot_linear_rows(xb, k_pad, w, scale, bias, y, m_len, ldy, k_len, start, end, NULL, 0);
        for (int64_t n0 = start; m_len > X_ROWS && n0 < end; n0 += block) {
            int64_t n1 = n0 + block < end ? n0 + block : end, n2 = n1 + block < end ? n1 + block : end;
            dot_linear_rows(xb, k_pad, w, scale, bias, y, m_len, ldy, k_len, n0, n1, (const char *)(w + n1 * k_len),
                            (int64_t)((n2 - n1) * k_len * sizeof(uint16_t) / 64));
        }
    }
    free(fresh);
    return 0;
}
