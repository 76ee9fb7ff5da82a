/* Causal attention over the paged KV cache, and rotary with the cache write (kernels.c includes
 * this after the vector helpers).
 *
 * The cache holds float32, or bfloat16 with `--kv-cache-dtype bfloat16` (`kv_bf16`): half the bytes
 * a decode step reads, and those bytes are what attention over many positions waits on (SmolLM2, 32
 * sequences x 160 positions, 30 layers: 22-30 ms from memory against 8 ms when one layer's cache
 * sits in L3, Zen 4). Keys and values are rounded to bfloat16 as they are written (to nearest, ties
 * to even, as Paddle's cast) and widened as they are read; every product and sum stays float32.
 * Each body is written once for both element types: `ALWAYS_INLINE` with the type a constant, so
 * the compiler emits one copy per type and no test per element. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The bfloat16 nearest to x, ties to even; a NaN stays a (quiet) NaN. */
static inline uint16_t round_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)(bits >> 16 | 0x40);
    return (uint16_t)((bits + 0x7FFFu + (bits >> 16 & 1)) >> 16);
}

ALWAYS_INLINE void store_kv(void *dst, const float *row, int64_t dim, int bf16) {
    if (!bf16) {
        memcpy(dst, row, (size_t)dim * sizeof(float));
        return;
    }
    uint16_t *out = dst;
    for (int64_t i = 0; i < dim; i++) out[i] = round_bf16(row[i]);
}

ALWAYS_INLINE vec load_kv(const void *row, int64_t d, int bf16) {
    return bf16 ? load_w_bf16((const uint16_t *)row + d) : load((const float *)row + d);
}

ALWAYS_INLINE float kv_at(const void *row, int64_t d, int bf16) {
    return bf16 ? widen_one_bf16(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

/* Row t of KV head g of a sequence in a paged cache ([blocks, KV, block_size, D]; `table` its block ids). */
ALWAYS_INLINE const void *cache_row(const void *cache, int bf16, const int64_t *table, int64_t t, int64_t g,
                                    int64_t kv_heads, int64_t block_size, int64_t dim) {
    int64_t row = (table[t / block_size] * kv_heads + g) * block_size + t % block_size;
    return (const char *)cache + row * dim * (bf16 ? 2 : 4);
}

/* For each token t of a pass: rotate its query and key heads in place in the fused q/k/v row
 * `qkv[t]` ([H + 2 KV heads, D]) at position positions[t], x * cos + roll(x, D/2) * signed_sin
 * with the tables' rows [max_pos, D] (the sign lives in the sin table), then store its key and
 * value heads to rows write_rows[t * KV + g] of the caches viewed as [-1, D] (bfloat16 if `kv_bf16`). */
void fdlp_rotary_cache_write(float *qkv, const float *cos_table, const float *sin_table, const int64_t *positions,
                             const int64_t *write_rows, void *k_cache, void *v_cache, int kv_bf16, int64_t tokens,
                             int64_t heads, int64_t kv_heads, int64_t dim, int threads) {
    int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim, row_bytes = dim * (kv_bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * width, tmp[dim];
        const float *c = cos_table + positions[t] * dim, *sn = sin_table + positions[t] * dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * dim;
            memcpy(tmp, x, (size_t)dim * sizeof(float));
            for (int64_t i = 0; i < dim; i++) x[i] = tmp[i] * c[i] + tmp[(i + half) % dim] * sn[i];
        }
        for (int64_t g = 0; g < kv_heads; g++) {
            int64_t at = write_rows[t * kv_heads + g] * row_bytes;
            store_kv((char *)k_cache + at, row + (heads + g) * dim, dim, kv_bf16);
            store_kv((char *)v_cache + at, row + (heads + kv_heads + g) * dim, dim, kv_bf16);
        }
    }
}

ALWAYS_INLINE float dot_kv(const float *q, const void *key, int64_t n, int bf16) {
    vec acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += load(q + i) * load_kv(key, i, bf16);
    float s = lane_sum(acc);
    for (; i < n; i++) s += q[i] * kv_at(key, i, bf16);
    return s;
}

/* out[j] = the sum of v[j]'s lanes, j < 8: one transposing reduction (six horizontal adds and a
 * cross-lane add) where eight lane sums would take five steps each. */
static inline void lane_sums8(const vec v[8], float *out) {
#if defined(__AVX2__)
    __m256 h[8];
    for (int j = 0; j < 8; j++) {
#if LANES == 16
        __m512 wide = (__m512)v[j];
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(wide), _mm512_extractf32x8_ps(wide, 1));
#else
        h[j] = (__m256)v[j];
#endif
    }
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
#else
    for (int j = 0; j < 8; j++) out[j] = lane_sum(v[j]);
#endif
}

