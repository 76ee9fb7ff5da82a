/* GGML block formats (GGUF files, `--quantization wint4`): dequantization and linear layers that
 * multiply the blocks as stored. Included by kernels.c once; `block_linear.h` is included once per
 * format.
 *
 * A weight row of K elements is K / BLOCK blocks of BYTES bytes, in the file's own layout. The
 * linear kernels never widen a weight to float: the activations are quantized to int16 per 32
 * (`quantize_x`: a float scale and the scaled sum of each group) and each 32-element group of a
 * block is multiplied as integers, then scaled:
 *
 *   signed formats (Q4_0, Q5_0, Q8_0, Q6_K, W4G128): w = d * q, q signed (Q6_K: d * sc[i / 16] * q)
 *       group += d * dx * sum(q * xq)
 *   formats with a minimum (Q4_1, Q5_1, Q4_K, Q5_K): w = d * q + m, q unsigned
 *       group += d * dx * sum(q * xq) + m * dx * sum(xq)
 *
 * so a product is exactly the dequantized weight times the dequantized activation, up to float32
 * rounding of the group sums. With AVX2 a group is two `vpmaddwd` (int16 pairs to int32): int16
 * rather than llama.cpp's int8 activations, for the same instruction count (int8 needs
 * `vpsign` + `vpmaddubsw` + `vpmaddwd` for signed weights) and 256 times finer steps: LLM
 * activations carry outliers a hundred times their neighbours, and with int8 per 32 those
 * neighbours kept a few bits (SmolLM2 Q4_1: mean logit error 0.33 against the float product with
 * int8, 0.003 with int16). The AVX-512 build runs the same 256-bit code (with 32 vector
 * registers): this project had no AVX-512 machine to check a 512-bit or VNNI variant on. The
 * portable build runs the same integer arithmetic in plain C, which the compiler vectorizes for the
 * target: every build gives the same int32 group sums.
 */

#define FMT_Q4_0 102 /* 100 + the GGML type id */
#define FMT_Q4_1 103
#define FMT_Q5_0 106
#define FMT_Q5_1 107
#define FMT_Q8_0 108
#define FMT_Q4_K 112
#define FMT_Q5_K 113
#define FMT_Q6_K 114
#define FMT_W4G128 200 /* wint4 with a group of 128: a float16 scale, then Q4_0's nibbles for each 32 */

