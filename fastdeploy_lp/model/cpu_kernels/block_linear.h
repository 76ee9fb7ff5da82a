/* The linear kernel for one block format (blocks.h), included by kernels.c once per format with
 * BFORMAT (its FMT_ id) and BNAME (the suffix of the functions) defined. The walk over weight rows
 * is linear.h's: a thread's share of the rows as long streams for one row of x, tiles of X_ROWS
 * rows of x over 48 weight rows at a time (so they stay in L2) for more. */
#define BCONCAT_(a, b) a##_##b
#define BCONCAT(a, b) BCONCAT_(a, b)
#define BFN(f) BCONCAT(f, BNAME)

/* y[m * ldy + at0] (and at1, if `two`) for `rows` rows of x (a constant once inlined) and the two
 * weight rows w0, w1, each group of each weight row unpacked once for all rows of x. */
static inline __attribute__((always_inline)) void BFN(block_tile)(const xquant_t *x, const uint8_t *w0,
                                                                   const uint8_t *w1, int two, float *y0, float *y1,
                                                                   const int rows, int64_t ldy, int64_t blocks) {
    enum { ELEMS = BFORMAT == FMT_Q4_K || BFORMAT == FMT_Q5_K || BFORMAT == FMT_Q6_K ? 256
                   : BFORMAT == FMT_W4G128 ? 128 : 32,
           GROUPS = ELEMS / 32, LINES = 4 };
    const int64_t bytes = block_bytes(BFORMAT);
    gsum_t acc0[X_ROWS], acc1[X_ROWS];
    float min0[X_ROWS], min1[X_ROWS];
    for (int m = 0; m < rows; m++) acc0[m] = acc1[m] = gsum_zero(), min0[m] = min1[m] = 0.f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *b0 = w0 + b * bytes, *b1 = w1 + b * bytes;
        for (int l = 0; l < LINES && l * 64 < bytes; l++) { /* the lines this block spans, GEMV_AHEAD on */
            __builtin_prefetch(b0 + l * 64 + BLOCK_AHEAD);
            __builtin_prefetch(b1 + l * 64 + BLOCK_AHEAD);
        }
        head_t h0, h1;
        unpack_head(BFORMAT, b0, &h0);
        unpack_head(BFORMAT, b1, &h1);
        for (int j = 0; j < GROUPS; j++) {
            group_t g0, g1;
            unpack_group(BFORMAT, b0, j, &g0);
            unpack_group(BFORMAT, b1, j, &g1);
            int64_t at = b * GROUPS + j;
            for (int m = 0; m < rows; m++) {
                const int16_t *xq = x->q + m * x->k + 32 * at;
                float dx = x->d[m * x->groups + at];
                acc0[m] = group_dot(BFORMAT, &g0, xq, h0.d[j] * dx, acc0[m]);
                acc1[m] = group_dot(BFORMAT, &g1, xq, h1.d[j] * dx, acc1[m]);
                if (has_minimum(BFORMAT)) {
                    float sx = x->s[m * x->groups + at];
                    min0[m] += h0.m[j] * sx;
                    min1[m] += h1.m[j] * sx;
                }
            }
        }
    }
    for (int m = 0; m < rows; m++) {
        y0[m * ldy] = gsum_total(acc0[m]) + min0[m];
        if (two) y1[m * ldy] = gsum_total(acc1[m]) + min1[m];
    }
}

/* Weight rows [n0, n1) for x rows [m0, m0 + rows): rows i and i + half together (two long streams,
 * as linear.h's PAIRS_BEGIN). */
static void BFN(block_rows)(const xquant_t *x, const uint8_t *w, float *y, int64_t m0, int64_t rows, int64_t ldy,
                            int64_t k_len, int64_t n0, int64_t n1) {
    int64_t blocks = k_len / (BFORMAT == FMT_Q4_K || BFORMAT == FMT_Q5_K || BFORMAT == FMT_Q6_K ? 256
                              : BFORMAT == FMT_W4G128 ? 128 : 32);
    int64_t row_bytes = blocks * block_bytes(BFORMAT), half = (n1 - n0 + 1) / 2;
    xquant_t xm = *x;
    xm.q += m0 * x->k, xm.d += m0 * x->groups, xm.s += m0 * x->groups;
    float *ym = y + m0 * ldy;
    for (int64_t i = 0; i < half; i++) {
        int64_t r0 = n0 + i, r1 = n0 + half + i;
        int two = r1 < n1;
        const uint8_t *w0 = w + r0 * row_bytes, *w1 = w + (two ? r1 : r0) * row_bytes;
        switch (rows) {
            case 1: BFN(block_tile)(&xm, w0, w1, two, ym + r0, ym + r1, 1, ldy, blocks); break;
            case 2: BFN(block_tile)(&xm, w0, w1, two, ym + r0, ym + r1, 2, ldy, blocks); break;
            case 3: BFN(block_tile)(&xm, w0, w1, two, ym + r0, ym + r1, 3, ldy, blocks); break;
#if X_ROWS > 4
            case 4: BFN(block_tile)(&xm, w0, w1, two, ym + r0, ym + r1, 4, ldy, blocks); break;
            case 5: BFN(block_tile)(&xm, w0, w1, two, ym + r0, ym + r1, 5, ldy, blocks); break;
            case 6: BFN(block_tile)(&xm, w0, w1, two, ym + r0, ym + r1, 6, ldy, blocks); break;
            case 7: BFN(block_tile)(&xm, w0, w1, two, ym + r0, ym + r1, 7, ldy, blocks); break;
#endif
            default: BFN(block_tile)(&xm, w0, w1, two, ym + r0, ym + r1, X_ROWS, ldy, blocks);
        }
    }
}

