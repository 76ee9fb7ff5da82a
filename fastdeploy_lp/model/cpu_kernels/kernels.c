/* CPU kernels for the forward pass: linear layers over up to 32 rows, causal attention over the
 * paged KV cache and rotary with the cache write (attention.h), swiglu, argmax and transpose.
 *
 * Built at first use by `cpu_kernels/__init__.py` with the vector ISA detected in-process (`-mavx512f
 * ...`, `-mavx2 -mfma`, or nothing: never -march=native, so what was detected is what is built) and
 * Paddle's own OpenMP runtime, so these loops share one thread pool with Paddle's MKL kernels.
 * Vectors are GCC vector extensions one register wide: 16 floats with AVX-512 (32 registers), 8
 * with AVX2 (16 registers), 4 elsewhere (SSE2, NEON). The register blocking of the linear kernel
 * is chosen per width below so its accumulators fit the register file. All accumulation is in
 * float32.
 */
#include <math.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define X_ROWS 8        /* rows of x per tile: 3 x 8 = 24 accumulators + 3 weight vectors + x */
#define WEIGHT_ROWS 3
#elif defined(__AVX2__)
#define LANES 8
#define X_ROWS 4        /* 3 x 4 = 12 accumulators + 3 weight vectors + x: all 16 registers */
#define WEIGHT_ROWS 3
#else
#define LANES 4
#define X_ROWS 4
#define WEIGHT_ROWS 2
#endif

#ifndef PREFETCH_NEXT /* 0: the linear kernels do not prefetch their next block (linear.h), to time the difference */
#define PREFETCH_NEXT 1
#endif
typedef float vec __attribute__((vector_size(LANES * 4), aligned(4))); /* unaligned access */
typedef int32_t ivec __attribute__((vector_size(LANES * 4), aligned(4)));

/* The build's vector width, for the loader's log and its tests. */
int fdlp_lanes(void) { return LANES; }

/* Batch-invariant mode (`--deterministic`): every linear layer takes the same per-row path whatever
 * the number of rows of x (linear.h's `rows_times` for one row too, not the GEMV with its four
 * accumulators; bfloat16 activations dot_bf16.h's tiles, not panels; a block format's unit order,
 * invariant_blocks.h, not its GEMV or widened panels), so one
 * row's result does not depend on its neighbours. Each output element is summed by one thread in
 * a fixed order, so it does not depend on the thread count either. */
static int batch_invariant;
void fdlp_set_batch_invariant(int on) { batch_invariant = on != 0; }

/* bfloat16 weights times bfloat16 activations (dot_bf16.h) where the build targets AVX512_BF16:
 * on unless switched off here. Returns whether this build has it. */
