/* The block formats' product for more than a few rows of x (`fdlp_block_unit_rows`), and for every
 * row count in batch-invariant mode (`--deterministic`, docs/deterministic.md), included by
 * block_linear.h once per format (BFORMAT, BFN).
 *
 * The integer kernel (block_linear.h) keeps eight partial sums per output and adds them at the end,
 * which a GEMM cannot pack: it would need eight registers per output. Here each output is one
 * chain instead. A weight's units (32 weights sharing a scale; 16 for Q6_K)
 * each give an exact int32 dot product D with x's int16 quants (exact in any order), so only these
 * float steps fix the result, and every kernel below takes them in this order:
 *
 *   acc  = fma((float)D_u, ws_u * dx_g, acc)   over the units u in order (g: the unit's group of x)
 *   mins = fma(wm_g, sx_g, mins)              over the groups g in order (formats with a minimum)
 *   y    = (acc + mins) + bias
 *
 * Few rows of x (`unit_rows`) take 8 weight rows at a time and add each of their 8 dot products'
 * lanes as integers, so 8 chains run in one vector; many rows (`unit_gemm`, AVX2 and up) pack 16
 * weight rows' integers pair-interleaved once and run a tile of 4 x 16 outputs whose integer sums
 * form in lanes across outputs (`vpmaddwd` on a broadcast pair of x), as a GEMM's kernel does. */

#if defined(__AVX2__) && !defined(INVARIANT_BLOCKS_SHARED) /* once, not per format */
#define INVARIANT_BLOCKS_SHARED
/* 8 weight rows' factors for a group of theirs, lane r for row r: ws[u] the scale of the group's
 * unit u, wm its minimum. Built in registers: 8 scalar stores read back as one vector would miss
 * the store forwarding. */
typedef struct {
    __m256 ws[2], wm;
} factors_t;

/* r[i][j] <- r[j][i] for 8 vectors of 8 floats, in registers. */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++)
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}

/* The float16 values at at[r] + offset, r = 0..7, in one vector's lanes. */
static inline __m128i f16x8(const uint8_t *const at[8], int offset) {
    uint16_t h[8];
    for (int r = 0; r < 8; r++) memcpy(h + r, at[r] + offset, 2);
    __m128i v = _mm_cvtsi32_si128(h[0]);
    v = _mm_insert_epi16(v, h[1], 1), v = _mm_insert_epi16(v, h[2], 2), v = _mm_insert_epi16(v, h[3], 3);
    v = _mm_insert_epi16(v, h[4], 4), v = _mm_insert_epi16(v, h[5], 5), v = _mm_insert_epi16(v, h[6], 6);
    return _mm_insert_epi16(v, h[7], 7);
}

/* Lane r of the result = the sum of row r's eight int32 lanes, from quad[h] = the pair sums of rows
 * 4h..4h+3 (hadds of hadds; exact: integers, in any order). */
static inline __m256i quad_totals(const __m256i quad[2]) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(quad[0], quad[1], 0x20),
                            _mm256_permute2x128_si256(quad[0], quad[1], 0x31));
}
#endif

#define UNIT (BFORMAT == FMT_Q6_K ? 16 : 32)
#define UNIT_ELEMS (BFORMAT == FMT_Q4_K || BFORMAT == FMT_Q5_K || BFORMAT == FMT_Q6_K ? 256 \
                    : BFORMAT == FMT_W4G128 ? 128 : 32)
#define UNIT_GROUPS (UNIT_ELEMS / 32)

#if defined(__AVX2__)
#define ONE_SCALE (UNIT_GROUPS == 1 || BFORMAT == FMT_W4G128) /* a block's float16 scale (and minimum) first */

/* The 8 weight rows' factors for every group j of their block b: f[j]. The K formats' come from
 * the heads by 8 x 8 transposes, once a block, not lane by lane for each group. */
