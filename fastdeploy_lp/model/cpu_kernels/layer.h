/* Every decoder layer of a pass over up to 32 tokens in one call (included by kernels.c after the
 * kernels it chains): at batch 1 a layer's dozen Python-side steps (norms, kernel calls, output
 * allocations, residual adds) cost ~5 ms per decode step on the bench model, as much as reading a
 * fifth of its int8 weights, and a call per layer still ~1 ms. Each stage is the kernel the
 * unfused path runs, in the same order, so the values are the unfused kernel path's but for the
 * norms' summation order. */

/* out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * weight, float32 throughout (the reference's order). */
static void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t width, float eps) {
    for (int64_t m = 0; m < rows; m++) {
        const float *row = x + m * width;
        vec acc = {0};
        int64_t i = 0;
        for (; i + LANES <= width; i += LANES) acc += load(row + i) * load(row + i);
        float sum = lane_sum(acc);
        for (; i < width; i++) sum += row[i] * row[i];
        float inv = 1.f / sqrtf(sum / (float)width + eps);
        for (i = 0; i < width; i++) out[m * width + i] = weight[i] * (row[i] * inv);
    }
}

/* rms_norm over rows of x on every thread, each row by one thread in rms_norm's order: the
 * unfused layers' norms in batch-invariant mode, so they equal the fused call's bit for bit. */
void fdlp_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t width, float eps,
                   int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < rows; m++) rms_norm(x + m * width, weight, out + m * width, 1, width, eps);
}

/* A linear layer: its weight, per-row scale (int8) and bias (NULL where it has none), and the formats
 * of its rows: `parts` row ranges in order, part i `rows[i]` rows of format `format[i]` (0 float32,
 * 1 bfloat16, 2 float16, 3 int8, else a block format of blocks.h), stored one after the other. A
 * q/k/v projection fused from a GGUF file may mix formats (Q4_K_M keeps some v rows in Q6_K). */
#define FDLP_PARTS 3
typedef struct {
    const void *weight;
    const float *scale, *bias;
    int64_t parts, format[FDLP_PARTS], rows[FDLP_PARTS];
} fdlp_linear_t;

/* Each block format's kernels: the integer kernel for few rows of x (on x quantized to int16), the
 * unit order for more (invariant_blocks.h; every row count in batch-invariant mode), and its rows
 * widened to float32 (a tile for a BLAS GEMM). */
typedef void (*block_product_t)(const xquant_t *x, const uint8_t *w, const float *bias, float *y, int64_t m_len,
                                int64_t n_len, int64_t k_len, int64_t ldy, int threads);
typedef struct {
    int format;
    block_product_t integer, units;
    void (*widen)(const uint8_t *w, int64_t n0, int64_t rows, int64_t k_len, float *out, int threads);
} block_kernels_t;
#define BLOCK_KERNELS(f, name) {f, block_linear_##name, unit_linear_##name, widen_rows_##name}
static const block_kernels_t BLOCK_FORMATS[] = {
    BLOCK_KERNELS(FMT_Q4_0, q4_0), BLOCK_KERNELS(FMT_Q4_1, q4_1), BLOCK_KERNELS(FMT_Q5_0, q5_0),
    BLOCK_KERNELS(FMT_Q5_1, q5_1), BLOCK_KERNELS(FMT_Q8_0, q8_0), BLOCK_KERNELS(FMT_Q4_K, q4_k),
    BLOCK_KERNELS(FMT_Q5_K, q5_k), BLOCK_KERNELS(FMT_Q6_K, q6_k), BLOCK_KERNELS(FMT_W4G128, w4g128),
};
#undef BLOCK_KERNELS

/* The kernels of block format `format`; NULL for a format these kernels do not know. */
static const block_kernels_t *block_kernels(int64_t format) {
    for (size_t i = 0; i < sizeof BLOCK_FORMATS / sizeof BLOCK_FORMATS[0]; i++)
        if (BLOCK_FORMATS[i].format == format) return &BLOCK_FORMATS[i];
    return NULL;
}

/* out = rows [n0, n0 + rows) of a weight of block format `format` widened to float32 (a tile for
 * a BLAS GEMM); -1 for a format these kernels do not know. */