static inline float f16_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q4_K / Q5_K's 6-bit scale and minimum of group j (0..7) from the block's 12 packed bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- Dequantization, exactly as gguf.quants.dequantize computes it (float32 products, no FMA) ---- */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* out[0, BLOCK) = the values of one block of `format`. */
static void dequantize_block(int format, const uint8_t *b, float *out) {
    switch (format) {
        case FMT_Q4_0: {
            float d = f16_at(b);
            for (int i = 0; i < 16; i++) {
                out[i] = d * (float)((b[2 + i] & 0xF) - 8);
                out[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
            }
            break;
        }
        case FMT_Q4_1: {
            float d = f16_at(b), m = f16_at(b + 2);
            for (int i = 0; i < 16; i++) {
                out[i] = d * (float)(b[4 + i] & 0xF) + m;
                out[i + 16] = d * (float)(b[4 + i] >> 4) + m;
            }
            break;
        }
        case FMT_Q5_0: {
            float d = f16_at(b);
            uint32_t qh = u32_at(b + 2);
            for (int i = 0; i < 16; i++) {
                out[i] = d * (float)((int)((b[6 + i] & 0xF) | (qh >> i & 1) << 4) - 16);
                out[i + 16] = d * (float)((int)((b[6 + i] >> 4) | (qh >> (i + 16) & 1) << 4) - 16);
            }
            break;
        }
        case FMT_Q5_1: {
            float d = f16_at(b), m = f16_at(b + 2);
            uint32_t qh = u32_at(b + 4);
            for (int i = 0; i < 16; i++) {
                out[i] = d * (float)((b[8 + i] & 0xF) | ((qh >> i & 1) << 4)) + m;
                out[i + 16] = d * (float)((b[8 + i] >> 4) | ((qh >> (i + 16) & 1) << 4)) + m;
            }
            break;
        }
        case FMT_Q8_0: {
            float d = f16_at(b);
            for (int i = 0; i < 32; i++) out[i] = (float)(int8_t)b[2 + i] * d;
            break;
        }
        case FMT_Q4_K:
        case FMT_Q5_K: {
            int five = format == FMT_Q5_K;
            float d = f16_at(b), dmin = f16_at(b + 2);
            const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                k_scale_min(scales, j, &sc, &m);
                float dl = d * (float)sc, ml = dmin * (float)m;
                for (int i = 0; i < 32; i++) {
                    int q = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 0xF;
                    if (five) q |= ((qh[i] >> j) & 1) << 4;
                    out[32 * j + i] = dl * (float)q - ml;
                }
            }
            break;
        }
        case FMT_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *scales = (const int8_t *)(b + 192);
            float d = f16_at(b + 208);
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 32; i++) {
                    int lo = (ql[64 * (j / 4) + 32 * (j % 2) + i] >> (4 * ((j % 4) / 2))) & 0xF;
                    int hi = (qh[32 * (j / 4) + i] >> (2 * (j % 4))) & 3;
                    float dl = d * (float)scales[2 * j + i / 16];
                    out[32 * j + i] = dl * (float)((lo | hi << 4) - 32);
                }
            break;
        }
        default: { /* FMT_W4G128 */
            float d = f16_at(b);
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 16; i++) {
                    out[32 * j + i] = d * (float)((b[2 + 16 * j + i] & 0xF) - 8);
                    out[32 * j + i + 16] = d * (float)((b[2 + 16 * j + i] >> 4) - 8);
                }
        }
    }
}
/* One block of Q4_0 (`elems` 32) or W4G128 (128) from float32 weights, as gguf.quants.quantize
 * writes Q4_0: d = the weight of largest magnitude / -8, q = trunc(w / d + 8.5) clipped to 15. */
static void quantize_4bit(const float *w, int elems, uint8_t *out) {
    float top = 0.f, peak = 0.f;
    for (int i = 0; i < elems; i++)
        if (fabsf(w[i]) > top) top = fabsf(w[i]), peak = w[i];
    float d = peak / -8.f, inverse = d != 0.f ? 1.f / d : 0.f;
    _Float16 h = (_Float16)d;
    memcpy(out, &h, 2);
    for (int j = 0; j < elems / 32; j++)
        for (int i = 0; i < 16; i++) {
            float lo = truncf(w[32 * j + i] * inverse + 8.5f), hi = truncf(w[32 * j + i + 16] * inverse + 8.5f);
            out[2 + 16 * j + i] = (uint8_t)(lo > 15.f ? 15 : lo) | (uint8_t)(hi > 15.f ? 15 : hi) << 4;
        }
}

/* One Q8_0 block, as gguf.quants.quantize: d = max |w| / 127, q = w / d rounded half away from zero. */
static void quantize_8bit(const float *w, uint8_t *out) {
    float top = 0.f;
    for (int i = 0; i < 32; i++) top = fabsf(w[i]) > top ? fabsf(w[i]) : top;
    float d = top / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
    _Float16 h = (_Float16)d;
    memcpy(out, &h, 2);
    for (int i = 0; i < 32; i++) out[2 + i] = (uint8_t)(int8_t)roundf(w[i] * inverse);
}
#pragma GCC pop_options

static int block_elems(int format) {
    switch (format) {
        case FMT_Q4_K: case FMT_Q5_K: case FMT_Q6_K: return 256;
        case FMT_W4G128: return 128;
        default: return 32;
    }
}

static int block_bytes(int format) {
    switch (format) {
        case FMT_Q4_0: return 18;
        case FMT_Q4_1: return 20;
        case FMT_Q5_0: return 22;
        case FMT_Q5_1: return 24;
        case FMT_Q8_0: return 34;
        case FMT_Q4_K: return 144;
        case FMT_Q5_K: return 176;
        case FMT_Q6_K: return 210;
        case FMT_W4G128: return 66;
        default: return 0;
    }
}