static inline __attribute__((always_inline)) void BFN(block_factors)(const uint8_t *const at[8], const head_t h[8],
                                                                     factors_t f[UNIT_GROUPS]) {
    if (ONE_SCALE) {
        f[0].ws[0] = f[0].ws[1] = _mm256_cvtph_ps(f16x8(at, 0));
        f[0].wm = has_minimum(BFORMAT) ? _mm256_cvtph_ps(f16x8(at, 2)) : _mm256_setzero_ps();
        for (int j = 1; j < UNIT_GROUPS; j++) f[j] = f[0];
        return;
    }
    __m256 even[8], odd[8], mins[8];
    for (int r = 0; r < 8; r++) { /* row r's d[2j] and d[2j + 1], j = 0..7 */
        __m256 a = _mm256_loadu_ps(h[r].d), b = _mm256_loadu_ps(h[r].d + 8);
        even[r] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
        odd[r] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
        mins[r] = has_minimum(BFORMAT) ? _mm256_loadu_ps(h[r].m) : _mm256_setzero_ps();
    }
    transpose8(even);
    if (UNIT == 16) transpose8(odd);
    if (has_minimum(BFORMAT)) transpose8(mins);
    for (int j = 0; j < UNIT_GROUPS; j++)
        f[j].ws[0] = even[j], f[j].ws[1] = UNIT == 16 ? odd[j] : even[j], f[j].wm = mins[j];
}
#else
#define ONE_SCALE 0
#endif

/* at[r] = block b of the 8 weight rows, and its head where the factors need it. */
static inline __attribute__((always_inline)) void BFN(block_heads)(const uint8_t *const rows[8], int64_t b,
                                                                   const uint8_t *at[8], head_t h[8]) {
    for (int r = 0; r < 8; r++) {
        at[r] = rows[r] + b * block_bytes(BFORMAT);
        for (int line = 0; line * 64 < block_bytes(BFORMAT); line++) /* a K block spans 3 (Q6_K: 4) */
            __builtin_prefetch(at[r] + line * 64 + BLOCK_AHEAD);
        if (!ONE_SCALE) unpack_head(BFORMAT, at[r], &h[r]);
    }
}

#if defined(__AVX2__)
/* Group j of the 8 weight rows (unpacked from at[r], or given in q) against one row of x's group:
 * lane r of *lo = row r's dot product over the group's first unit, *hi over its second (Q6_K).
 * Rows are added in pairs and quads as they come, so a few sums stay live, not 8 (16 for Q6_K's
 * halves, which spilled). */
static inline __attribute__((always_inline)) void BFN(group_totals)(const uint8_t *const at[8], const group_t *q,
                                                                    int j, __m256i xlo, __m256i xhi, __m256i *lo,
                                                                    __m256i *hi) {
    __m256i quad_lo[2], quad_hi[2];
    for (int half = 0; half < 2; half++) {
        __m256i pair_lo[2], pair_hi[2];
        for (int p = 0; p < 2; p++) {
            int r = 4 * half + 2 * p;
            group_t q0, q1;
            if (q) q0 = q[r], q1 = q[r + 1];
            else unpack_group(BFORMAT, at[r], j, &q0), unpack_group(BFORMAT, at[r + 1], j, &q1);
            __m256i l0 = _mm256_madd_epi16(q0.lo, xlo), h0 = _mm256_madd_epi16(q0.hi, xhi);
            __m256i l1 = _mm256_madd_epi16(q1.lo, xlo), h1 = _mm256_madd_epi16(q1.hi, xhi);
            if (UNIT == 32)
                pair_lo[p] = _mm256_hadd_epi32(_mm256_add_epi32(l0, h0), _mm256_add_epi32(l1, h1));
            else
                pair_lo[p] = _mm256_hadd_epi32(l0, l1), pair_hi[p] = _mm256_hadd_epi32(h0, h1);
        }
        quad_lo[half] = _mm256_hadd_epi32(pair_lo[0], pair_lo[1]);
        if (UNIT == 16) quad_hi[half] = _mm256_hadd_epi32(pair_hi[0], pair_hi[1]);
    }
    *lo = quad_totals(quad_lo);
    if (UNIT == 16) *hi = quad_totals(quad_hi);
}

