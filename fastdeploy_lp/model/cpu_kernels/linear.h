/* The linear kernel for one weight format, included by kernels.c once per format with WEIGHT (the
 * stored element type), FORMAT (the suffix of `load_w_FORMAT` and of the exported
 * `fdlp_linear_FORMAT`) and GEMV_AHEAD (the GEMV's prefetch distance) defined, SPLIT where the
 * format has a `split_FORMAT`, NARROW for the formats narrower than float32 (their `fdlp_widen_*`
 * and `fdlp_embed_*`) and QUANTIZE for those int8 is quantized from (`fdlp_quantize_*`). Weights
 * are widened to float32 vectors as they are loaded; the prefetch distance is in bytes, so every
 * format keeps as many reads in flight. */
/* The GEMVs' walk over weight rows [n0, n1), two at a time: row i with row i + half, so each of
 * the two reads runs on through consecutive rows, two long sequential streams for the hardware
 * prefetcher instead of a new pair of short ones per row pair (rows i and i + 1: one read restarted
 * every pair). Bench model, 2 threads, Xeon AVX-512: bfloat16 21.3 -> 24.1 GB/s, int8 18.4 -> 22.5,
 * float32 unchanged (its rows are long enough already). Opens the loop body: w0, w1 are the rows,
 * y[r0] and, if `two`, y[r1] their outputs. */
