/* Many rows of x against float32 or bfloat16 weights with no horizontal sums (AVX-512 builds).
 *
 * `rows_times` keeps one vector of partial sums per (weight row, x row) and adds its 16 lanes at the
 * end: at 32 rows of x that is 24 reductions for every 56 FMAs of a 896-wide row, and it ran at
 * 30 GMAC/s on two Zen 4 cores where MKL's GEMM ran 58. Here x is packed into panels of 16 rows
 * (lane m holds row m), each weight element (bfloat16: each pair) is broadcast against a panel,
 * and a vector of sums is one weight row's outputs for 16 rows of x: no reductions, and the weight
 * still streams through once per call. Tile: PANEL_NR weight rows x up to two panels (24
 * accumulators of 32 registers). The sums are in k order, per output one FMA chain. */

/* PANEL_AHEAD: each weight row is prefetched this many bytes ahead into L2, not L1: the panels of
 * x stream through L1 between a prefetch and its use, and evicted the lines prefetched there (32
 * rows, 2 threads, Zen 4: bfloat16 9728 x 896 96 -> 133 GMAC/s, float32 66 -> 82; 256 and 512
 * bytes into L1, 2048 into L2 in between). */
enum { PANEL = 16, PANEL_NR = 12, PANEL_BLOCK = 96 /* weight rows kept in L2 across x's panels */, PANEL_AHEAD = 1024 };

/* Scratch for one call, from the calling thread: its kept buffer `slot` (grown to the largest size
 * seen) when `bytes` fit in SCRATCH_KEPT, so a decode step allocates nothing (a fresh 600 KB, a down
 * projection's 32 rows, came from mmap with its page faults at every call); a larger one (prefill)
 * is allocated for the call and `*fresh` set for the caller to free. NULL: no memory. */
enum { SCRATCH_KEPT = 8 << 20, SCRATCH_BF16_ROWS = 0 /* dot_bf16.h's x rounded */, SCRATCH_PANELS = 1 };
static void *call_scratch(int slot, size_t bytes, void **fresh) {
    static __thread void *kept[2];
    static __thread size_t size[2];
    *fresh = NULL;
    if (bytes > SCRATCH_KEPT) return *fresh = malloc(bytes);
    if (bytes > size[slot]) {
        void *grown = realloc(kept[slot], bytes);
        if (!grown) return NULL;
        kept[slot] = grown, size[slot] = bytes;
    }
    return kept[slot];
}

/* x's rows (`words` 32-bit words each: floats, or pairs of bfloat16) in panels of PANEL rows:
 * out[(p * words + j) * PANEL + l] = rows[(p * PANEL + l) * row_words + j], zero for rows past
 * m_len. 16 x 16 blocks are transposed in registers. */
static void pack_panels(const uint32_t *rows, int64_t m_len, int64_t row_words, int64_t words, uint32_t *out) {
    int64_t panels = (m_len + PANEL - 1) / PANEL, full = words - words % PANEL;
    for (int64_t p = 0; p < panels; p++) {
        uint32_t *panel = out + p * words * PANEL;
        for (int64_t j = 0; j < full; j += PANEL) {
            vec r[PANEL];
            for (int l = 0; l < PANEL; l++)
                r[l] = p * PANEL + l < m_len ? load((const float *)rows + (p * PANEL + l) * row_words + j) : (vec){0};
            transpose_lanes(r);
            for (int l = 0; l < PANEL; l++) *(vec *)(panel + (j + l) * PANEL) = r[l];
        }
        for (int64_t j = full; j < words; j++)
            for (int l = 0; l < PANEL; l++)
                panel[j * PANEL + l] = p * PANEL + l < m_len ? rows[(p * PANEL + l) * row_words + j] : 0;
    }
}

/* One weight element (float32) or pair (bfloat16 with `vdpbf16ps`) in every lane, times a panel of x. */
static inline __attribute__((always_inline)) __m512 panel_step(__m512 acc, const void *w, int64_t j, __m512 x,
                                                               const int dot) {
#if defined(__AVX512BF16__)
    if (dot) {
        int32_t pair;
        memcpy(&pair, (const uint16_t *)w + 2 * j, sizeof pair);
        return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)_mm512_set1_epi32(pair));
    }
#endif
    (void)dot;
    return _mm512_fmadd_ps(_mm512_set1_ps(((const float *)w)[j]), x, acc);
}

/* y[m, n + r] for r < nr (<= PANEL_NR) and the rows of `panels` (1 or 2) panels of x from row m0:
 * one step per weight (float32) or pair (bfloat16), each one FMA or `vdpbf16ps` per accumulator, then the outputs of the rows that
 * exist, times the scale, plus the bias. A bfloat16 weight row of odd length ends in a single
 * weight, paired here with a zero (x is zero there too). */