/* The 8 rows' chains' next steps from their unit sums (x's group scale dx, scaled sum sx). */
static inline __attribute__((always_inline)) void BFN(unit_step)(__m256i lo, __m256i hi, const factors_t *f, float dx,
                                                                 float sx, __m256 *acc, __m256 *mins) {
    __m256 d = _mm256_set1_ps(dx);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(f->ws[0], d), *acc);
    if (UNIT == 16) *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(f->ws[1], d), *acc);
    if (has_minimum(BFORMAT)) *mins = _mm256_fmadd_ps(f->wm, _mm256_set1_ps(sx), *mins);
}

/* `unit_tile` for one row of x (a decode step): each group straight from its unpacking, the chains
 * in registers (through memory, their latency was most of the step). out[r] = row r's sum. */
static void BFN(unit_tile1)(const xquant_t *x, const uint8_t *const rows[8], int64_t blocks, int64_t m, float out[8]) {
    __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        head_t h[8];
        const uint8_t *at[8];
        BFN(block_heads)(rows, b, at, h);
        factors_t f[UNIT_GROUPS];
        BFN(block_factors)(at, h, f);
        for (int j = 0; j < UNIT_GROUPS; j++) {
            int64_t g = b * UNIT_GROUPS + j;
            const int16_t *xq = x->q + m * x->k + 32 * g;
            __m256i xlo = _mm256_loadu_si256((const __m256i *)xq), xhi = _mm256_loadu_si256((const __m256i *)(xq + 16));
            __m256i lo, hi = lo = _mm256_setzero_si256();
            BFN(group_totals)(at, NULL, j, xlo, xhi, &lo, &hi);
            BFN(unit_step)(lo, hi, &f[j], x->d[m * x->groups + g], x->s[m * x->groups + g], &acc, &mins);
        }
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc, mins));
}
#endif

/* y for the 8 weight rows n[r] (those of n[r] < n1 written) and x rows [m0, m1) (up to
 * UNIT_X_ROWS), each group of the weight rows unpacked once for those rows. */
#define UNIT_X_ROWS 16
static void BFN(unit_tile)(const xquant_t *x, const uint8_t *w, float *y, int64_t ldy, int64_t k_len,
                           const int64_t n[8], int64_t n1, int64_t m0, int64_t m1) {
    const int64_t bytes = block_bytes(BFORMAT), blocks = k_len / UNIT_ELEMS, row_bytes = blocks * bytes;
    const uint8_t *rows[8];
    for (int r = 0; r < 8; r++) rows[r] = w + (n[r] < n1 ? n[r] : n[0]) * row_bytes;
    float acc[UNIT_X_ROWS][8] __attribute__((aligned(32))), mins[UNIT_X_ROWS][8] __attribute__((aligned(32)));
#if defined(__AVX2__)
    if (m1 - m0 == 1) {
        BFN(unit_tile1)(x, rows, blocks, m0, acc[0]);
        for (int r = 0; r < 8; r++)
            if (n[r] < n1) y[m0 * ldy + n[r]] = acc[0][r];
        return;
    }
#endif
    memset(acc, 0, sizeof acc), memset(mins, 0, sizeof mins);
    for (int64_t b = 0; b < blocks; b++) {
        head_t h[8];
        const uint8_t *at[8];
        BFN(block_heads)(rows, b, at, h);
#if defined(__AVX2__)
        factors_t f[UNIT_GROUPS];
        BFN(block_factors)(at, h, f);
#endif
        for (int j = 0; j < UNIT_GROUPS; j++) {
            int64_t g = b * UNIT_GROUPS + j;
#if defined(__AVX2__)
            group_t q[8];
            for (int r = 0; r < 8; r++) unpack_group(BFORMAT, at[r], j, &q[r]);
            for (int64_t m = m0; m < m1; m++) {
                const int16_t *xq = x->q + m * x->k + 32 * g;
                __m256i xlo = _mm256_loadu_si256((const __m256i *)xq), xhi = _mm256_loadu_si256((const __m256i *)(xq + 16));
                __m256i lo, hi = lo = _mm256_setzero_si256();
                BFN(group_totals)(NULL, q, j, xlo, xhi, &lo, &hi);
                BFN(unit_step)(lo, hi, &f[j], x->d[m * x->groups + g], x->s[m * x->groups + g], (__m256 *)acc[m - m0],
                               (__m256 *)mins[m - m0]);
            }
#else
            float ws[2][8], wm[8];
            for (int r = 0; r < 8; r++) ws[0][r] = h[r].d[2 * j], ws[1][r] = h[r].d[2 * j + 1], wm[r] = h[r].m[j];
            group_t q[8];
            for (int r = 0; r < 8; r++) unpack_group(BFORMAT, at[r], j, &q[r]);
            for (int64_t m = m0; m < m1; m++) {
                const int16_t *xq = x->q + m * x->k + 32 * g;
                float dx = x->d[m * x->groups + g];
                for (int r = 0; r < 8; r++) {
                    for (int u = 0; u < 32 / UNIT; u++) {
                        int32_t dot = 0;
                        for (int i = UNIT * u; i < UNIT * (u + 1); i++) dot += (int32_t)q[r].q[i] * (int32_t)xq[i];
                        acc[m - m0][r] = __builtin_fmaf((float)dot, ws[u][r] * dx, acc[m - m0][r]);
                    }
                    if (has_minimum(BFORMAT))
                        mins[m - m0][r] = __builtin_fmaf(wm[r], x->s[m * x->groups + g], mins[m - m0][r]);
                }
            }
#endif
        }
    }
    for (int64_t m = m0; m < m1; m++)
        for (int r = 0; r < 8; r++)
            if (n[r] < n1) y[m * ldy + n[r]] = acc[m - m0][r] + mins[m - m0][r];
}