/* out[n, :] = row n of w ([n_len rows of k_len / BLOCK blocks]) as float32. */
void fdlp_dequantize(int format, const uint8_t *w, float *out, int64_t n_len, int64_t k_len, int threads) {
    int64_t elems = block_elems(format), bytes = block_bytes(format), per_row = k_len / elems;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_len; n++)
        for (int64_t b = 0; b < per_row; b++)
            dequantize_block(format, w + (n * per_row + b) * bytes, out + n * k_len + b * elems);
}

/* out = w [n_len, k_len] in Q4_0, Q8_0 or W4G128 blocks (`--quantization wint4` at load); 0, or -1
 * for another format. */
int fdlp_quantize_blocks(int format, const float *w, uint8_t *out, int64_t n_len, int64_t k_len, int threads) {
    if (format != FMT_Q4_0 && format != FMT_Q8_0 && format != FMT_W4G128) return -1;
    int64_t elems = block_elems(format), bytes = block_bytes(format), blocks = n_len * (k_len / elems);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        if (format == FMT_Q8_0) quantize_8bit(w + b * elems, out + b * bytes);
        else quantize_4bit(w + b * elems, (int)elems, out + b * bytes);
    }
    return 0;
}

/* out[r, :] = row ids[r] of w as float32 (an embedding lookup); an id outside [0, n_len) gets
 * zeros. Returns how many ids were outside. */
int64_t fdlp_embed_blocks(int format, const int64_t *ids, const uint8_t *w, float *out, int64_t rows, int64_t n_len,
                          int64_t k_len) {
    int64_t elems = block_elems(format), bytes = block_bytes(format), per_row = k_len / elems, outside = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (ids[r] < 0 || ids[r] >= n_len) {
            memset(out + r * k_len, 0, (size_t)k_len * sizeof(float));
            outside++;
            continue;
        }
        for (int64_t b = 0; b < per_row; b++)
            dequantize_block(format, w + (ids[r] * per_row + b) * bytes, out + r * k_len + b * elems);
    }
    return outside;
}

/* ---- Activations as int16 per 32 ---- */

/* x rows quantized for the block kernels: row m's 32-element group g has int16 values q[m * k + 32 g ..]
 * in [-32767, 32767], scale d[m * groups + g] (x ~= d * q) and s[m * groups + g] = d * sum(q). */
typedef struct {
    const int16_t *q;
    const float *d, *s;
    int64_t k, groups;
} xquant_t;

/* Rows [m0, m1) of x [*, k_len] into `xq`'s buffers (k_len a multiple of 32). */
static void quantize_x(const float *x, int16_t *q, float *d, float *s, int64_t m0, int64_t m1, int64_t k_len) {
    int64_t groups = k_len / 32;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t g = 0; g < groups; g++) {
            const float *v = x + m * k_len + 32 * g;
            int16_t *out = q + m * k_len + 32 * g;
            float top = 0.f;
            for (int i = 0; i < 32; i++) top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
            float scale = top / 32767.f, inv = top > 0.f ? 32767.f / top : 0.f;
            int sum = 0;
            for (int i = 0; i < 32; i++) {
                int value = (int)nearbyintf(v[i] * inv);
                value = value > 32767 ? 32767 : value < -32767 ? -32767 : value;
                out[i] = (int16_t)value;
                sum += value;
            }
            d[m * groups + g] = scale;
            s[m * groups + g] = scale * (float)sum;
        }
}

/* ---- One 32-element group as integers: the per-format unpacking and the integer dot product ---- */

/* The float factors of a block's 16-element halves of groups: d[2j] and d[2j + 1] multiply the
 * integer dot products of group j's two halves (equal but for Q6_K's sub-scales), m[j] the group's
 * x sum (formats with a minimum). Read once per block and weight row. */
typedef struct {
    float d[16], m[8];
} head_t;

static inline int has_minimum(int format) {
    return format == FMT_Q4_1 || format == FMT_Q5_1 || format == FMT_Q4_K || format == FMT_Q5_K;
}

/* Q4_K / Q5_K's eight 6-bit scales (bytes 0-7 of `out`) and minimums (8-15) from the block's 12
 * packed bytes, four at a time in 32-bit words: `k_scale_min` for every group, in a dozen
 * operations instead of ~150 (it was most of a Q4_K GEMV's time). */