#define PAIRS_BEGIN                                                                         \
    int64_t half = (n1 - n0 + 1) / 2;                                                       \
    for (int64_t i = 0; i < half; i++) {                                                    \
        int64_t r0 = n0 + i, r1 = n0 + half + i;                                            \
        int two = r1 < n1;                                                                  \
        const WEIGHT *w0 = w + r0 * k_len, *w1 = w + (two ? r1 : r0) * k_len;
#define CONCAT_(a, b) a##_##b
#define CONCAT(a, b) CONCAT_(a, b)
#define NAME(f) CONCAT(f, FORMAT)

/* y[m, n] = sum_k x[m, k] * w[n, k] for `rows` (<= X_ROWS; a constant once inlined) rows of x and
 * the weight rows [n0, n1), WEIGHT_ROWS at a time, each weight vector loaded once for all rows of
 * x. Decode is bound by reading the weight, and MKL's GEMM reads it at half the speed of its GEMV
 * for 2 to 16 rows. The prefetch 8 KB ahead keeps enough of those reads in flight between the
 * FMAs: 8 rows over the bench model's weights took 92 ms with it, 116 without (AVX-512). One row of
 * float32 weights (batch-invariant decode) reads faster on the hardware prefetcher alone, as the
 * float32 GEMV does (GEMV_AHEAD 0): with the LM head, Zen 4, 2 threads, 7.8 -> 9.9 GMAC/s, the GEMV's 10.0. */
static inline __attribute__((always_inline)) void NAME(rows_times)(const float *x, const WEIGHT *w,
                                                                   const float *scale, float *y, const int rows,
                                                                   int64_t k_len, int64_t n0, int64_t n1,
                                                                   int64_t ldy, const char *next, int64_t next_lines) {
    enum { WR = WEIGHT_ROWS, AHEAD = 8192 / sizeof(WEIGHT), LINE = 64 / sizeof(WEIGHT) };
    const int fetch = rows > 1 || GEMV_AHEAD > 0 || next_lines > 0; /* all but a lone row of float32 */
    int64_t k_full = k_len - k_len % LANES, tail = k_len - k_full;
    int64_t stride = (n1 - n0 + WR - 1) / WR; /* row r of a pass is stride rows after row r - 1: long streams */
    /* `next_lines` lines from `next` (the weight block the caller multiplies next) are prefetched
     * spread over this pass, `per` at each line of its own weight rows, so memory streams while it computes */
    int64_t points = stride * ((k_full + LINE - 1) / LINE), per = points ? (next_lines + points - 1) / points : 0;
    for (int64_t i = 0; i < stride; i++) {
        int64_t at[WR];
        int valid[WR];
        const WEIGHT *wr[WR];
        for (int r = 0; r < WR; r++) {
            at[r] = n0 + i + r * stride;
            valid[r] = at[r] < n1;
            wr[r] = w + (valid[r] ? at[r] : at[0]) * k_len;
        }
        vec a[WR][X_ROWS];
        for (int r = 0; r < WR; r++)
            for (int m = 0; m < rows; m++) a[r][m] = (vec){0};
        for (int64_t k = 0; k < k_full; k += LANES) {
            vec v[WR];
            for (int r = 0; r < WR; r++) {
                v[r] = NAME(load_w)(wr[r] + k);
                if (fetch && k % LINE == 0) __builtin_prefetch(wr[r] + k + AHEAD); /* one per 64-byte line */
            }
            if (next_lines > 0 && k % LINE == 0)
                for (int64_t j = 0; j < per && next_lines > 0; j++, next_lines--, next += 64) __builtin_prefetch(next);
            for (int m = 0; m < rows; m++) {
                vec xv = load(x + m * k_len + k);
                for (int r = 0; r < WR; r++) a[r][m] += v[r] * xv;
            }
        }
        if (tail) {
            vec v[WR];
            for (int r = 0; r < WR; r++) v[r] = NAME(load_w_tail)(wr[r] + k_full, tail);
            for (int m = 0; m < rows; m++) {
                vec xv = load_tail(x + m * k_len + k_full, tail);
                for (int r = 0; r < WR; r++) a[r][m] += v[r] * xv;
            }
        }
        for (int m = 0; m < rows; m++)
            for (int r = 0; r < WR; r++)
                if (valid[r]) y[m * ldy + at[r]] = lane_sum(a[r][m]) * (scale ? scale[at[r]] : 1.f);
    }
}

/* y[n] = x . w[n] for one row of x (a GEMV) and weight rows [n0, n1): two weight rows at a time
 * with four accumulators each (eight registers at every width), so more loads are in flight.
 * Prefetching GEMV_AHEAD bytes ahead (0: not at all) is per format: float32 needs none (256 to
 * 4096 bytes ahead slowed it, AVX-512 and AVX2 alike; 90% of the measured read bandwidth over the
 * bench model's weights, as fast as MKL's GEMV), while the narrow formats spend long enough
 * widening each line that without it the reads no longer overlap the arithmetic (int8: 13 -> 18
 * GB/s with 1 KB ahead, AVX-512 Xeon, 2 cores; 4 KB ahead beat 0.25, 0.5, 1 and 2 KB for int8 and
 * bfloat16 alike, one core, interleaved runs). */
static void NAME(vector_times)(const float *x, const WEIGHT *w, const float *scale, float *y, int64_t k_len,
                               int64_t n0, int64_t n1) {
    enum { LINE = 64 / sizeof(WEIGHT), LINES = (4 * LANES * sizeof(WEIGHT) + 63) / 64 };
    int64_t k_quad = k_len - k_len % (4 * LANES), k_full = k_len - k_len % LANES, tail = k_len - k_full;
    PAIRS_BEGIN
        vec a0[4] = {{0}}, a1[4] = {{0}};
        int64_t k = 0;
        for (; k < k_quad; k += 4 * LANES) {
            for (int l = 0; GEMV_AHEAD && l < LINES; l++) { /* each 64-byte line this step reads */
                __builtin_prefetch(w0 + k + l * LINE + GEMV_AHEAD / sizeof(WEIGHT));
                __builtin_prefetch(w1 + k + l * LINE + GEMV_AHEAD / sizeof(WEIGHT));
            }
            for (int u = 0; u < 4; u++) {
                vec xv = load(x + k + u * LANES);
                a0[u] += NAME(load_w)(w0 + k + u * LANES) * xv;
                a1[u] += NAME(load_w)(w1 + k + u * LANES) * xv;
            }
        }
        for (; k < k_full; k += LANES) {
            vec xv = load(x + k);
            a0[0] += NAME(load_w)(w0 + k) * xv;
            a1[0] += NAME(load_w)(w1 + k) * xv;
        }
        if (tail) {
            vec xv = load_tail(x + k_full, tail);
            a0[0] += NAME(load_w_tail)(w0 + k_full, tail) * xv;
            a1[0] += NAME(load_w_tail)(w1 + k_full, tail) * xv;
        }
        y[r0] = lane_sum(a0[0] + a0[1] + a0[2] + a0[3]) * (scale ? scale[r0] : 1.f);
        if (two) y[r1] = lane_sum(a1[0] + a1[1] + a1[2] + a1[3]) * (scale ? scale[r1] : 1.f);
    }
}

