/* The batch-invariant product for many rows of x (`--deterministic`, docs/deterministic.md):
 * `rows_times`' summation order (linear.h) computed as a packed GEMM, so a prefill runs at GEMM
 * speed and every row still comes out bit for bit as it would alone.
 *
 * `rows_times` sums y[m, n] in LANES partial sums, lane l taking k = l, l + LANES, ... in order
 * (a K not a multiple of LANES ends with one more step whose missing terms are 0 * 0), then adds
 * the lanes in a halving tree. Each lane is a sequence of FMAs on its own, so it is a matrix product
 * of its own over the k of that lane: x and the weight are packed lane-major (x in tiles of
 * INVARIANT_ROWS rows, a weight panel of 2 * LANES rows at a time, widened to float32 once), a
 * register tile of INVARIANT_ROWS x 2 * LANES outputs runs the LANES lanes' FMA chains one after
 * another from the packed panels (two vector loads and INVARIANT_ROWS broadcasts per
 * 2 * INVARIANT_ROWS FMAs, the loads a GEMM's kernel makes), and the tree adds them in the same
 * order. 1024 rows x 9728 x 896 on 2 AVX2 threads: float16 weights 53 GMAC/s, float32 64, against
 * `rows_times`' 42-46 and MKL's float32 GEMM 61 (docs/benchmarks.md). Fewer rows keep `rows_times`,
 * which reads each weight once without packing: the same sums. Packing the lanes' slices so a slice
 * of the panel stays in L1 across tiles (as a BLIS kernel blocks) was measured slower here. */

#if LANES == 16
#define INVARIANT_ROWS 12 /* 12 x 2 accumulators + 2 weight vectors + x: 27 of 32 registers */
#else
#define INVARIANT_ROWS 6 /* 6 x 2 accumulators + 2 weight vectors + x: 15 of 16 registers */
#endif
#define INVARIANT_COLS (2 * LANES)
#define INVARIANT_MIN_ROWS 64 /* the two ran level at 64 rows of the bench model's q/k/v (AVX2) */

#if LANES == 16
#define LANE_MASK(F, w) {F(0, w), F(1, w), F(2, w), F(3, w), F(4, w), F(5, w), F(6, w), F(7, w), \
                         F(8, w), F(9, w), F(10, w), F(11, w), F(12, w), F(13, w), F(14, w), F(15, w)}
#elif LANES == 8
#define LANE_MASK(F, w) {F(0, w), F(1, w), F(2, w), F(3, w), F(4, w), F(5, w), F(6, w), F(7, w)}
#else
#define LANE_MASK(F, w) {F(0, w), F(1, w), F(2, w), F(3, w)}
#endif
#define FROM_LOW(j, w) (((j) & (w)) ? LANES + (j) - (w) : (j))
#define FROM_HIGH(j, w) (((j) & (w)) ? LANES + (j) : (j) + (w))
#define SWAP_BLOCKS(W)                                                                      \
    if (w == W) {                                                                           \
        r[i] = __builtin_shuffle(a, b, (ivec)LANE_MASK(FROM_LOW, W));                       \
        r[i + w] = __builtin_shuffle(a, b, (ivec)LANE_MASK(FROM_HIGH, W));                  \
    }

/* r[i][j] <- r[j][i] for LANES vectors of LANES floats, in registers (`fdlp_transpose` in kernels.c
 * transposes a matrix in memory): at each width w the off-diagonal w x w
 * blocks of every 2w x 2w block swap places (log2(LANES) rounds of two-vector shuffles). */
static inline __attribute__((always_inline)) void transpose_lanes(vec r[LANES]) {
#pragma GCC unroll 4
    for (int w = 1; w < LANES; w *= 2)
#pragma GCC unroll 16
        for (int i = 0; i < LANES; i++)
            if (!(i & w)) {
                vec a = r[i], b = r[i + w];
                SWAP_BLOCKS(1) SWAP_BLOCKS(2)
#if LANES > 4
                SWAP_BLOCKS(4)
#endif
#if LANES > 8
                SWAP_BLOCKS(8)
#endif
            }
}

/* Steps per lane: every lane runs ceil(k_len / LANES) FMAs, the short ones on zeros (rows_times' tail). */
static inline int64_t lane_steps(int64_t k_len) { return (k_len + LANES - 1) / LANES; }

/* x's rows [m0, m0 + INVARIANT_ROWS) lane-major: out[l][j][m] = x[m0 + m, j * LANES + l], zero past
 * m_len and k_len. */
static void pack_x_tile(const float *x, int64_t m0, int64_t m_len, int64_t k_len, float *out) {
    int64_t steps = lane_steps(k_len);
    for (int m = 0; m < INVARIANT_ROWS; m++) {
        const float *row = m0 + m < m_len ? x + (m0 + m) * k_len : NULL;
        for (int64_t j = 0; j < steps; j++) {
            int64_t k = j * LANES, n = row ? (k_len - k < LANES ? k_len - k : LANES) : 0;
            vec v = n == LANES ? load(row + k) : n > 0 ? load_tail(row + k, n) : (vec){0};
            for (int l = 0; l < LANES; l++) out[(l * steps + j) * INVARIANT_ROWS + m] = v[l];
        }
    }
}