/* row[0:len] = softmax(row[0:len]), the exponentials 16 at a time. */
static void softmax_row(float *row, int64_t len) {
    float top = -INFINITY, total = 0.f;
    for (int64_t t = 0; t < len; t++) top = row[t] > top ? row[t] : top;
    int64_t t = 0;
    for (; t + LANES <= len; t += LANES) {
        vec e = exp_vec(load(row + t) - top);
        *(vec *)(row + t) = e;
        total += lane_sum(e);
    }
    for (; t < len; t++) total += row[t] = expf(row[t] - top);
    for (t = 0; t < len; t++) row[t] /= total;
}

/* o[h][0:dim] = sum_t p[h][t] * value_t for `heads` (<= VALUE_HEADS) query heads at once (p's rows
 * `stride` apart), the value rows read from the blocks of KV head g: each row is loaded (and
 * widened) once for all of them, two vectors of it at a time, and the rows are walked block by
 * block. dim is a multiple of the vector width. */
enum { VALUE_HEADS = 4 };
ALWAYS_INLINE void weighted_values(const float *p, int64_t stride, const void *v_cache, int bf16,
                                   const int64_t *table, int64_t g, int64_t kv_heads, int64_t block_size, int64_t dim,
                                   int64_t len, float *o, const int heads) {
    const int64_t row_bytes = dim * (bf16 ? 2 : 4);
    for (int64_t d0 = 0; d0 < dim; d0 += 2 * LANES) {
        const int two = dim - d0 >= 2 * LANES;
        vec acc[VALUE_HEADS][2];
        for (int h = 0; h < heads; h++) acc[h][0] = acc[h][1] = (vec){0};
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
            const char *block = cache_row(v_cache, bf16, table, t0, g, kv_heads, block_size, dim);
            int64_t rows = len - t0 < block_size ? len - t0 : block_size;
            for (int64_t i = 0; i < rows; i++) {
                const char *row = block + i * row_bytes;
                vec v0 = load_kv(row, d0, bf16), v1 = two ? load_kv(row, d0 + LANES, bf16) : (vec){0};
                for (int h = 0; h < heads; h++) {
                    vec ph = splat(p[h * stride + t0 + i]);
                    acc[h][0] += ph * v0;
                    if (two) acc[h][1] += ph * v1;
                }
            }
        }
        for (int h = 0; h < heads; h++) {
            *(vec *)(o + h * dim + d0) = acc[h][0];
            if (two) *(vec *)(o + h * dim + d0 + LANES) = acc[h][1];
        }
    }
}

/* o[0:dim] = sum_t p[t] * value_t where dim is not whole vectors. */
ALWAYS_INLINE void weighted_values_scalar(const float *p, const void *v_cache, int bf16, const int64_t *table,
                                          int64_t g, int64_t kv_heads, int64_t block_size, int64_t dim, int64_t len,
                                          float *o) {
    memset(o, 0, (size_t)dim * sizeof(float));
    for (int64_t t = 0; t < len; t++) {
        const void *value = cache_row(v_cache, bf16, table, t, g, kv_heads, block_size, dim);
        for (int64_t d = 0; d < dim; d++) o[d] += p[t] * kv_at(value, d, bf16);
    }
}

/* scores[h][t + j] = scale * q_h . key_j for 4 keys and `heads` (<= SCORE_HEADS) query heads (rows of
 * qh and of scores `dim` and `stride` apart): each key vector is loaded (and widened) once for all
 * of them, and 8 sums end in one reduction (lane_sums8). dim is a multiple of the vector width. */
enum { SCORE_HEADS = LANES == 16 ? 4 : 2 };
ALWAYS_INLINE void key_scores(const float *qh, const void *const keys[4], int bf16, int64_t dim, float *scores,
                              int64_t stride, float scale, const int heads) {
    vec acc[SCORE_HEADS * 4 + 4];
    float sums[SCORE_HEADS * 4 + 4];
    const int live = (heads * 4 + 7) / 8 * 8; /* whole groups of 8 for lane_sums8; the rest stay zero */
    for (int i = 0; i < live; i++) acc[i] = (vec){0};
    for (int64_t d = 0; d < dim; d += LANES) {
        vec k[4];
        for (int j = 0; j < 4; j++) k[j] = load_kv(keys[j], d, bf16);
        for (int h = 0; h < heads; h++) {
            vec qv = load(qh + h * dim + d);
            for (int j = 0; j < 4; j++) acc[h * 4 + j] += qv * k[j];
        }
    }
    for (int i = 0; i < live; i += 8) lane_sums8(acc + i, sums + i);
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < 4; j++) scores[h * stride + j] = sums[h * 4 + j] * scale;
}

/* One task of `fdlp_paged_attention`: the per_kv query heads `qg` of KV head g over a sequence's
 * first `len` positions, into `o`; `scores` is [per_kv, max_len]. */
