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

/* The linear kernel of weight format `format` (0 float32, 1 bfloat16, 2 float16, 3 int8). */
static void linear_of(int format, const float *x, const void *w, const float *scale, const float *bias, float *y,
                      int64_t m_len, int64_t n_len, int64_t k_len, int threads) {
    switch (format) {
        case 0: fdlp_linear_f32(x, w, scale, bias, y, m_len, n_len, k_len, threads); break;
        case 1: fdlp_linear_bf16(x, w, scale, bias, y, m_len, n_len, k_len, threads); break;
        case 2: fdlp_linear_f16(x, w, scale, bias, y, m_len, n_len, k_len, threads); break;
        default: fdlp_linear_i8(x, w, scale, bias, y, m_len, n_len, k_len, threads);
    }
}

/* A linear layer's weight, per-row scale (int8) and bias; NULL where it has none. */
typedef struct {
    const void *weight;
    const float *scale, *bias;
} fdlp_linear_t;

/* Where the layer's attention reads and writes: `fdlp_rotary_cache_write` and
 * `fdlp_paged_attention`'s arguments for one sequence group. */
typedef struct {
    const float *cos, *sin;
    const int64_t *positions, *write_rows, *tables, *lens;
    float *k_cache, *v_cache;
    int64_t seqs, new_tokens, heads, kv_heads, dim, block_size, table_width, max_len;
    float scale;
} fdlp_attention_t;

/* out = h + mlp(norm2(h)) with h = x + o(attention(rotary(qkv(norm1(x))))), x and out [rows,
 * hidden]. `work` holds rows * (hidden + qkv_width + 2 * heads * dim + 3 * inter) + threads * heads *
 * max_len floats. */
static void decoder_layer(const float *x, float *out, int64_t rows, int64_t hidden, int64_t inter, int format,
                        const float *norm1, const float *norm2, float eps, const fdlp_linear_t *qkv,
                        const fdlp_linear_t *o, const fdlp_linear_t *gate_up, const fdlp_linear_t *down,
                        const fdlp_attention_t *at, float *work, int threads) {
    int64_t q_size = at->heads * at->dim, qkv_width = (at->heads + 2 * at->kv_heads) * at->dim;
    float *normed = work, *qkv_out = normed + rows * hidden, *q = qkv_out + rows * qkv_width;
    float *attended = q + rows * q_size, *gate_up_out = attended + rows * q_size;
    float *act = gate_up_out + rows * 2 * inter, *scratch = act + rows * inter;

    rms_norm(x, norm1, normed, rows, hidden, eps);
    linear_of(format, normed, qkv->weight, qkv->scale, qkv->bias, qkv_out, rows, qkv_width, hidden, threads);
    fdlp_rotary_cache_write(qkv_out, at->cos, at->sin, at->positions, at->write_rows, at->k_cache, at->v_cache,
                            rows, at->heads, at->kv_heads, at->dim, threads);
    for (int64_t m = 0; m < rows; m++) memcpy(q + m * q_size, qkv_out + m * qkv_width, (size_t)q_size * sizeof(float));
    fdlp_paged_attention(q, at->k_cache, at->v_cache, at->tables, at->lens, attended, scratch, at->seqs,
                         at->new_tokens, at->heads, at->kv_heads, at->dim, at->block_size, at->table_width,
                         at->max_len, at->scale, threads);
    linear_of(format, attended, o->weight, o->scale, o->bias, out, rows, hidden, q_size, threads);
    for (int64_t i = 0; i < rows * hidden; i++) out[i] += x[i];

    rms_norm(out, norm2, normed, rows, hidden, eps);
    linear_of(format, normed, gate_up->weight, gate_up->scale, gate_up->bias, gate_up_out, rows, 2 * inter, hidden,
              threads);
    fdlp_swiglu(gate_up_out, act, rows, inter, threads);
    linear_of(format, act, down->weight, down->scale, down->bias, normed, rows, hidden, inter, threads);
    for (int64_t i = 0; i < rows * hidden; i++) out[i] += normed[i];
}

/* The `layers` decoder layers in order, from x to out (both [rows, hidden]; `spare` too, the other
 * buffer they alternate with), then the model's norm after them (weight `final_norm`, same eps).
 * Layer i has the norms norms[2i], norms[2i + 1], the linears linears[4i .. 4i + 3] (q/k/v, o,
 * gate/up, down) and the cache caches[2i] (keys), caches[2i + 1] (values); `at` is the attention
 * inputs every layer shares, its caches aside. */
void fdlp_decoder_layers(const float *x, float *out, float *spare, int64_t layers, int64_t rows, int64_t hidden,
                         int64_t inter, int format, const float *const *norms, const float *final_norm, float eps,
                         const fdlp_linear_t *linears, float *const *caches, const fdlp_attention_t *at, float *work,
                         int threads) {
    fdlp_attention_t layer_at = *at;
    const float *in = x;
    for (int64_t i = 0; i < layers; i++) {
        float *dst = (layers - 1 - i) % 2 ? spare : out; /* the last layer writes out */
        layer_at.k_cache = caches[2 * i];
        layer_at.v_cache = caches[2 * i + 1];
        const fdlp_linear_t *l = linears + 4 * i;
        decoder_layer(in, dst, rows, hidden, inter, format, norms[2 * i], norms[2 * i + 1], eps, l, l + 1, l + 2, l + 3,
                      &layer_at, work, threads);
        in = dst;
    }
    rms_norm(out, final_norm, out, rows, hidden, eps); /* in place: each row's sum is taken first */
}