static inline void k_scales_mins(const uint8_t *packed, uint8_t out[16]) {
    uint32_t w[3], v[4];
    memcpy(w, packed, 12);
    v[0] = w[0] & 0x3f3f3f3f;                                                 /* scales 0-3 */
    v[1] = (w[2] & 0x0f0f0f0f) | ((w[0] >> 6) & 0x03030303) << 4;              /* scales 4-7 */
    v[2] = w[1] & 0x3f3f3f3f;                                                 /* minimums 0-3 */
    v[3] = ((w[2] >> 4) & 0x0f0f0f0f) | ((w[1] >> 6) & 0x03030303) << 4;       /* minimums 4-7 */
    memcpy(out, v, 16);
}

static inline __attribute__((always_inline)) void unpack_head(int format, const uint8_t *b, head_t *h) {
    switch (format) {
        case FMT_Q4_K: case FMT_Q5_K: {
            float d = f16_at(b), dmin = f16_at(b + 2);
            uint8_t sm[16];
            k_scales_mins(b + 4, sm);
#if defined(__AVX2__) /* GCC converted the bytes one by one: 32 instructions a block */
            __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm)));
            __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8))));
            sc = _mm256_mul_ps(sc, _mm256_set1_ps(d));
            _mm256_storeu_ps(h->d, _mm256_permutevar8x32_ps(sc, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
            _mm256_storeu_ps(h->d + 8, _mm256_permutevar8x32_ps(sc, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)));
            _mm256_storeu_ps(h->m, _mm256_mul_ps(mn, _mm256_set1_ps(-dmin)));
#else
            for (int j = 0; j < 8; j++)
                h->d[2 * j] = h->d[2 * j + 1] = d * (float)sm[j], h->m[j] = -(dmin * (float)sm[8 + j]);
#endif
            break;
        }
        case FMT_Q6_K: { /* a factor per 16: the block's d times each sub-scale */
            const int8_t *scales = (const int8_t *)(b + 192);
            float d = f16_at(b + 208);
#if defined(__AVX2__)
            for (int half = 0; half < 2; half++) {
                __m128i bytes = _mm_loadl_epi64((const __m128i *)(scales + 8 * half));
                _mm256_storeu_ps(h->d + 8 * half,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_set1_ps(d)));
            }
#else
            for (int i = 0; i < 16; i++) h->d[i] = d * (float)scales[i];
#endif
            break;
        }
        default: { /* one factor (and minimum) for the block's 1 or 4 groups */
            float d = f16_at(b), m = has_minimum(format) ? f16_at(b + 2) : 0.f;
            for (int j = 0; j < (format == FMT_W4G128 ? 4 : 1); j++) h->d[2 * j] = h->d[2 * j + 1] = d, h->m[j] = m;
        }
    }
}

/* One group's 32 quants as integers, offsets taken off. */
#if defined(__AVX2__)
typedef struct {
    __m256i lo, hi; /* elements 0-15 and 16-31 as int16 */
} group_t;

/* Unpacking straight to int16 lanes: a byte-wide unpack and a widening afterwards cost two
 * lane-crossing shuffles a group, and ran the Q4_0 GEMV at 2.75 instead of 1.78 ns a group. */
static inline __m256i u16_of(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i i16_of(const uint8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi16(15)); }
static inline __m256i high4(__m256i v) { return _mm256_srli_epi16(v, 4); }
static inline __m256i minus(__m256i v, int k) { return _mm256_sub_epi16(v, _mm256_set1_epi16((int16_t)k)); }

static inline __m256i bit4_of_16(uint32_t bits) { /* lane i = 16 if bit i of `bits` is set, else 0 */
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          (int16_t)32768);
    __m256i hit = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((int16_t)bits), bit), bit);
    return _mm256_and_si256(hit, _mm256_set1_epi16(16));
}

/* bits (of each byte of p[0, 16), as int16 lanes) >> shift, masked, moved to bit 4 and up. */
static inline __m256i high_bits(const uint8_t *p, int shift, int mask) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(u16_of(p), shift), _mm256_set1_epi16((int16_t)mask)), 4);
}