/* Lane l's chains for one tile of x against one panel, each a sequence of FMAs over the lane's
 * steps in order, into part (the tile's outputs for that lane). */
static inline __attribute__((always_inline)) void lane_chains(const float *xl, const float *wl, int64_t steps,
                                                              vec part[INVARIANT_ROWS][2]) {
    vec a[INVARIANT_ROWS][2];
    for (int m = 0; m < INVARIANT_ROWS; m++) a[m][0] = a[m][1] = (vec){0};
    for (int64_t j = 0; j < steps; j++) {
        vec w0 = load(wl + j * INVARIANT_COLS), w1 = load(wl + j * INVARIANT_COLS + LANES);
        for (int m = 0; m < INVARIANT_ROWS; m++) {
            vec xv = splat(xl[j * INVARIANT_ROWS + m]);
            a[m][0] += w0 * xv;
            a[m][1] += w1 * xv;
        }
    }
    for (int m = 0; m < INVARIANT_ROWS; m++) part[m][0] = a[m][0], part[m][1] = a[m][1];
}

/* y[m, n0 + c] from a tile's lanes (part[l]): `lane_sum`'s tree, times scale[c] when there is one. */
static void lanes_to_y(vec part[LANES][INVARIANT_ROWS][2], const float *scale, float *y, int64_t ldy, int rows, int cols) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++)
            for (int m = 0; m < rows; m++) part[l][m][0] += part[l + width][m][0], part[l][m][1] += part[l + width][m][1];
    for (int m = 0; m < rows; m++) {
        float out[INVARIANT_COLS];
        memcpy(out, part[0][m], sizeof out);
        for (int c = 0; c < cols; c++) y[m * ldy + c] = scale ? out[c] * scale[c] : out[c];
    }
}

/* Rows [0, m_len) of packed x (`pack_x_rows`) against one packed weight panel (output columns
 * [n0, n0 + cols) of y's rows): both read in the order they were packed. */
static void invariant_panel(const float *xpacked, const float *wp, int64_t m_len, int64_t k_len, const float *scale,
                            float *y, int64_t ldy, int64_t n0, int cols) {
    int64_t steps = lane_steps(k_len), tile_floats = LANES * steps * INVARIANT_ROWS;
    for (int64_t m0 = 0; m0 < m_len; m0 += INVARIANT_ROWS) {
        const float *xp = xpacked + (m0 / INVARIANT_ROWS) * tile_floats;
        vec part[LANES][INVARIANT_ROWS][2];
        for (int l = 0; l < LANES; l++)
            lane_chains(xp + l * steps * INVARIANT_ROWS, wp + l * steps * INVARIANT_COLS, steps, part[l]);
        lanes_to_y(part, scale ? scale + n0 : NULL, y + m0 * ldy + n0, ldy,
                   m_len - m0 < INVARIANT_ROWS ? (int)(m_len - m0) : INVARIANT_ROWS, cols);
    }
}

/* Packed weight panels a thread holds at once (about INVARIANT_PANEL_BYTES of them), and rows of x
 * it packs and takes against each in turn (about INVARIANT_X_BYTES, a multiple of INVARIANT_ROWS):
 * x is read once per group of panels, not once per panel, a slice of it stays in cache while the
 * group's panels pass over it, and a thread holds ~6 MB whatever the size of x. 2048 rows, float16
 * weights, 2 AVX2 threads, against one panel at a time over all of x: 2048 x 896 x 4864 (x packed:
 * 40 MB) 39 -> 57 GMAC/s, 2048 x 9728 x 896 48 -> 51; groups of 1 MB re-packed x too often (40-44). */
#define INVARIANT_PANEL_BYTES (4 << 20)
#define INVARIANT_X_BYTES (2 << 20)
static inline int64_t panels_at_once(int64_t k_len) {
    int64_t bytes = LANES * lane_steps(k_len) * INVARIANT_COLS * (int64_t)sizeof(float);
    return INVARIANT_PANEL_BYTES / bytes > 1 ? INVARIANT_PANEL_BYTES / bytes : 1;
}
static inline int64_t x_rows_at_once(int64_t k_len) {
    int64_t rows = INVARIANT_X_BYTES / (LANES * lane_steps(k_len) * (int64_t)sizeof(float));
    return rows > INVARIANT_ROWS ? rows - rows % INVARIANT_ROWS : INVARIANT_ROWS;
}

/* x's rows [m0, m1) packed for `invariant_panel`, tile after tile. */
static void pack_x_rows(const float *x, int64_t m0, int64_t m1, int64_t k_len, float *out) {
    int64_t tile_floats = LANES * lane_steps(k_len) * INVARIANT_ROWS;
    for (int64_t t = m0; t < m1; t += INVARIANT_ROWS) pack_x_tile(x, t, m1, k_len, out + ((t - m0) / INVARIANT_ROWS) * tile_floats);
}