int fdlp_widen_blocks(int format, const uint8_t *w, int64_t n0, int64_t rows, int64_t k_len, float *out, int threads) {
    const block_kernels_t *kernels = block_kernels(format);
    if (!kernels) return -1;
    kernels->widen(w, n0, rows, k_len, out, threads);
    return 0;
}

/* Rows of x from which a block-format linear runs the unit order (invariant_blocks.h) instead of
 * the integer kernel; every row count in batch-invariant mode. Timed on 1024 x 4864 and 4864 x 1024
 * weights, 2 threads, AVX2 EPYC (GMAC/s, integer or widened panels / units): Q4_K at 8 rows 24.0 /
 * 36.8, Q6_K 20.8 / 27.4, but Q4_0 42.6 / 42.0 and Q8_0 42.1 / 42.3; from 16 rows the units lead
 * in every format (Q4_0 16 rows 51.9 / 61.3; 64 rows against the panels this order replaced 34.2
 * / 49.9, Q4_K 31.6 / 49.7, Q6_K 31.1 / 37.2). The K formats' integer unpack (sub-scales, two
 * loads of high bits) is paid once per tile of x rows, the 32-weight formats' is cheap. */
int fdlp_block_unit_rows(int format) {
    return batch_invariant ? 1 : format == FMT_Q4_K || format == FMT_Q5_K || format == FMT_Q6_K ? 8 : 16;
}

/* y[M, N] = x[M, K] @ lin^T (times its row scales, plus its bias), part by part. x is quantized to
 * int16 once if any part is a block format. Returns -1 if the buffer for that (or, in batch-invariant
 * mode, for bfloat16 activations) could not grow or a part is in a format these kernels do not know. */
int fdlp_linear(const float *x, const fdlp_linear_t *lin, float *y, int64_t m_len, int64_t n_len, int64_t k_len,
                int threads) {
    xquant_t xq = {NULL, NULL, NULL, k_len, k_len / 32};
    for (int64_t p = 0; p < lin->parts && !xq.q; p++) {
        if (lin->format[p] < 100) continue;
        float *d, *s;
        int16_t *q = x_buffer(m_len, k_len, &d, &s);
        if (!q) return -1;
#pragma omp parallel for schedule(static) num_threads(m_len > 1 ? threads : 1)
        for (int64_t m = 0; m < m_len; m++) quantize_x(x, q, d, s, m, m + 1, k_len);
        xq.q = q, xq.d = d, xq.s = s;
    }
    const uint8_t *w = lin->weight;
    int64_t row = 0;
    for (int64_t p = 0; p < lin->parts; p++) {
        int64_t rows = lin->rows[p], format = lin->format[p];
        const float *bias = lin->bias ? lin->bias + row : NULL, *scale = lin->scale ? lin->scale + row : NULL;
        int failed = 0;
        switch (format) {
            case 0: failed = linear_f32(x, (const float *)w, scale, bias, y + row, m_len, rows, k_len, n_len, threads); break;
            case 1: failed = linear_bf16(x, (const uint16_t *)w, scale, bias, y + row, m_len, rows, k_len, n_len, threads); break;
            case 2: failed = linear_f16(x, (const _Float16 *)w, scale, bias, y + row, m_len, rows, k_len, n_len, threads); break;
            case 3: failed = linear_i8(x, (const int8_t *)w, scale, bias, y + row, m_len, rows, k_len, n_len, threads); break;
            default: {
                const block_kernels_t *kernels = block_kernels(format);
                if (!kernels) return -1;
                (m_len >= fdlp_block_unit_rows((int)format) ? kernels->units : kernels->integer)(
                    &xq, w, bias, y + row, m_len, rows, k_len, n_len, threads);
            }
        }
        if (failed) return -1;
        w += format < 100 ? rows * k_len * (format == 0 ? 4 : format == 3 ? 1 : 2)
                          : rows * (k_len / block_elems((int)format)) * block_bytes((int)format);
        row += rows;
    }
    return 0;
}