static inline __attribute__((always_inline)) void unpack_group(int format, const uint8_t *b, int j, group_t *g) {
    switch (format) {
        case FMT_Q4_0: case FMT_Q4_1: case FMT_W4G128: {
            __m256i raw = u16_of(format == FMT_W4G128 ? b + 2 + 16 * j : b + 2 + 2 * (format == FMT_Q4_1));
            g->lo = low4(raw), g->hi = high4(raw);
            if (format != FMT_Q4_1) g->lo = minus(g->lo, 8), g->hi = minus(g->hi, 8);
            break;
        }
        case FMT_Q5_0: case FMT_Q5_1: {
            int minimum = format == FMT_Q5_1;
            uint32_t qh = u32_at(b + 2 + 2 * minimum);
            __m256i raw = u16_of(b + 6 + 2 * minimum);
            g->lo = _mm256_or_si256(low4(raw), bit4_of_16(qh & 0xFFFF));
            g->hi = _mm256_or_si256(high4(raw), bit4_of_16(qh >> 16));
            if (!minimum) g->lo = minus(g->lo, 16), g->hi = minus(g->hi, 16);
            break;
        }
        case FMT_Q8_0:
            g->lo = i16_of(b + 2), g->hi = i16_of(b + 18);
            break;
        case FMT_Q4_K: case FMT_Q5_K: {
            const uint8_t *qs = b + (format == FMT_Q5_K ? 48 : 16) + 32 * (j / 2);
            g->lo = j % 2 ? high4(u16_of(qs)) : low4(u16_of(qs));
            g->hi = j % 2 ? high4(u16_of(qs + 16)) : low4(u16_of(qs + 16));
            if (format == FMT_Q5_K) {
                g->lo = _mm256_or_si256(g->lo, high_bits(b + 16, j, 1));
                g->hi = _mm256_or_si256(g->hi, high_bits(b + 32, j, 1));
            }
            break;
        }
        default: { /* FMT_Q6_K (its sub-scales are the head's per-16 factors) */
            const uint8_t *ql = b + 64 * (j / 4) + 32 * (j % 2), *qh = b + 128 + 32 * (j / 4);
            int shift = 4 * ((j % 4) / 2);
            __m256i lo = _mm256_srli_epi16(u16_of(ql), shift), hi = _mm256_srli_epi16(u16_of(ql + 16), shift);
            g->lo = minus(_mm256_or_si256(low4(lo), high_bits(qh, 2 * (j % 4), 3)), 32);
            g->hi = minus(_mm256_or_si256(low4(hi), high_bits(qh + 16, 2 * (j % 4), 3)), 32);
        }
    }
}
#else
typedef struct {
    int8_t q[32];
} group_t;

static inline void unpack_group(int format, const uint8_t *b, int j, group_t *g) {
    switch (format) {
        case FMT_Q4_0: case FMT_Q4_1: case FMT_Q5_0: case FMT_Q5_1: case FMT_W4G128: {
            int minimum = format == FMT_Q4_1 || format == FMT_Q5_1, five = format == FMT_Q5_0 || format == FMT_Q5_1;
            const uint8_t *qs = format == FMT_W4G128 ? b + 2 + 16 * j : b + 2 + 2 * minimum + 4 * five;
            uint32_t qh = five ? u32_at(b + 2 + 2 * minimum) : 0;
            int offset = minimum ? 0 : five ? 16 : 8;
            for (int i = 0; i < 16; i++) {
                g->q[i] = (int8_t)((int)((qs[i] & 0xF) | (qh >> i & 1) << 4) - offset);
                g->q[i + 16] = (int8_t)((int)((qs[i] >> 4) | (qh >> (i + 16) & 1) << 4) - offset);
            }
            break;
        }
        case FMT_Q8_0:
            memcpy(g->q, b + 2, 32);
            break;
        case FMT_Q4_K:
        case FMT_Q5_K: {
            int five = format == FMT_Q5_K;
            const uint8_t *qs = b + (five ? 48 : 16) + 32 * (j / 2);
            for (int i = 0; i < 32; i++)
                g->q[i] = (int8_t)(((qs[i] >> (4 * (j % 2))) & 0xF) | (five ? ((b[16 + i] >> j) & 1) << 4 : 0));
            break;
        }
        default: { /* FMT_Q6_K */
            for (int i = 0; i < 32; i++) {
                int lo = (b[64 * (j / 4) + 32 * (j % 2) + i] >> (4 * ((j % 4) / 2))) & 0xF;
                int hi = (b[128 + 32 * (j / 4) + i] >> (2 * (j % 4))) & 3;
                g->q[i] = (int8_t)((lo | hi << 4) - 32);
            }
        }
    }
}
#endif

