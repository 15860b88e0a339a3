/* Native float32 kernels for the CPU path, loaded with ctypes by cpu_native.py.
 *
 * Built on first use by aioinfer/model/kernels/cpu_native.py with
 *   cc -O3 -march=native -fopenmp -shared -fPIC -lm -mprefer-vector-width=512
 * Written with GCC vector extensions, so one source compiles to AVX-512 (16 lanes) or to
 * AVX2 + FMA (8 lanes); `a += x * b` on vectors becomes a fused multiply-add. The OpenMP
 * runtime resolves to the libgomp that torch has already loaded, so these kernels and torch's
 * own ops share one thread team per calling thread.
 *
 * Kernels: packed_linear, paged_decode_attention, rms_norm, silu_mul, rotary; each documented
 * above its code.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#else
#error "the native CPU kernels need AVX2 and FMA, or AVX-512F"
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int vi __attribute__((vector_size(LANES * 4)));
/* The same vector at any float address, allowed to alias float data. */
typedef float vf_u __attribute__((vector_size(LANES * 4), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vf_u *)p; }
static inline void store(float *p, vf v) { *(vf_u *)p = v; }
#if LANES == 16
static inline vf splat(float s) { return (vf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
#else
static inline vf splat(float s) { return (vf){s, s, s, s, s, s, s, s}; }
#endif
static inline vf select_v(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf max_v(vf a, vf b) { return select_v(a > b, a, b); }
static inline vf min_v(vf a, vf b) { return select_v(a < b, a, b); }
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
/* Pairwise: halves added until four lanes are left (a chain of single adds is 3x slower). */
static inline float sum_lanes(vf v) {
#if LANES == 16
    v8f lo, hi;
    memcpy(&lo, &v, 32);
    memcpy(&hi, (char *)&v + 32, 32);
    v8f eight = lo + hi;
#else
    v8f eight = v;
#endif
    v4f a, b;
    memcpy(&a, &eight, 16);
    memcpy(&b, (char *)&eight + 16, 16);
    v4f four = a + b;
    return (four[0] + four[2]) + (four[1] + four[3]);
}

/* exp, within about 2 ulp of expf for x in [-87, 88] (clamped outside; NaN passes through):
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, times 2^n built
 * in the exponent bits. A scalar expf per score was most of the decode attention's time. */
static inline vf exp_v(vf in) {
    vf x = max_v(min_v(in, splat(88.0f)), splat(-87.0f));
    vf t = x * 1.44269504f + 0.5f;
    vi n = __builtin_convertvector(t, vi); /* truncates toward zero: floor below */
    n -= (vi)(__builtin_convertvector(n, vf) > t) & 1;
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693359375f;  /* ln2, high bits */
    r = r - nf * -2.12194440e-4f;  /* ln2, low bits */
    vf p = splat(1.0f / 720);
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return select_v(in == in, p * (vf)((n + 127) << 23), in); /* NaN stays NaN */
}

/* ------------------------------------------------------------------ packed_linear
 *
 * y[M, N] = x[M, K] @ W^T + bias for the small M of decode steps, where a general GEMM packs
 * W on every call and reaches half the memory bandwidth. W is packed once, at load time, into
 * strips of 16 output columns, [N / 16][K][16], so each strip is one contiguous stream that
 * vector registers multiply by broadcast elements of x. A micro-tile is ROWS rows x 2 vectors
 * of columns (2 strips with 16 lanes, the two halves of one strip with 8): 2 ROWS
 * accumulators, 2 weight loads and ROWS broadcasts per k. A tile's weight panel stays in L2
 * while every row tile of x passes over it, so each weight is read from memory once per call
 * whatever M is; it is prefetched 4 KiB ahead, past the panel's end into the next one, which
 * this thread takes next (about 15 % faster at decode sizes than the hardware alone).
 */
#define STRIP 16 /* output columns per packed strip, whatever LANES is */
#define TILE_COLS (2 * LANES)
#define ROWS (LANES == 16 ? 8 : 6) /* 2 ROWS accumulators fit the register file */
#define PREFETCH_ROWS 64

typedef struct {
    const float *x;    /* rows of this tile, row stride K */
    const float *w;    /* the tile's first strip, [K][16] */
    const float *bias; /* bias of the tile's first column, or NULL */
    float *y;          /* output of the tile, row stride N */
    long K, N;
} Tile;

/* Where vector j of the tile's columns sits in row k of the packed weight. */
static inline const float *weight_at(const Tile *t, long j, long k) {
    long col = j * LANES;
    return t->w + (col / STRIP) * t->K * STRIP + k * STRIP + col % STRIP;
}

/* rows x (vecs * LANES) outputs; rows and vecs are constants after inlining. */
static inline __attribute__((always_inline)) void micro_tile(const Tile t, const long rows,
                                                             const long vecs) {
    vf acc[ROWS][2];
    for (long j = 0; j < vecs; j++) {
        vf init = t.bias ? load(t.bias + j * LANES) : splat(0.0f);
        for (long i = 0; i < rows; i++) acc[i][j] = init;
    }
    for (long k = 0; k < t.K; k++) {
        vf b[2];
        for (long j = 0; j < vecs; j++) {
            __builtin_prefetch(weight_at(&t, j, k + PREFETCH_ROWS), 0, 3);
            b[j] = load(weight_at(&t, j, k));
        }
        for (long i = 0; i < rows; i++) {
            vf xv = splat(t.x[i * t.K + k]);
            for (long j = 0; j < vecs; j++) acc[i][j] += xv * b[j];
        }
    }
    for (long i = 0; i < rows; i++)
        for (long j = 0; j < vecs; j++) store(t.y + i * t.N + j * LANES, acc[i][j]);
}

/* One switch so that every (rows, vecs) pair gets its own fully unrolled body. */
static void run_tile(const Tile t, long rows, long vecs) {
#define CASE(R)                                 \
    case R:                                     \
        if (vecs == 2) micro_tile(t, R, 2);     \
        else micro_tile(t, R, 1);               \
        break;
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#if ROWS > 6
        CASE(7) CASE(8)
#endif
    }
#undef CASE
}

/* x [M, K] and y [M, N] row-major and contiguous; wp [N / 16][K][16]; N % 16 == 0. */
void packed_linear(const float *x, long M, long K, const float *wp, long N, const float *bias,
                   float *y, int num_threads) {
    long num_tiles = (N + TILE_COLS - 1) / TILE_COLS; /* the last may be half wide */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long p = 0; p < num_tiles; p++) {
        long col = p * TILE_COLS;
        long vecs = N - col >= TILE_COLS ? 2 : 1;
        for (long m = 0; m < M; m += ROWS) {
            Tile t = {x + m * K, wp + col * K, bias ? bias + col : 0, y + m * N + col, K, N};
            run_tile(t, M - m < ROWS ? M - m : ROWS, vecs);
        }
    }
}

/* ------------------------------------------------------------------ paged decode attention
 *
 * One query token per request over its paged context, read in place from the KV cache: no
 * gathered copy of K and V, no padding. Per block of the cache, scores for all query heads
 * come first, then an online softmax (running max and sum) folds the block's values into the
 * accumulators. A query head reads the K/V of its KV head (GQA). D % 16 == 0.
 */

static inline float dot(const float *a, const float *b, long D) {
    vf s = splat(0.0f);
    for (long d = 0; d < D; d += LANES) s += load(a + d) * load(b + d);
    return sum_lanes(s);
}

/* s[0:n] -> exp(s - max) in place; returns their sum. */
static inline float softmax_weights(float *s, long n, float max) {
    vf sum = splat(0.0f);
    long i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf p = exp_v(load(s + i) - max);
        store(s + i, p);
        sum += p;
    }
    float total = sum_lanes(sum);
    for (; i < n; i++) total += (s[i] = expf(s[i] - max));
    return total;
}