/* Weight rows [n0, n1), every row of x: rows i, i + span, ..., i + 7 span together, so each of the
 * 8 is a long stream through the range (as block_linear.h's tiles; 8 neighbouring rows at a time
 * read a float16 LM head 1.5 times slower than the integer GEMV). */
static void BFN(unit_rows)(const xquant_t *x, const uint8_t *w, float *y, int64_t m_len, int64_t ldy, int64_t k_len,
                           int64_t n0, int64_t n1) {
    int64_t span = (n1 - n0 + 7) / 8;
    for (int64_t i = 0; i < span; i++) {
        int64_t n[8];
        for (int r = 0; r < 8; r++) n[r] = n0 + i + r * span;
        for (int64_t m0 = 0; m0 < m_len; m0 += UNIT_X_ROWS)
            BFN(unit_tile)(x, w, y, ldy, k_len, n, n1, m0, m0 + UNIT_X_ROWS < m_len ? m0 + UNIT_X_ROWS : m_len);
    }
}

#if defined(__AVX2__)
enum { BFN(pairs) = UNIT / 2 };

/* Weight rows [n0, n0 + 16) packed for `unit_panel` (rows past n_len repeat row n0, not kept):
 * q[(u * pairs + i) * 32 + 2c + e] = row c's weight 2i + e of unit u as int16, ws[u * 16 + c] its
 * unit's scale, wm[g * 16 + c] its group's minimum. */
static void BFN(pack_units)(const uint8_t *w, int64_t n0, int64_t n_len, int64_t k_len, int16_t *q, float *ws,
                            float *wm) {
    const int64_t bytes = block_bytes(BFORMAT), blocks = k_len / UNIT_ELEMS, row_bytes = blocks * bytes;
    for (int c = 0; c < 16; c++) {
        const uint8_t *row = w + (n0 + c < n_len ? n0 + c : n0) * row_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            head_t h;
            unpack_head(BFORMAT, row + b * bytes, &h);
            for (int j = 0; j < UNIT_GROUPS; j++) {
                int64_t g = b * UNIT_GROUPS + j;
                group_t unpacked;
                int32_t pairs[16];
                unpack_group(BFORMAT, row + b * bytes, j, &unpacked);
                _mm256_storeu_si256((__m256i *)pairs, unpacked.lo);
                _mm256_storeu_si256((__m256i *)(pairs + 8), unpacked.hi);
                for (int i = 0; i < 16; i++) {
                    int64_t u = g * (32 / UNIT) + i / BFN(pairs);
                    memcpy(q + (u * BFN(pairs) + i % BFN(pairs)) * 32 + 2 * c, pairs + i, 4);
                }
                for (int u = 0; u < 32 / UNIT; u++) ws[(g * (32 / UNIT) + u) * 16 + c] = h.d[2 * j + u];
                wm[g * 16 + c] = h.m[j];
            }
        }
    }
}