#ifdef SPLIT
/* One CHUNK of two weight rows into SPLIT accumulators each (split_vector_times' inner step). */
static inline __attribute__((always_inline)) void NAME(split_step)(const WEIGHT *w0, const WEIGHT *w1, const float *xs,
                                                                   int64_t k, vec *a0, vec *a1) {
    enum { LINES = (SPLIT * LANES * sizeof(WEIGHT) + 63) / 64 };
    for (int l = 0; l < LINES; l++) {
        __builtin_prefetch(w0 + k + l * 64 / sizeof(WEIGHT) + GEMV_AHEAD / sizeof(WEIGHT));
        __builtin_prefetch(w1 + k + l * 64 / sizeof(WEIGHT) + GEMV_AHEAD / sizeof(WEIGHT));
    }
    vec p0[SPLIT], p1[SPLIT];
    NAME(split)(*(const ivec *)(w0 + k), p0);
    NAME(split)(*(const ivec *)(w1 + k), p1);
    for (int s = 0; s < SPLIT; s++) {
        vec xv = load(xs + k + s * LANES);
        a0[s] += p0[s] * xv;
        a1[s] += p1[s] * xv;
    }
}

/* vector_times for a format whose widening is a bit shift (bfloat16): one integer vector holds
 * SPLIT * LANES weights, lane i the weights i * SPLIT + s for s < SPLIT, and `split_FORMAT` makes
 * SPLIT float vectors of it with shifts and masks, where the widening load spends a shuffle (one
 * port on x86) per vector. `xs` is x permuted to match (`permute_x`), so each product is one FMA.
 * bfloat16 over the bench model's weights: 20 -> 24 GB/s with the prefetch (AVX-512 Xeon, 2 cores). */
static void NAME(split_vector_times)(const float *x, const float *xs, const WEIGHT *w, const float *scale, float *y,
                                     int64_t k_len, int64_t n0, int64_t n1) {
    enum { CHUNK = SPLIT * LANES, UNROLL = 4 / SPLIT };
    int64_t k_main = k_len - k_len % (UNROLL * CHUNK), k_split = k_len - k_len % CHUNK;
    int64_t k_full = k_len - k_len % LANES, tail = k_len - k_full;
    PAIRS_BEGIN
        vec a0[UNROLL * SPLIT] = {{0}}, a1[UNROLL * SPLIT] = {{0}};
        int64_t k = 0;
        /* Unrolled so that each accumulator's index is a constant: one indexed at run time lives
         * on the stack, and its store-to-load round trip, not the memory, set the pace. */
        for (; k < k_main; k += UNROLL * CHUNK)
            for (int u = 0; u < UNROLL; u++) NAME(split_step)(w0, w1, xs, k + u * CHUNK, a0 + u * SPLIT, a1 + u * SPLIT);
        for (; k < k_split; k += CHUNK) NAME(split_step)(w0, w1, xs, k, a0, a1);
        for (; k < k_full; k += LANES) { /* the rest against x in its own order */
            vec xv = load(x + k);
            a0[0] += NAME(load_w)(w0 + k) * xv;
            a1[0] += NAME(load_w)(w1 + k) * xv;
        }
        if (tail) {
            vec xv = load_tail(x + k_full, tail);
            a0[0] += NAME(load_w_tail)(w0 + k_full, tail) * xv;
            a1[0] += NAME(load_w_tail)(w1 + k_full, tail) * xv;
        }
        vec s0 = a0[0], s1 = a1[0];
        for (int i = 1; i < UNROLL * SPLIT; i++) s0 += a0[i], s1 += a1[i];
        y[r0] = lane_sum(s0) * (scale ? scale[r0] : 1.f);
        if (two) y[r1] = lane_sum(s1) * (scale ? scale[r1] : 1.f);
    }
}
#endif