static inline float max_of(const float *s, long n) {
    float m = -INFINITY;
    for (long i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}

typedef struct {
    const float *cache; /* [num_blocks, 2, block_size, KV, D] */
    const int *table;   /* this request's blocks */
    long seq_len, block_size, KV, D, G;
    float scale;
} DecodeTask;

/* Query heads of KV heads [h0, h1) of one request; q and out point at the request's [H, D]. */
static void decode_heads(const DecodeTask t, long h0, long h1, const float *q, float *out) {
    const long G = t.G, D = t.D, bs = t.block_size, row = t.KV * t.D;
    const long first = h0 * G, count = (h1 - h0) * G; /* query heads handled here */
    /* On the heap: H x block_size floats can outgrow a worker thread's stack. */
    float *scores = malloc(count * bs * sizeof(float)), run_max[count], run_sum[count];
    for (long j = 0; j < count; j++) {
        run_max[j] = -INFINITY;
        run_sum[j] = 0.0f;
        memset(out + (first + j) * D, 0, D * sizeof(float));
    }
    for (long start = 0; start < t.seq_len; start += bs) {
        long n = t.seq_len - start < bs ? t.seq_len - start : bs;
        const float *keys = t.cache + (long)t.table[start / bs] * 2 * bs * row;
        const float *values = keys + bs * row;
        if (start + bs < t.seq_len) { /* the next block's K and V, while this one computes */
            const float *next = t.cache + (long)t.table[start / bs + 1] * 2 * bs * row;
            for (long off = 0; off < 2 * bs * row; off += 16) __builtin_prefetch(next + off, 0, 3);
        }
        /* Row by row, every KV head in turn: the block's K rows are read as whole lines. */
        for (long i = 0; i < n; i++)
            for (long j = 0; j < count; j++) {
                long head = first + j;
                scores[j * bs + i] = dot(q + head * D, keys + i * row + head / G * D, D) * t.scale;
            }
        for (long j = 0; j < count; j++) {
            long head = first + j;
            float *s = scores + j * bs, *acc = out + head * D;
            const float *v = values + head / G * D;
            float block_max = max_of(s, n);
            float new_max = block_max > run_max[j] ? block_max : run_max[j];
            /* Earlier blocks' sums and accumulators, rescaled to the new max. */
            float keep = run_max[j] == -INFINITY ? 0.0f : expf(run_max[j] - new_max);
            run_sum[j] = run_sum[j] * keep + softmax_weights(s, n, new_max);
            run_max[j] = new_max;
            for (long d = 0; d < D; d += LANES) store(acc + d, load(acc + d) * keep);
            for (long i = 0; i < n; i++)
                for (long d = 0; d < D; d += LANES)
                    store(acc + d, load(acc + d) + s[i] * load(v + i * row + d));
        }
    }
    for (long j = 0; j < count; j++) {
        float inv = t.seq_len > 0 ? 1.0f / run_sum[j] : 0.0f;
        for (long d = 0; d < D; d++) out[(first + j) * D + d] *= inv;
    }
    free(scores);
}

/* q, out [B, H, D]; tables [B, table_width] int32; seq_lens [B] int32; H % KV == 0. A work
 * item is a whole request when there are enough to keep every thread busy (its block rows are
 * then read whole, once), else one (request, KV head). */
void paged_decode_attention(const float *q, const float *cache, const int *tables,
                            long table_width, const int *seq_lens, long B, long H, long KV,
                            long D, long block_size, float scale, float *out, int num_threads) {
    const long G = H / KV;
    const long splits = B >= 2 * num_threads ? 1 : KV; /* KV heads split this many ways */
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (long item = 0; item < B * splits; item++) {
        long b = item / splits, part = item % splits;
        long h0 = part * KV / splits, h1 = (part + 1) * KV / splits;
        DecodeTask t = {cache, tables + b * table_width, seq_lens[b], block_size, KV, D, G, scale};
        decode_heads(t, h0, h1, q + b * H * D, out + b * H * D);
    }
}

/* ------------------------------------------------------------------ small fused ops
 *
 * Each replaces several torch ops (and their dispatch, which at decode sizes costs more than
 * the arithmetic). Rows are independent and split across threads.
 */

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)), the order of Hugging Face's RMSNorm.
 * dim % 16 == 0. */