/* x rows [m0, m0 + 4) packed for `unit_panel` (rows past m1 are zeros): xp[(u * pairs + i) * 4 + m]
 * = row m's pair i of unit u, dx[g * 4 + m] and sx[g * 4 + m] its group's scale and scaled sum. */
static void BFN(pack_x4)(const xquant_t *x, int64_t m0, int64_t m1, int32_t *xp, float *dx, float *sx) {
    int64_t units = x->k / UNIT;
    for (int m = 0; m < 4; m++) {
        int valid = m0 + m < m1;
        const int16_t *row = x->q + (m0 + m) * x->k;
        for (int64_t p = 0; p < units * BFN(pairs); p++) {
            int32_t pair = 0;
            if (valid) memcpy(&pair, row + 2 * p, 4);
            xp[p * 4 + m] = pair;
        }
        for (int64_t g = 0; g < x->groups; g++) {
            dx[g * 4 + m] = valid ? x->d[(m0 + m) * x->groups + g] : 0.f;
            sx[g * 4 + m] = valid ? x->s[(m0 + m) * x->groups + g] : 0.f;
        }
    }
}

/* y[m, n0 + c] for 4 packed rows of x and a packed panel of 16 weight rows: `rows` x `cols` kept. */
static void BFN(unit_panel)(const int32_t *xp, const float *dx, const float *sx, const int16_t *q, const float *ws,
                            const float *wm, int64_t k_len, float *y, int64_t ldy, int rows, int cols) {
    const int64_t units = k_len / UNIT;
    __m256 f[4][2];
    for (int m = 0; m < 4; m++) f[m][0] = f[m][1] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        __m256i a[4][2];
        for (int m = 0; m < 4; m++) a[m][0] = a[m][1] = _mm256_setzero_si256();
        const int16_t *qu = q + u * BFN(pairs) * 32;
        const int32_t *xu = xp + u * BFN(pairs) * 4;
        for (int i = 0; i < BFN(pairs); i++) {
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(qu + 32 * i)), w1 = _mm256_loadu_si256((const __m256i *)(qu + 32 * i + 16));
            for (int m = 0; m < 4; m++) {
                __m256i xb = _mm256_set1_epi32(xu[4 * i + m]);
                a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(w0, xb));
                a[m][1] = _mm256_add_epi32(a[m][1], _mm256_madd_epi16(w1, xb));
            }
        }
        int64_t g = u * UNIT / 32;
        __m256 s0 = _mm256_loadu_ps(ws + 16 * u), s1 = _mm256_loadu_ps(ws + 16 * u + 8);
        for (int m = 0; m < 4; m++) {
            __m256 d = _mm256_set1_ps(dx[4 * g + m]);
            f[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][0]), _mm256_mul_ps(s0, d), f[m][0]);
            f[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][1]), _mm256_mul_ps(s1, d), f[m][1]);
        }
    }
    __m256 mn[4][2];
    for (int m = 0; m < 4; m++) mn[m][0] = mn[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; has_minimum(BFORMAT) && g < k_len / 32; g++)
        for (int m = 0; m < 4; m++) {
            __m256 s = _mm256_set1_ps(sx[4 * g + m]);
            mn[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(wm + 16 * g), s, mn[m][0]);
            mn[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(wm + 16 * g + 8), s, mn[m][1]);
        }
    for (int m = 0; m < rows; m++) {
        float out[16];
        _mm256_storeu_ps(out, _mm256_add_ps(f[m][0], mn[m][0]));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(f[m][1], mn[m][1]));
        memcpy(y + m * ldy, out, (size_t)cols * sizeof(float));
    }
}

/* Every row of x against a thread's panels [p0, p1), x taken UNIT_SLICE_BYTES of packed rows at a
 * time (each thread packs its own) and each panel packed once per slice. 0, or -1 without memory. */