/* One adapter's LoRA update of one linear (model/lora.py): `a` [a_rows, in], the A matrices of
 * the segments it targets stacked (q, k, v of q/k/v; gate, up of gate/up; or the one), and `bt`,
 * its B matrices transposed and scaled, each over its own segment's outputs (those of segments it
 * does not target zero), in panels of LORA_PANEL outputs: [ceil(out / LORA_PANEL), rank,
 * LORA_PANEL], so the update of a run of outputs reads one contiguous stream (as [rank, out] it read
 * `rank` streams a row apart, at half the memory's rate). Output segment s reads columns
 * [column[s], column[s] + rank) of x @ a^T; -1: not targeted. `a` NULL: the adapter leaves this
 * linear alone. Held as float32, bfloat16 or float16 (`--lora-dtype`), widened in registers. */
#define LORA_PANEL 16 /* a multiple of every LANES, so a vector never straddles two panels */
typedef struct {
    const void *a, *bt;
    int64_t format, rank, a_rows, column[FDLP_PARTS]; /* format: 0 float32, 1 bfloat16, 2 float16 */
} fdlp_lora_weight_t;

/* The LoRA adapters of a pass: row m of x runs with adapter row_adapter[m] (-1: the base), whose
 * update of linear j of layer l (j: q/k/v, o, gate/up, down) is weights[row_adapter[m]][4 l + j].
 * `shrunk` holds rows * stride floats, stride at least every a_rows. */
typedef struct {
    int64_t adapters, stride;
    const int64_t *row_adapter;
    const fdlp_lora_weight_t **weights;
    float *shrunk;
} fdlp_lora_t;

/* LANES values of a LoRA weight from element i on, and one value, as float32. */
static inline vec lora_load(const void *w, int64_t format, int64_t i) {
    return format == 1 ? load_w_bf16((const uint16_t *)w + i)
         : format == 2 ? load_w_f16((const _Float16 *)w + i) : load((const float *)w + i);
}
static inline float lora_one(const void *w, int64_t format, int64_t i) {
    return format == 1 ? widen_one_bf16(((const uint16_t *)w)[i])
         : format == 2 ? widen_one_f16(((const _Float16 *)w)[i]) : ((const float *)w)[i];
}

/* Row k of an A (k_len wide) times x, with four chains of adds, not one: an A row is read once, so
 * its dot product with x ran at the rate of the adds' latency otherwise. */
static inline float lora_shrink(const fdlp_lora_weight_t *w, int64_t k, const float *x, int64_t k_len) {
    vec acc[4] = {{0}};
    int64_t i = 0, row = k * k_len;
    for (; i + 4 * LANES <= k_len; i += 4 * LANES)
        for (int j = 0; j < 4; j++) acc[j] += lora_load(w->a, w->format, row + i + j * LANES) * load(x + i + j * LANES);
    vec sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (; i + LANES <= k_len; i += LANES) sum += lora_load(w->a, w->format, row + i) * load(x + i);
    float s = lane_sum(sum);
    for (; i < k_len; i++) s += lora_one(w->a, w->format, row + i) * x[i];
    return s;
}

/* Where output o's B^T column starts in its panel (its rank values LORA_PANEL apart): an element index. */
static inline int64_t lora_panel(const fdlp_lora_weight_t *w, int64_t o) {
    return (o / LORA_PANEL * w->rank) * LORA_PANEL + o % LORA_PANEL;
}

/* out[o] += t @ B^T[:, o], the one output a vector does not cover, in the vector's order. */
static inline void lora_output(const fdlp_lora_weight_t *w, const float *t, int64_t o, float *out) {
    int64_t at = lora_panel(w, o);
    float acc = 0.f;
    for (int64_t r = 0; r < w->rank; r++) acc += t[r] * lora_one(w->bt, w->format, at + r * LORA_PANEL);
    out[o] += acc;
}

/* y[m] += (x[m] @ A^T) @ B^T with row m's adapter, for the `segments` output segments of widths
 * `widths` of linear `linear`. The segmented form of Punica / S-LoRA: each adapter's A row is read
 * once for all its rows, each B^T row is broadcast against a row's shrunk value (no horizontal
 * sums), and rows of the base cost nothing. Every element is summed by one thread in one order,
 * whatever the rows and threads, so the update is batch-invariant. */