static inline __attribute__((always_inline)) void panel_tile(const uint32_t *xp, int64_t words, const void *w,
                                                             int64_t k_len, int64_t n, const int nr, const int panels,
                                                             int64_t m0, int64_t m_len, const float *scale,
                                                             const float *bias, float *y, int64_t ldy, const int dot) {
    const int64_t size = dot ? 2 : 4, odd = dot && k_len % 2, steps = dot ? k_len / 2 : k_len;
    __m512 a[PANEL_NR][2];
    const char *wr[PANEL_NR];
    for (int r = 0; r < nr; r++) {
        wr[r] = (const char *)w + (n + r) * k_len * size;
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    }
    const float *x0 = (const float *)xp, *x1 = x0 + words * PANEL;
    for (int64_t j = 0; j < steps; j++) {
        if (j % 16 == 0) /* one 64-byte line of each weight row per 16 steps */
            for (int r = 0; r < nr; r++) __builtin_prefetch(wr[r] + j * 4 + PANEL_AHEAD, 0, 2);
        __m512 xa = _mm512_loadu_ps(x0 + j * PANEL), xb = panels > 1 ? _mm512_loadu_ps(x1 + j * PANEL) : xa;
        for (int r = 0; r < nr; r++) {
            a[r][0] = panel_step(a[r][0], wr[r], j, xa, dot);
            if (panels > 1) a[r][1] = panel_step(a[r][1], wr[r], j, xb, dot);
        }
    }
    if (odd) {
        __m512 xa = _mm512_loadu_ps(x0 + steps * PANEL), xb = panels > 1 ? _mm512_loadu_ps(x1 + steps * PANEL) : xa;
        for (int r = 0; r < nr; r++) {
            uint16_t single[2] = {((const uint16_t *)wr[r])[k_len - 1], 0};
            a[r][0] = panel_step(a[r][0], single, 0, xa, dot);
            if (panels > 1) a[r][1] = panel_step(a[r][1], single, 0, xb, dot);
        }
    }
    for (int p = 0; p < panels; p++) {
        int64_t live = m_len - (m0 + p * PANEL) < PANEL ? m_len - (m0 + p * PANEL) : PANEL;
        for (int r = 0; r < nr; r++) {
            float out[PANEL], s = scale ? scale[n + r] : 1.f, b = bias ? bias[n + r] : 0.f;
            _mm512_storeu_ps(out, a[r][p]);
            for (int64_t l = 0; l < live; l++) y[(m0 + p * PANEL + l) * ldy + n + r] = out[l] * s + b;
        }
    }
}

/* Weight rows [n0, n1) against every panel of x: PANEL_BLOCK weight rows at a time (they stay in L2
 * across the panels), two panels at a time, PANEL_NR weight rows a tile (a block's last rows one
 * at a time). */
static inline __attribute__((always_inline)) void panel_rows(const uint32_t *xp, int64_t words, const void *w,
                                                             int64_t k_len, int64_t n0, int64_t n1, int64_t m_len,
                                                             const float *scale, const float *bias, float *y,
                                                             int64_t ldy, const int dot) {
    for (int64_t b0 = n0; b0 < n1; b0 += PANEL_BLOCK) {
        int64_t b1 = b0 + PANEL_BLOCK < n1 ? b0 + PANEL_BLOCK : n1;
        for (int64_t m0 = 0; m0 < m_len; m0 += 2 * PANEL) {
            const uint32_t *xm = xp + (m0 / PANEL) * words * PANEL;
            int two = m_len - m0 > PANEL;
            for (int64_t n = b0; n < b1; n += PANEL_NR) {
                int nr = b1 - n < PANEL_NR ? (int)(b1 - n) : PANEL_NR;
                if (nr == PANEL_NR && two)
                    panel_tile(xm, words, w, k_len, n, PANEL_NR, 2, m0, m_len, scale, bias, y, ldy, dot);
                else if (nr == PANEL_NR)
                    panel_tile(xm, words, w, k_len, n, PANEL_NR, 1, m0, m_len, scale, bias, y, ldy, dot);
                else
                    for (int r = 0; r < nr; r++)
                        panel_tile(xm, words, w, k_len, n + r, 1, two ? 2 : 1, m0, m_len, scale, bias, y, ldy, dot);
            }
        }
    }
}

/* y[M, N] = x @ w^T (times scale, plus bias) with x in panels: float32 weights and x (`dot` 0, `rows`
 * is x, `words` k_len) or bfloat16 weights and x (`dot` 1, AVX512_BF16 builds: `rows` is x rounded
 * by `bf16_rows`, `words` half its padded row). Threads split the weight rows in whole tiles. -1
 * if the panels' buffer cannot be had (the caller then runs its own kernel). */
static int panel_linear(const uint32_t *rows, int64_t words, const void *w, const float *scale, const float *bias,
                        float *y, int64_t m_len, int64_t n_len, int64_t k_len, int64_t ldy, int threads, const int dot) {
    void *fresh;
    uint32_t *xp = call_scratch(SCRATCH_PANELS, (size_t)((m_len + PANEL - 1) / PANEL * PANEL * words) * sizeof(uint32_t), &fresh);
    if (!xp) return -1;
    pack_panels(rows, m_len, words, words, xp);
#pragma omp parallel num_threads(threads)
    {
        int64_t parts = omp_get_num_threads(), share = (n_len + parts - 1) / parts;
        share += (PANEL_NR - share % PANEL_NR) % PANEL_NR;
        int64_t start = omp_get_thread_num() * share, end = start + share < n_len ? start + share : n_len;
        if (start < end && dot) panel_rows(xp, words, w, k_len, start, end, m_len, scale, bias, y, ldy, 1);
        else if (start < end) panel_rows(xp, words, w, k_len, start, end, m_len, scale, bias, y, ldy, 0);
    }
    free(fresh);
    return 0;
}