/* Weight rows [n0, n1) of the linear below, for every row of x (xs: x permuted, or NULL). */
static void NAME(linear_rows)(const float *x, const float *xs, const WEIGHT *w, const float *scale, const float *bias,
                              float *y, int64_t m_len, int64_t ldy, int64_t k_len, int64_t n0, int64_t n1,
                              const char *next, int64_t next_lines) {
    int64_t tiles = (m_len + X_ROWS - 1) / X_ROWS, share = (next_lines + tiles - 1) / tiles; /* per tile of x */
    int gemv = m_len == 1 && !batch_invariant; /* batch-invariant: one row as rows_times sums it */
#ifdef SPLIT
    if (gemv && xs) NAME(split_vector_times)(x, xs, w, scale, y, k_len, n0, n1);
    else if (gemv) NAME(vector_times)(x, w, scale, y, k_len, n0, n1);
#else
    (void)xs;
    if (gemv) NAME(vector_times)(x, w, scale, y, k_len, n0, n1);
#endif
    for (int64_t m0 = 0; !gemv && m0 < m_len; m0 += X_ROWS) {
        const float *xm = x + m0 * k_len;
        float *ym = y + m0 * ldy;
        switch (m_len - m0 < X_ROWS ? m_len - m0 : X_ROWS) {
            case 1: NAME(rows_times)(xm, w, scale, ym, 1, k_len, n0, n1, ldy, next + (m0 / X_ROWS) * share * 64, share); break;
            case 2: NAME(rows_times)(xm, w, scale, ym, 2, k_len, n0, n1, ldy, next + (m0 / X_ROWS) * share * 64, share); break;
            case 3: NAME(rows_times)(xm, w, scale, ym, 3, k_len, n0, n1, ldy, next + (m0 / X_ROWS) * share * 64, share); break;
#if X_ROWS > 4
            case 4: NAME(rows_times)(xm, w, scale, ym, 4, k_len, n0, n1, ldy, next + (m0 / X_ROWS) * share * 64, share); break;
            case 5: NAME(rows_times)(xm, w, scale, ym, 5, k_len, n0, n1, ldy, next + (m0 / X_ROWS) * share * 64, share); break;
            case 6: NAME(rows_times)(xm, w, scale, ym, 6, k_len, n0, n1, ldy, next + (m0 / X_ROWS) * share * 64, share); break;
            case 7: NAME(rows_times)(xm, w, scale, ym, 7, k_len, n0, n1, ldy, next + (m0 / X_ROWS) * share * 64, share); break;
#endif
            default: NAME(rows_times)(xm, w, scale, ym, X_ROWS, k_len, n0, n1, ldy, next + (m0 / X_ROWS) * share * 64, share);
        }
    }
    if (bias)
        for (int64_t m = 0; m < m_len; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldy + n] += bias[n];
}

/* Weight rows [n0, n0 + INVARIANT_COLS) lane-major for `invariant_panel`, widened:
 * out[l][j][c] = w[n0 + c, j * LANES + l] (rows past n_len repeat row n0; their outputs are not kept). */
static void NAME(pack_panel)(const WEIGHT *w, int64_t n0, int64_t n_len, int64_t k_len, float *out) {
    int64_t steps = lane_steps(k_len), k_full = k_len - k_len % LANES;
    for (int g = 0; g < INVARIANT_COLS / LANES; g++) {
        const WEIGHT *rows[LANES];
        for (int c = 0; c < LANES; c++) rows[c] = w + (n0 + g * LANES + c < n_len ? n0 + g * LANES + c : n0) * k_len;
        for (int64_t j = 0; j < steps; j++) {
            vec r[LANES];
#pragma GCC unroll 16
            for (int c = 0; c < LANES; c++)
                r[c] = j * LANES < k_full ? NAME(load_w)(rows[c] + j * LANES) : NAME(load_w_tail)(rows[c] + k_full, k_len - k_full);
            transpose_lanes(r);
#pragma GCC unroll 16
            for (int l = 0; l < LANES; l++) *(vec *)(out + (l * steps + j) * INVARIANT_COLS + g * LANES) = r[l];
        }
    }
}

/* `linear` for many rows of x in batch-invariant mode: each thread packs its share of the weight a
 * group of panels at a time and takes slices of x, packed in turn, against them (invariant.h); the
 * bias is added after the sums, as `linear_rows` adds it. -1 if a thread found no memory for its
 * packed copies (the caller then runs `rows_times`, the same sums). */