ALWAYS_INLINE void attend_group(const float *qg, const void *k_cache, const void *v_cache, int bf16,
                                const int64_t *table, int64_t g, int64_t len, float *o, float *scores, int64_t per_kv,
                                int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_len, float scale) {
    int64_t t = 0;
    /* four keys at a time against up to SCORE_HEADS query heads: one load of each key for them all */
    for (; dim % LANES == 0 && t + 4 <= len; t += 4) {
        const void *keys[4];
        for (int j = 0; j < 4; j++) keys[j] = cache_row(k_cache, bf16, table, t + j, g, kv_heads, block_size, dim);
        for (int64_t h = 0; h < per_kv; h += SCORE_HEADS) {
            const float *qh = qg + h * dim;
            float *out = scores + h * max_len + t;
            switch (per_kv - h < SCORE_HEADS ? per_kv - h : SCORE_HEADS) {
            case 1: key_scores(qh, keys, bf16, dim, out, max_len, scale, 1); break;
            case 2: key_scores(qh, keys, bf16, dim, out, max_len, scale, 2); break;
#if LANES == 16
            case 3: key_scores(qh, keys, bf16, dim, out, max_len, scale, 3); break;
            case 4: key_scores(qh, keys, bf16, dim, out, max_len, scale, 4); break;
#endif
            }
        }
    }
    for (; t < len; t++) {
        const void *key = cache_row(k_cache, bf16, table, t, g, kv_heads, block_size, dim);
        for (int64_t h = 0; h < per_kv; h++) scores[h * max_len + t] = scale * dot_kv(qg + h * dim, key, dim, bf16);
    }
    for (int64_t h = 0; h < per_kv; h++) softmax_row(scores + h * max_len, len);
    if (dim % LANES) {
        for (int64_t h = 0; h < per_kv; h++)
            weighted_values_scalar(scores + h * max_len, v_cache, bf16, table, g, kv_heads, block_size, dim, len,
                                   o + h * dim);
        return;
    }
    for (int64_t h = 0; h < per_kv; h += VALUE_HEADS) {
        const float *p = scores + h * max_len;
        float *oh = o + h * dim;
        switch (per_kv - h < VALUE_HEADS ? per_kv - h : VALUE_HEADS) {
        case 1: weighted_values(p, max_len, v_cache, bf16, table, g, kv_heads, block_size, dim, len, oh, 1); break;
        case 2: weighted_values(p, max_len, v_cache, bf16, table, g, kv_heads, block_size, dim, len, oh, 2); break;
        case 3: weighted_values(p, max_len, v_cache, bf16, table, g, kv_heads, block_size, dim, len, oh, 3); break;
        default: weighted_values(p, max_len, v_cache, bf16, table, g, kv_heads, block_size, dim, len, oh, 4);
        }
    }
}

/* Causal attention of each sequence's `new` last tokens over its cached keys, read in place from
 * the blocks (the new tokens' own keys are already written).
 *
 * q, out: [S * new, H, D], sequence-major (q rotated; scores are scaled by `scale`); k_cache,
 * v_cache: [blocks, KV, block_size, D], bfloat16 if `kv_bf16` else float32; tables: [S, table_width]
 * block ids; lens: [S] tokens of each sequence after this pass, so its j-th new token sees keys [0,
 * lens[s] - new + j]. The H / KV query heads of a KV head are one task, so each key row is read
 * once for all of them. `scratch` holds one task's scores per thread: [threads, H / KV, max_len]. */
void fdlp_paged_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                          const int64_t *tables, const int64_t *lens, float *out, float *scratch, int64_t seqs,
                          int64_t new_tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                          int64_t table_width, int64_t max_len, float scale, int threads) {
    int64_t per_kv = heads / kv_heads;
#pragma omp parallel for schedule(static, 1) num_threads(threads)
    for (int64_t task = 0; task < seqs * new_tokens * kv_heads; task++) {
        int64_t token = task / kv_heads, g = task % kv_heads, s = token / new_tokens;
        int64_t len = lens[s] - new_tokens + token % new_tokens + 1;
        const int64_t *table = tables + s * table_width;
        const float *qg = q + (token * heads + g * per_kv) * dim; /* this group's per_kv query rows */
        float *o = out + (token * heads + g * per_kv) * dim;
        float *scores = scratch + (int64_t)omp_get_thread_num() * per_kv * max_len;
        if (kv_bf16)
            attend_group(qg, k_cache, v_cache, 1, table, g, len, o, scores, per_kv, kv_heads, dim, block_size,
                         max_len, scale);
        else
            attend_group(qg, k_cache, v_cache, 0, table, g, len, o, scores, per_kv, kv_heads, dim, block_size,
                         max_len, scale);
    }
}