static int bf16_dot = 1;
int fdlp_set_bf16_dot(int on) {
    bf16_dot = on != 0;
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

static inline vec load(const float *p) { return *(const vec *)p; }

static inline vec load_tail(const float *p, int64_t n) {
    vec v = {0};
    memcpy(&v, p, (size_t)n * sizeof(float));
    return v;
}

/* x in every lane: one broadcast (`(vec){0} + x` is an add, which must turn -0 into +0). */
static inline vec splat(float x) { return __builtin_shuffle((vec){x}, (ivec){0}); }

static inline vec blend(ivec mask, vec a, vec b) { return (vec)(((ivec)a & mask) | ((ivec)b & ~mask)); }

/* e^x for 16 lanes: Cephes' expf (x = n ln2 + r, a degree-5 polynomial in r, 2^n in the exponent
 * bits), relative error ~1e-7. Inputs are clamped to [-87.3, 88.3] so the result stays finite and
 * non-zero; NaN stays NaN. */
static inline vec exp_vec(vec x) {
    const vec lo = (vec){0} - 87.3f, hi = (vec){0} + 88.3f;
    x = blend(x < lo, lo, x);
    x = blend(x > hi, hi, x);
    vec n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f; /* round to nearest */
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec p = (vec){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return (p * r * r + r + 1.f) * (vec)bits;
}

/* The lanes of v added in a halving tree (lane i + lane i + width, width = LANES / 2, ..., 1): log2(LANES)
 * adds, not LANES - 1 in a chain. `rows_times`, `dot_rows` and invariant.h's packed product all end
 * in this order, so it is spelled out (GCC compiled the loop form to a store and a dozen scalar
 * loads and adds); the upper half of 16 lanes is taken as 4 doubles, which needs no AVX512DQ. */
static inline float lane_sum(vec v) {
#if LANES == 16
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256((__m512)v), _mm256_castpd_ps(_mm512_extractf64x4_pd((__m512d)v, 1)));
#elif LANES == 8
    __m256 h = (__m256)v;
#endif
#if LANES >= 8
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return q[0] + q[1];
#else
    return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

/* The linear kernel, once per weight format (`linear.h`): float32, bfloat16 and float16 weights
 * widened to float32 in registers, int8 weights dequantized by a per-row scale. Activations and
 * accumulation stay float32 in every format. The float formats also get `fdlp_quantize_*`. */
static inline float widen_one_f32(float x) { return x; }
static inline vec load_w_f32(const float *p) { return load(p); }
static inline vec load_w_tail_f32(const float *p, int64_t n) { return load_tail(p, n); }

static inline float widen_one_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}
static inline float widen_one_f16(_Float16 h) { return (float)h; }

/* GCC turns a vector conversion from int8 or _Float16 lanes into one scalar instruction per lane,
 * so the widening loads use the ISA's own instructions where there is one (F16C's vcvtph2ps,
 * vpmovsxbd + vcvtdq2ps, vpmovzxwd + a shift for bfloat16): the int8 GEMV read 2.9 GB/s before. */
#if defined(__AVX512F__)
static inline vec load_w_bf16(const uint16_t *p) {
    return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline vec load_w_f16(const _Float16 *p) { return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vec load_w_i8(const int8_t *p) {
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
static inline vec load_w_bf16(const uint16_t *p) {
    return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
static inline vec load_w_f16(const _Float16 *p) { return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vec load_w_i8(const int8_t *p) {
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline vec load_w_bf16(const uint16_t *p) {
    vec v;
    for (int i = 0; i < LANES; i++) v[i] = widen_one_bf16(p[i]);
    return v;
}
static inline vec load_w_f16(const _Float16 *p) {
    vec v;
    for (int i = 0; i < LANES; i++) v[i] = widen_one_f16(p[i]);
    return v;
}
static inline vec load_w_i8(const int8_t *p) {
    vec v;
    for (int i = 0; i < LANES; i++) v[i] = (float)p[i];
    return v;
}
#endif
static inline vec load_w_tail_bf16(const uint16_t *p, int64_t n) {
    uint16_t h[LANES] = {0};
    memcpy(h, p, (size_t)n * 2);
    return load_w_bf16(h);
}
static inline vec load_w_tail_f16(const _Float16 *p, int64_t n) {
    _Float16 h[LANES] = {0};
    memcpy(h, p, (size_t)n * 2);
    return load_w_f16(h);
}
static inline vec load_w_tail_i8(const int8_t *p, int64_t n) {
    int8_t b[LANES] = {0};
    memcpy(b, p, (size_t)n);
    return load_w_i8(b);
}

/* bfloat16's split widening (`split_vector_times` in linear.h): lane i of the integer vector holds
 * weight 2i in its low half and 2i + 1 in its high half; each is a float once in the high half. */
static inline void split_bf16(ivec w, vec out[2]) {
    out[0] = (vec)(w << 16);
    out[1] = (vec)(w & (int32_t)0xFFFF0000u);
}

/* x[0, k_len) with each chunk of split * LANES floats reordered to match a split widening: chunk
 * position s * LANES + i holds x[i * split + s]; the rest (k_len % chunk) is left out. Written into
 * the calling thread's buffer, which grows to the widest x seen and is kept (a GEMV per linear layer
 * per step must not allocate); NULL if it cannot grow, and the caller widens without the split. */
static float *permute_x(const float *x, int64_t k_len, int split) {
    static __thread float *buffer;
    static __thread int64_t capacity;
    if (k_len > capacity) {
        float *grown = realloc(buffer, (size_t)k_len * sizeof(float));
        if (!grown) return NULL;
        buffer = grown;
        capacity = k_len;
    }
    int64_t chunk = (int64_t)split * LANES, k_split = k_len - k_len % chunk;
    for (int64_t c = 0; c < k_split; c += chunk)
        for (int s = 0; s < split; s++)
            for (int i = 0; i < LANES; i++) buffer[c + s * LANES + i] = x[c + i * split + s];
    return buffer;
}

#include "invariant.h"
#if LANES == 16
#include "xpanel.h"
#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 9 /* rows of x from which the linear kernels pack x into panels (xpanel.h): at 8 rows a panel is half empty, and `rows_times` read bfloat16 at 58 GMAC/s against 40 (Zen 4, 2 threads) */
#endif
#endif
#ifndef X_PANELS /* 0: no panels (xpanel.h), to time the difference */
#define X_PANELS 1
#endif

#define WEIGHT float
#define FORMAT f32
#define GEMV_AHEAD 0
#if LANES == 16
#define PANEL_FLOAT /* many rows of x in panels (xpanel.h) */
#endif
#define QUANTIZE
#include "linear.h"
#if defined(__AVX512BF16__)
#include "dot_bf16.h"
#define DOT_LINEAR dot_linear
#endif
#define WEIGHT uint16_t
#define FORMAT bf16
#define NARROW
#define GEMV_AHEAD 4096
#define SPLIT 2
#define QUANTIZE
#include "linear.h"
#define WEIGHT _Float16
#define FORMAT f16
#define NARROW
#define GEMV_AHEAD 4096
#define QUANTIZE
#include "linear.h"
#define WEIGHT int8_t
#define FORMAT i8
#define NARROW
#define GEMV_AHEAD 4096
#include "linear.h"

#include "blocks.h"
#define BLOCK_AHEAD 4096 /* bytes: the narrow formats' GEMV prefetch distance */
#define UNIT_GEMM_ROWS 32 /* rows of x from which the batch-invariant block kernel packs a GEMM (invariant_blocks.h) */
#define BFORMAT FMT_Q4_0
#define BNAME q4_0
#include "block_linear.h"
#define BFORMAT FMT_Q4_1
#define BNAME q4_1
#include "block_linear.h"
#define BFORMAT FMT_Q5_0
#define BNAME q5_0
#include "block_linear.h"
#define BFORMAT FMT_Q5_1
#define BNAME q5_1
#include "block_linear.h"
#define BFORMAT FMT_Q8_0
#define BNAME q8_0
#include "block_linear.h"
#define BFORMAT FMT_Q4_K
#define BNAME q4_k
#include "block_linear.h"
#define BFORMAT FMT_Q5_K
#define BNAME q5_k
#include "block_linear.h"
#define BFORMAT FMT_Q6_K
#define BNAME q6_k
#include "block_linear.h"
#define BFORMAT FMT_W4G128
#define BNAME w4g128
#include "block_linear.h"

/* Sum of n floats read by every thread: the machine's read bandwidth, measured by the benchmarks
 * the way a decode step reads its weights. */
double fdlp_read_sum(const float *x, int64_t n, int threads) {
    double total = 0;
    const int64_t chunk = 1 << 16;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (int64_t c = 0; c < n; c += chunk) {
        int64_t end = c + chunk < n ? c + chunk : n, i = c;
        vec a[4] = {{0}};
        for (; i + 4 * LANES <= end; i += 4 * LANES)
            for (int u = 0; u < 4; u++) a[u] += load(x + i + u * LANES);
        float s = lane_sum(a[0] + a[1] + a[2] + a[3]);
        for (; i < end; i++) s += x[i];
        total += s;
    }
    return total;
}

/* The first index of the largest value of row[c0, c1) (NaN never the largest; c0 if none is
 * above -inf), the value, and whether the range holds a NaN or a +inf. */
typedef struct {
    float top;
    int64_t at;
    int bad;
} argmax_t;

static argmax_t argmax_range(const float *row, int64_t c0, int64_t c1) {
    vec best = (vec){0} - INFINITY;
    ivec lane, best_at, bad = {0};
    for (int i = 0; i < LANES; i++) lane[i] = i;
    best_at = lane + (int32_t)c0; /* ids fit int32: vocabularies are far below 2^31 */
    int64_t c = c0;
    for (; c + LANES <= c1; c += LANES) {
        vec v = load(row + c);
        ivec above = v > best;
        best = blend(above, v, best);
        best_at = (above & (lane + (int32_t)c)) | (~above & best_at);
        bad |= (v != v) | (v == INFINITY);
    }
    argmax_t out = {-INFINITY, c0, 0};
    for (int i = 0; i < LANES; i++) { /* the lanes' winners: the largest, then the first */
        if (best[i] > out.top || (best[i] == out.top && best_at[i] < out.at)) out.top = best[i], out.at = best_at[i];
        out.bad |= bad[i] != 0;
    }
    for (; c < c1; c++) {
        if (row[c] > out.top) out.top = row[c], out.at = c;
        out.bad |= isnan(row[c]) || row[c] == INFINITY;
    }
    return out;
}

/* out[r] = the first index of row r's largest value (NaN never the largest; 0 for a row of -inf or
 * NaN), and unusable[r] = 1 if nothing can be drawn from the row: a NaN or a +inf in it, or -inf
 * throughout. The greedy draw and its check in one read of the logits; with fewer rows than
 * threads, each row is split into column ranges. */
void fdlp_argmax(const float *x, int64_t *out, uint8_t *unusable, int64_t rows, int64_t cols, int threads) {
    const int64_t min_range = 8192;
    int64_t parts = rows >= threads ? 1 : threads / rows;
    if (parts > 1 && cols / parts < min_range) parts = cols / min_range > 1 ? cols / min_range : 1;
    argmax_t partial[rows > 0 ? rows * parts : 1]; /* 16 bytes a range: a verify pass of 256 rows takes 4 KB */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < rows * parts; task++) {
        int64_t r = task / parts, p = task % parts;
        partial[task] = argmax_range(x + r * cols, p * cols / parts, (p + 1) * cols / parts);
    }
    for (int64_t r = 0; r < rows; r++) {
        argmax_t best = partial[r * parts];
        for (int64_t p = 1; p < parts; p++) { /* ranges in order: a later one wins only if larger */
            argmax_t next = partial[r * parts + p];
            if (next.top > best.top) best.top = next.top, best.at = next.at;
            best.bad |= next.bad;
        }
        out[r] = best.at;
        unusable[r] = best.bad || best.top == -INFINITY;
    }
}

/* out[c, r] = x[r, c] for x [rows, cols], in 16 x 16 tiles that stay in L1. */
void fdlp_transpose(const float *x, float *out, int64_t rows, int64_t cols, int threads) {
    const int64_t tile = 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r0 = 0; r0 < rows; r0 += tile)
        for (int64_t c0 = 0; c0 < cols; c0 += tile)
            for (int64_t r = r0; r < r0 + tile && r < rows; r++)
                for (int64_t c = c0; c < c0 + tile && c < cols; c++) out[c * rows + r] = x[r * cols + c];
}

/* out[m, i] = silu(x[m, i]) * x[m, width + i] for x [M, 2 * width]: the gate and up halves of a
 * fused gate/up projection (the layout of Paddle's swiglu). */
void fdlp_swiglu(const float *x, float *out, int64_t m_len, int64_t width, int threads) {
    const int64_t chunk = 1024;
    int64_t per_row = (width + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < m_len * per_row; task++) {
        int64_t m = task / per_row, i0 = task % per_row * chunk, i1 = i0 + chunk < width ? i0 + chunk : width;
        const float *gate = x + m * 2 * width, *up = gate + width;
        float *o = out + m * width;
        int64_t i = i0;
        for (; i + LANES <= i1; i += LANES) {
            vec g = load(gate + i);
            *(vec *)(o + i) = g / (1.f + exp_vec(-g)) * load(up + i);
        }
        for (; i < i1; i++) o[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}

#include "attention.h"
#include "layer.h"