static int NAME(invariant_linear)(const float *x, const WEIGHT *w, const float *scale, const float *bias, float *y,
                                  int64_t m_len, int64_t n_len, int64_t k_len, int64_t ldy, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int64_t panels = (n_len + INVARIANT_COLS - 1) / INVARIANT_COLS, threads_here = omp_get_num_threads();
        int64_t share = (panels + threads_here - 1) / threads_here, start = omp_get_thread_num() * share;
        int64_t end = start + share < panels ? start + share : panels;
        int64_t panel = LANES * lane_steps(k_len) * INVARIANT_COLS, group = panels_at_once(k_len);
        int64_t x_rows = x_rows_at_once(k_len), x_floats = LANES * lane_steps(k_len) * x_rows;
        float *wp = start < end ? malloc((size_t)(group * panel + x_floats) * sizeof(float)) : NULL;
        float *xp = wp ? wp + group * panel : NULL;
        if (start < end && !wp) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t p0 = start; wp && p0 < end; p0 += group) {
            int64_t p1 = p0 + group < end ? p0 + group : end;
            for (int64_t p = p0; p < p1; p++) NAME(pack_panel)(w, p * INVARIANT_COLS, n_len, k_len, wp + (p - p0) * panel);
            for (int64_t m0 = 0; m0 < m_len; m0 += x_rows) {
                int64_t m1 = m0 + x_rows < m_len ? m0 + x_rows : m_len;
                pack_x_rows(x, m0, m1, k_len, xp);
                for (int64_t p = p0; p < p1; p++) {
                    int64_t n0 = p * INVARIANT_COLS;
                    invariant_panel(xp, wp + (p - p0) * panel, m1 - m0, k_len, scale, y + m0 * ldy, ldy, n0,
                                    n_len - n0 < INVARIANT_COLS ? (int)(n_len - n0) : INVARIANT_COLS);
                }
            }
        }
        int64_t n_end = end * INVARIANT_COLS < n_len ? end * INVARIANT_COLS : n_len;
        for (int64_t m = 0; bias && wp && m < m_len; m++)
            for (int64_t n = start * INVARIANT_COLS; n < n_end; n++) y[m * ldy + n] += bias[n];
        free(wp);
    }
    return failed ? -1 : 0;
}

/* y[M, N] (row stride ldy) = (x[M, K] @ w[N, K]^T) * scale[N] (when scale is not NULL) + bias[N] (when
 * bias is not NULL). Each thread takes an equal share of the weight rows (a multiple of 6: whole pairs for the GEMV,
 * whole triples for rows_times): a GEMV all at once (see PAIRS_BEGIN), several rows of x 48 weight
 * rows at a time so they stay in L2 across x's row tiles. Blocks of 48 dealt out whole gave one of
 * two threads 480 of 896 rows and the call waited for it: the bench model's o and down projections
 * read 7% slower. In batch-invariant mode many rows take `invariant_linear`, the same sums packed
 * (bfloat16 activations on AVX512_BF16: dot_bf16.h's tiles). Returns 0, or -1 in batch-invariant
 * mode when dot_bf16.h found no memory (float32 activations would change the result). */
static int NAME(linear)(const float *x, const WEIGHT *w, const float *scale, const float *bias, float *y,
                        int64_t m_len, int64_t n_len, int64_t k_len, int64_t ldy, int threads) {
    const int64_t block = 48;
#ifdef DOT_LINEAR /* the format's own dot product (bfloat16 on AVX512_BF16, dot_bf16.h) */
    if (bf16_dot && !DOT_LINEAR(x, w, scale, bias, y, m_len, n_len, k_len, ldy, threads)) return 0;
    if (bf16_dot && batch_invariant) return -1; /* float32 activations would give other bits than the row alone */
#endif
#ifdef PANEL_FLOAT /* float32 weights, many rows: x in panels (xpanel.h) */
    if (!batch_invariant && X_PANELS && m_len >= PANEL_MIN_ROWS &&
        !panel_linear((const uint32_t *)x, k_len, w, scale, bias, y, m_len, n_len, k_len, ldy, threads, 0))
        return 0;
#endif
    if (batch_invariant && m_len >= INVARIANT_MIN_ROWS && k_len > 0 &&
        !NAME(invariant_linear)(x, w, scale, bias, y, m_len, n_len, k_len, ldy, threads))
        return 0;
#ifdef SPLIT
    const float *xs = m_len == 1 && !batch_invariant ? permute_x(x, k_len, SPLIT) : NULL;
#else
    const float *xs = NULL;
#endif
#pragma omp parallel num_threads(threads)
    {
        int64_t parts = omp_get_num_threads(), share = (n_len + parts - 1) / parts;
        share += (6 - share % 6) % 6;
        int64_t start = omp_get_thread_num() * share, end = start + share < n_len ? start + share : n_len;
        if (m_len <= X_ROWS && start < end) /* one tile of x reads each row once: the whole share, in long streams */
            NAME(linear_rows)(x, xs, w, scale, bias, y, m_len, ldy, k_len, start, end, NULL, 0);
        for (int64_t n0 = start; m_len > X_ROWS && n0 < end; n0 += block) {
            /* the next block streams in from memory while this one's tiles of x compute from L2 */
            int64_t n1 = n0 + block < end ? n0 + block : end, n2 = n1 + block < end ? n1 + block : end;
            NAME(linear_rows)(x, xs, w, scale, bias, y, m_len, ldy, k_len, n0, n1, (const char *)(w + n1 * k_len),
                              PREFETCH_NEXT ? (int64_t)((n2 - n1) * k_len * sizeof(WEIGHT) / 64) : 0);
        }
    }
    return 0;
}