void fdlp_lora_update(const fdlp_lora_t *lora, int64_t linear, const float *x, float *y, int64_t rows, int64_t k_len,
                      int64_t n_len, const int64_t *widths, int64_t segments, int threads) {
    int64_t stride = lora->stride;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < lora->adapters * stride; task++) {
        const fdlp_lora_weight_t *w = &lora->weights[task / stride][linear];
        int64_t k = task % stride;
        if (!w->a || k >= w->a_rows) continue;
        for (int64_t m = 0; m < rows; m++)
            if (lora->row_adapter[m] == task / stride)
                lora->shrunk[m * stride + k] = lora_shrink(w, k, x + m * k_len, k_len);
    }
    int64_t chunk = 32 * LANES, chunks = (n_len + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t start = 0;
        for (int64_t s = 0; s < segments; start += widths[s++]) {
            int64_t lo = start > c * chunk ? start : c * chunk, end = start + widths[s];
            int64_t hi = end < (c + 1) * chunk ? end : (c + 1) * chunk;
            for (int64_t m = 0; m < rows && lo < hi; m++) {
                int64_t adapter = lora->row_adapter[m];
                const fdlp_lora_weight_t *w = adapter < 0 ? NULL : &lora->weights[adapter][linear];
                if (!w || !w->a || w->column[s] < 0) continue;
                const float *t = lora->shrunk + m * stride + w->column[s];
                float *out = y + m * n_len;
                int64_t o = lo;
                for (; o < hi && o % LANES; o++) lora_output(w, t, o, out);
                for (; o + 2 * LANES <= hi; o += 2 * LANES) { /* two vectors: two chains of adds */
                    int64_t p0 = lora_panel(w, o), p1 = lora_panel(w, o + LANES);
                    vec acc0 = {0}, acc1 = {0};
                    for (int64_t r = 0; r < w->rank; r++) {
                        acc0 += t[r] * lora_load(w->bt, w->format, p0 + r * LORA_PANEL);
                        acc1 += t[r] * lora_load(w->bt, w->format, p1 + r * LORA_PANEL);
                    }
                    *(vec *)(out + o) = load(out + o) + acc0; /* the update summed, then added: base + update */
                    *(vec *)(out + o + LANES) = load(out + o + LANES) + acc1;
                }
                for (; o + LANES <= hi; o += LANES) {
                    int64_t p0 = lora_panel(w, o);
                    vec acc = {0};
                    for (int64_t r = 0; r < w->rank; r++) acc += t[r] * lora_load(w->bt, w->format, p0 + r * LORA_PANEL);
                    *(vec *)(out + o) = load(out + o) + acc;
                }
                for (; o < hi; o++) lora_output(w, t, o, out);
            }
        }
    }
}

/* Where the layer's attention reads and writes: `fdlp_rotary_cache_write` and
 * `fdlp_paged_attention`'s arguments for one sequence group. */
typedef struct {
    const float *cos, *sin;
    const int64_t *positions, *write_rows, *tables, *lens;
    void *k_cache, *v_cache;
    int64_t kv_bf16, seqs, new_tokens, heads, kv_heads, dim, block_size, table_width, max_len;
    float scale;
} fdlp_attention_t;

/* out = h + mlp(norm2(h)) with h = x + o(attention(rotary(qkv(norm1(x))))), x and out [rows,
 * hidden]. `work` holds rows * (hidden + qkv_width + 2 * heads * dim + 3 * inter) + threads * heads *
 * max_len floats. Each linear is followed by its update from `lora`'s adapters (layer `layer`'s;
 * NULL: none). -1 if a block-format linear found no memory for its buffers. */