#ifndef UNIT_SLICE_BYTES /* a -D for the tests, to take a small x in several slices */
#define UNIT_SLICE_BYTES (2 << 20)
#endif
static int BFN(unit_gemm)(const xquant_t *x, const uint8_t *w, float *y, int64_t m_len, int64_t n_len, int64_t ldy,
                          int64_t k_len, int64_t p0, int64_t p1) {
    int64_t groups = k_len / 32, q_bytes = 16 * k_len * 2 + 2 * 16 * (groups * (32 / UNIT)) * 4;
    int64_t tile_bytes = 4 * k_len * 2 + 2 * 4 * groups * 4;
    int64_t tiles = UNIT_SLICE_BYTES / tile_bytes < 1 ? 1 : UNIT_SLICE_BYTES / tile_bytes;
    char *buffer = malloc((size_t)(q_bytes + tiles * tile_bytes));
    if (!buffer) return -1;
    int16_t *q = (int16_t *)buffer;
    float *ws = (float *)(q + 16 * k_len), *wm = ws + 16 * groups * (32 / UNIT);
    char *xs = buffer + q_bytes;
    for (int64_t s0 = 0; s0 < m_len; s0 += 4 * tiles) {
        int64_t s1 = s0 + 4 * tiles < m_len ? s0 + 4 * tiles : m_len;
        for (int64_t t = 0; t * 4 < s1 - s0; t++) {
            int32_t *xp = (int32_t *)(xs + t * tile_bytes);
            BFN(pack_x4)(x, s0 + 4 * t, s1, xp, (float *)(xp + 2 * k_len), (float *)(xp + 2 * k_len) + 4 * groups);
        }
        for (int64_t p = p0; p < p1; p++) {
            int64_t n0 = 16 * p;
            BFN(pack_units)(w, n0, n_len, k_len, q, ws, wm);
            for (int64_t t = 0; t * 4 < s1 - s0; t++) {
                const int32_t *xp = (const int32_t *)(xs + t * tile_bytes);
                int64_t m = s0 + 4 * t;
                BFN(unit_panel)(xp, (const float *)(xp + 2 * k_len), (const float *)(xp + 2 * k_len) + 4 * groups, q, ws,
                                wm, k_len, y + m * ldy + n0, ldy, s1 - m < 4 ? (int)(s1 - m) : 4,
                                n_len - n0 < 16 ? (int)(n_len - n0) : 16);
            }
        }
    }
    free(buffer);
    return 0;
}
#endif

/* y[m, n] (row stride ldy) = x[m, :] . w[n, :] + bias[n] in the order above, for the quantized x;
 * each thread an equal share of whole panels of 16 weight rows. */
static void BFN(unit_linear)(const xquant_t *x, const uint8_t *w, const float *bias, float *y, int64_t m_len,
                             int64_t n_len, int64_t k_len, int64_t ldy, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t panels = (n_len + 15) / 16, parts = omp_get_num_threads(), share = (panels + parts - 1) / parts;
        int64_t p0 = omp_get_thread_num() * share, p1 = p0 + share < panels ? p0 + share : panels;
        int64_t n0 = 16 * p0 < n_len ? 16 * p0 : n_len, n1 = 16 * p1 < n_len ? 16 * p1 : n_len;
#if defined(__AVX2__)
        int done = m_len >= UNIT_GEMM_ROWS && p0 < p1 && !BFN(unit_gemm)(x, w, y, m_len, n_len, ldy, k_len, p0, p1);
#else
        int done = 0;
#endif
        if (!done && n0 < n1) BFN(unit_rows)(x, w, y, m_len, ldy, k_len, n0, n1);
        for (int64_t m = 0; bias && m < m_len; m++)
            for (int64_t n = n0; n < n1; n++) y[m * ldy + n] += bias[n];
    }
}

#undef UNIT
#undef UNIT_ELEMS
#undef UNIT_GROUPS
#undef UNIT_X_ROWS
#undef UNIT_SLICE_BYTES
#undef ONE_SCALE