/* y[m, n] (row stride ldy) = x[m, :] . w[n, :] + bias[n] for the quantized x, over n_len weight rows;
 * each thread an equal, even share of the rows. */
static void BFN(block_linear)(const xquant_t *x, const uint8_t *w, const float *bias, float *y, int64_t m_len,
                              int64_t n_len, int64_t k_len, int64_t ldy, int threads) {
    const int64_t block = 48;
#pragma omp parallel num_threads(threads)
    {
        int64_t parts = omp_get_num_threads(), share = (n_len + parts - 1) / parts;
        share += share % 2;
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
                __m256 d = _mm256_set1_ps(h.d[j]), m = _mm256_set1_ps(has_minimum(BFORMAT) ? h.m[j] : 0.f);
                __m256i halves[2] = {g.lo, g.hi};
                for (int half = 0; half < 2; half++)
                    for (int q = 0; q < 2; q++) {
                        __m128i part = q ? _mm256_extracti128_si256(halves[half], 1) : _mm256_castsi256_si128(halves[half]);
                        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(part));
                        _mm256_storeu_ps(o + 32 * j + 16 * half + 8 * q, _mm256_fmadd_ps(v, d, m));
                    }
#else
                float m = has_minimum(BFORMAT) ? h.m[j] : 0.f;
                for (int i = 0; i < 32; i++)
                    o[32 * j + i] = h.d[j] * (float)(g.q[i] * (BFORMAT == FMT_Q6_K ? g.sc[i / 16] : 1)) + m;
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

/* The linear for many rows of x (batched decode, prefill): each thread widens a panel of its
 * weight rows to float32 (in L2) and multiplies it by every tile of x with linear.h's float
 * kernel: float activations, exact as the float path, and a weight group unpacked once for all
 * rows of x where the integer kernel unpacks it once per tile of X_ROWS and spends 7 operations a
 * group and row against the float kernel's 4 FMAs. */
static int BFN(block_panels)(const float *x, const uint8_t *w, const float *bias, float *y, int64_t m_len,
                             int64_t n_len, int64_t k_len, int64_t ldy, int threads) {
    const int64_t row_bytes = k_len / (BFORMAT == FMT_Q4_K || BFORMAT == FMT_Q5_K || BFORMAT == FMT_Q6_K ? 256
                                       : BFORMAT == FMT_W4G128 ? 128 : 32) * block_bytes(BFORMAT);
    int64_t panel = (PANEL_BYTES / (k_len * (int64_t)sizeof(float))) / WEIGHT_ROWS * WEIGHT_ROWS;
    panel = panel < WEIGHT_ROWS ? WEIGHT_ROWS : panel > 48 ? 48 : panel;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int64_t parts = omp_get_num_threads(), share = (n_len + parts - 1) / parts;
        int64_t start = omp_get_thread_num() * share, end = start + share < n_len ? start + share : n_len;
        float *buffer = panel_buffer(panel * k_len);
        failed = start < end && !buffer;
        for (int64_t n0 = start; buffer && n0 < end; n0 += panel) {
            int64_t rows = n0 + panel < end ? panel : end - n0;
            BFN(panel_of)(w, row_bytes, n0, rows, k_len, buffer);
            for (int64_t m0 = 0; m0 < m_len; m0 += X_ROWS) {
                const float *xm = x + m0 * k_len;
                float *ym = y + m0 * ldy + n0;
                switch (m_len - m0 < X_ROWS ? m_len - m0 : X_ROWS) {
                    case 1: rows_times_f32(xm, buffer, NULL, ym, 1, k_len, 0, rows, ldy); break;
                    case 2: rows_times_f32(xm, buffer, NULL, ym, 2, k_len, 0, rows, ldy); break;
                    case 3: rows_times_f32(xm, buffer, NULL, ym, 3, k_len, 0, rows, ldy); break;
#if X_ROWS > 4
                    case 4: rows_times_f32(xm, buffer, NULL, ym, 4, k_len, 0, rows, ldy); break;
                    case 5: rows_times_f32(xm, buffer, NULL, ym, 5, k_len, 0, rows, ldy); break;
                    case 6: rows_times_f32(xm, buffer, NULL, ym, 6, k_len, 0, rows, ldy); break;
                    case 7: rows_times_f32(xm, buffer, NULL, ym, 7, k_len, 0, rows, ldy); break;
#endif
                    default: rows_times_f32(xm, buffer, NULL, ym, X_ROWS, k_len, 0, rows, ldy);
                }
            }
            if (bias)
                for (int64_t m = 0; m < m_len; m++)
                    for (int64_t n = n0; n < n0 + rows; n++) y[m * ldy + n] += bias[n];
        }
    }
    return failed ? -1 : 0;
}

#undef BFN
#undef BCONCAT
#undef BCONCAT_
#undef BFORMAT
#undef BNAME