#ifdef NARROW /* float32 weights need no widening: Paddle's own ops read them */
/* out[0, k_len) = row as float32, times s. */
static void NAME(widen_row)(const WEIGHT *row, float s, float *out, int64_t k_len) {
    int64_t k_full = k_len - k_len % LANES;
    for (int64_t k = 0; k < k_full; k += LANES) *(vec *)(out + k) = NAME(load_w)(row + k) * s;
    if (k_full < k_len) {
        vec tail = NAME(load_w_tail)(row + k_full, k_len - k_full) * s;
        memcpy(out + k_full, &tail, (size_t)(k_len - k_full) * sizeof(float));
    }
}

/* out[n, :] = w[n, :] as float32 (times scale[n] when scale is not NULL): a weight widened for
 * MKL's GEMM on many rows (prefill), one layer at a time. Paddle's CPU casts ran at ~50M elements/s. */
void NAME(fdlp_widen)(const WEIGHT *w, const float *scale, float *out, int64_t n_len, int64_t k_len, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_len; n++) NAME(widen_row)(w + n * k_len, scale ? scale[n] : 1.f, out + n * k_len, k_len);
}

/* out[r, :] = w[ids[r], :] as float32 (times scale[ids[r]] when scale is not NULL): an embedding
 * lookup, widening only the rows it reads, in one call where Paddle's took four ops (0.2 ms of a
 * batch-1 decode step). An id outside [0, n_len) gets zeros; returns how many there were. */
int64_t NAME(fdlp_embed)(const int64_t *ids, const WEIGHT *w, const float *scale, float *out, int64_t rows,
                         int64_t n_len, int64_t k_len) {
    int64_t outside = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t id = ids[r];
        if (id < 0 || id >= n_len) {
            memset(out + r * k_len, 0, (size_t)k_len * sizeof(float));
            outside++;
        } else {
            NAME(widen_row)(w + id * k_len, scale ? scale[id] : 1.f, out + r * k_len, k_len);
        }
    }
    return outside;
}
#endif

#ifdef QUANTIZE
/* q[n, :] = round(w[n, :] / scale[n]) with scale[n] = max |w[n, :]| / 127 (1 for an all-zero row),
 * rounding half away from zero: `loader.quantize_rows`' arithmetic, at load, straight from the
 * checkpoint's format (Paddle's ops took minutes and float32 temporaries for a 7B model). */
void NAME(fdlp_quantize)(const WEIGHT *w, int8_t *q, float *scale, int64_t n_len, int64_t k_len, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_len; n++) {
        const WEIGHT *row = w + n * k_len;
        float top = 0.f;
        for (int64_t k = 0; k < k_len; k += LANES) {
            vec v = k + LANES <= k_len ? NAME(load_w)(row + k) : NAME(load_w_tail)(row + k, k_len - k);
            for (int i = 0; i < LANES; i++) top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
        }
        float s = top > 0.f ? top / 127.f : 1.f;
        scale[n] = s;
        for (int64_t k = 0; k < k_len; k++) {
            float x = NAME(widen_one)(row[k]) / s;
            float t = (float)(int32_t)x, d = x - t;
            t += d >= 0.5f ? 1.f : d <= -0.5f ? -1.f : 0.f;
            q[n * k_len + k] = (int8_t)(t > 127.f ? 127.f : t < -127.f ? -127.f : t);
        }
    }
}
#endif

#undef NAME
#undef CONCAT
#undef CONCAT_
#undef WEIGHT
#undef FORMAT
#undef QUANTIZE
#undef NARROW
#undef SPLIT
#undef GEMV_AHEAD
#undef DOT_LINEAR
#undef PANEL_FLOAT