static int decoder_layer(const float *x, float *out, int64_t rows, int64_t hidden, int64_t inter,
                        const float *norm1, const float *norm2, float eps, const fdlp_linear_t *qkv,
                        const fdlp_linear_t *o, const fdlp_linear_t *gate_up, const fdlp_linear_t *down,
                        const fdlp_attention_t *at, const fdlp_lora_t *lora, int64_t layer, float *work,
                        int threads) {
    int64_t q_size = at->heads * at->dim, qkv_width = (at->heads + 2 * at->kv_heads) * at->dim;
    float *normed = work, *qkv_out = normed + rows * hidden, *q = qkv_out + rows * qkv_width;
    float *attended = q + rows * q_size, *gate_up_out = attended + rows * q_size;
    float *act = gate_up_out + rows * 2 * inter, *scratch = act + rows * inter;

    int64_t qkv_widths[3] = {q_size, at->kv_heads * at->dim, at->kv_heads * at->dim}, gate_up_widths[2] = {inter, inter};
    rms_norm(x, norm1, normed, rows, hidden, eps);
    if (fdlp_linear(normed, qkv, qkv_out, rows, qkv_width, hidden, threads)) return -1;
    if (lora) fdlp_lora_update(lora, 4 * layer, normed, qkv_out, rows, hidden, qkv_width, qkv_widths, 3, threads);
    fdlp_rotary_cache_write(qkv_out, at->cos, at->sin, at->positions, at->write_rows, at->k_cache, at->v_cache,
                            (int)at->kv_bf16, rows, at->heads, at->kv_heads, at->dim, threads);
    for (int64_t m = 0; m < rows; m++) memcpy(q + m * q_size, qkv_out + m * qkv_width, (size_t)q_size * sizeof(float));
    fdlp_paged_attention(q, at->k_cache, at->v_cache, (int)at->kv_bf16, at->tables, at->lens, attended, scratch, at->seqs,
                         at->new_tokens, at->heads, at->kv_heads, at->dim, at->block_size, at->table_width,
                         at->max_len, at->scale, threads);
    if (fdlp_linear(attended, o, out, rows, hidden, q_size, threads)) return -1;
    if (lora) fdlp_lora_update(lora, 4 * layer + 1, attended, out, rows, q_size, hidden, &hidden, 1, threads);
    for (int64_t i = 0; i < rows * hidden; i++) out[i] += x[i];

    rms_norm(out, norm2, normed, rows, hidden, eps);
    if (fdlp_linear(normed, gate_up, gate_up_out, rows, 2 * inter, hidden, threads)) return -1;
    if (lora) fdlp_lora_update(lora, 4 * layer + 2, normed, gate_up_out, rows, hidden, 2 * inter, gate_up_widths, 2, threads);
    fdlp_swiglu(gate_up_out, act, rows, inter, threads);
    if (fdlp_linear(act, down, normed, rows, hidden, inter, threads)) return -1;
    if (lora) fdlp_lora_update(lora, 4 * layer + 3, act, normed, rows, inter, hidden, &hidden, 1, threads);
    for (int64_t i = 0; i < rows * hidden; i++) out[i] += normed[i];
    return 0;
}

/* The `layers` decoder layers in order, from x to out (both [rows, hidden]; `spare` too, the other
 * buffer they alternate with), then the model's norm after them (weight `final_norm`, same eps).
 * Layer i has the norms norms[2i], norms[2i + 1], the linears linears[4i .. 4i + 3] (q/k/v, o,
 * gate/up, down) and the cache caches[2i] (keys), caches[2i + 1] (values); `at` is the attention
 * inputs every layer shares, its caches aside; `lora` the pass's adapters (NULL: none). Returns -1
 * if a block-format linear found no memory for its buffers (the output is then not computed), else 0. */
int fdlp_decoder_layers(const float *x, float *out, float *spare, int64_t layers, int64_t rows, int64_t hidden,
                         int64_t inter, const float *const *norms, const float *final_norm, float eps,
                         const fdlp_linear_t *linears, void *const *caches, const fdlp_attention_t *at,
                         const fdlp_lora_t *lora, float *work, int threads) {
    fdlp_attention_t layer_at = *at;
    const float *in = x;
    for (int64_t i = 0; i < layers; i++) {
        float *dst = (layers - 1 - i) % 2 ? spare : out; /* the last layer writes out */
        layer_at.k_cache = caches[2 * i];
        layer_at.v_cache = caches[2 * i + 1];
        const fdlp_linear_t *l = linears + 4 * i;
        if (decoder_layer(in, dst, rows, hidden, inter, norms[2 * i], norms[2 * i + 1], eps, l, l + 1, l + 2, l + 3,
                          &layer_at, lora, i, work, threads))
            return -1;
        in = dst;
    }
    rms_norm(out, final_norm, out, rows, hidden, eps); /* in place: each row's sum is taken first */
    return 0;
}