void rms_norm(const float *x, long rows, long dim, const float *weight, float eps, float *out,
              int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        vf squares = splat(0.0f);
        for (long d = 0; d < dim; d += LANES) squares += load(xr + d) * load(xr + d);
        float inv = 1.0f / sqrtf(sum_lanes(squares) / dim + eps);
        for (long d = 0; d < dim; d += LANES)
            store(out + r * dim + d, load(weight + d) * (load(xr + d) * inv));
    }
}

/* out = silu(gate) * up = gate / (1 + exp(-gate)) * up, all [n] contiguous. */
void silu_mul(const float *gate, const float *up, long n, float *out, int num_threads) {
    long full = n / LANES * LANES;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n > 65536)
    for (long i = 0; i < full; i += LANES) {
        vf g = load(gate + i);
        store(out + i, g / (1.0f + exp_v(-g)) * load(up + i));
    }
    for (long i = full; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* Rotate-half rotary embedding of x [tokens, heads, dim] by cos/sin [tokens, dim / 2] into out:
 * out = (x1 cos - x2 sin, x2 cos + x1 sin) for the halves x1, x2. dim % 32 == 0. */
void rotary(const float *x, long tokens, long heads, long dim, const float *cos,
            const float *sin, float *out, int num_threads) {
    const long half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens > 8)
    for (long t = 0; t < tokens; t++) {
        for (long h = 0; h < heads; h++) {
            const float *x1 = x + (t * heads + h) * dim, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * dim, *o2 = o1 + half;
            for (long d = 0; d < half; d += LANES) {
                vf c = load(cos + t * half + d), s = load(sin + t * half + d);
                vf a = load(x1 + d), b = load(x2 + d);
                store(o1 + d, a * c - b * s);
                store(o2 + d, b * c + a * s);
            }
        }
    }
}