#if defined(__AVX2__)
typedef __m256 gsum_t; /* a group's dot product as 8 partial sums, before the lanes are added */

static inline __m256 gsum_zero(void) { return _mm256_setzero_ps(); }
static inline float gsum_total(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* acc + the group's two halves' dot products with x's 32 int16 (int16 pair products summed in
 * int32: exact), each times its factor: one conversion for both where they share it. */
static inline __attribute__((always_inline)) __m256 group_dot(int format, const group_t *g, const int16_t *x,
                                                             float scale_lo, float scale_hi, __m256 acc) {
    __m256i lo = _mm256_madd_epi16(g->lo, _mm256_loadu_si256((const __m256i *)x));
    __m256i hi = _mm256_madd_epi16(g->hi, _mm256_loadu_si256((const __m256i *)(x + 16)));
    if (format != FMT_Q6_K)
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_set1_ps(scale_lo), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(scale_lo), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(scale_hi), acc);
}
#else
typedef float gsum_t;

static inline float gsum_zero(void) { return 0.f; }
static inline float gsum_total(float v) { return v; }

static inline __attribute__((always_inline)) float group_dot(int format, const group_t *g, const int16_t *x,
                                                            float scale_lo, float scale_hi, float acc) {
    int32_t half[2] = {0, 0};
    for (int h = 0; h < 2; h++)
        for (int i = 16 * h; i < 16 * h + 16; i++) half[h] += (int32_t)g->q[i] * (int32_t)x[i];
    if (format != FMT_Q6_K) return acc + scale_lo * (float)(half[0] + half[1]);
    return acc + scale_lo * (float)half[0] + scale_hi * (float)half[1];
}
#endif

/* For a K-format block (eight groups): out[2j + half] = the factor of group j's half for one row of x
 * (the head's factor times x's group scale dx[j]), and *min_sum += the block's minimums times x's
 * group sums sx[j]. */
static inline __attribute__((always_inline)) void block_factors(int format, const head_t *h, const float *dx,
                                                                const float *sx, float out[16], float *min_sum) {
#if defined(__AVX2__)
    __m256 scales = _mm256_loadu_ps(dx);
    __m256 lo = _mm256_permutevar8x32_ps(scales, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    __m256 hi = _mm256_permutevar8x32_ps(scales, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_loadu_ps(h->d), lo));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_loadu_ps(h->d + 8), hi));
    if (has_minimum(format)) *min_sum += gsum_total(_mm256_mul_ps(_mm256_loadu_ps(h->m), _mm256_loadu_ps(sx)));
#else
    for (int i = 0; i < 16; i++) out[i] = h->d[i] * dx[i / 2];
    for (int j = 0; has_minimum(format) && j < 8; j++) *min_sum += h->m[j] * sx[j];
#endif
}

/* x quantized once per call, in the calling thread's buffer: it grows to the largest x seen and is
 * kept (a linear per layer per step must not allocate). NULL if it cannot grow. */
static int16_t *x_buffer(int64_t m_len, int64_t k_len, float **d, float **s) {
    static __thread void *buffer;
    static __thread size_t capacity;
    size_t groups = (size_t)(m_len * (k_len / 32));
    size_t need = (size_t)(m_len * k_len) * sizeof(int16_t) + 2 * groups * sizeof(float) + 64;
    if (need > capacity) {
        void *grown = realloc(buffer, need);
        if (!grown) return NULL;
        buffer = grown, capacity = need;
    }
    *d = (float *)(((uintptr_t)buffer + 15) & ~(uintptr_t)15);
    *s = *d + groups;
    return (int16_t *)(*s + groups);
}
