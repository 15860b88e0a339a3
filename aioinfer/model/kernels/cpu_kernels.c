/* Native float32 kernels for the CPU path (x86-64 with AVX-512F), loaded with ctypes.
 *
 * Built on first use by aioinfer/model/kernels/cpu_native.py with
 *   cc -O3 -march=native -fopenmp -shared -fPIC
 * The OpenMP runtime resolves to the libgomp that torch has already loaded, so these kernels
 * and torch's own ops share one thread team per calling thread.
 *
 * Two kernels, each documented above its code: packed_linear and paged_decode_attention.
 *
 * packed_linear: y[M, N] = x[M, K] @ W^T + bias for the small M of decode steps, where a
 * general GEMM packs W on every call and reaches half the memory bandwidth. W is packed once,
 * at load time, into strips of 16 output columns, [N / 16][K][16], so each strip is one
 * contiguous stream that a 16-lane register multiplies by broadcast elements of x. A micro-tile
 * is up to 8 rows x 2 strips: 16 accumulators, 2 weight loads and 8 broadcasts per k. The
 * strip pair's panel (K x 32 floats) stays in L2 while every row tile of x passes over it, so
 * each weight is read from memory once per call whatever M is.
 */
#include <immintrin.h>
#include <math.h>

#define STRIP 16 /* output columns per strip: one 512-bit register of float32 */
#define ROWS 8   /* rows of x per micro-tile */
#define PREFETCH_ROWS 64 /* k rows of a strip (64 B each) to prefetch ahead */

typedef struct {
    const float *x;    /* rows of this tile, row stride K */
    const float *w0;   /* first strip of the pair, [K][16] */
    const float *bias; /* bias of the first strip, or NULL */
    float *y;          /* output of the tile, row stride N */
    long K, N;
} Tile;

/* rows x (strips * 16) outputs; rows and strips are compile-time constants after inlining. */
static inline __attribute__((always_inline)) void micro_tile(const Tile t, const long rows,
                                                             const long strips) {
    __m512 acc[ROWS][2];
    for (long s = 0; s < strips; s++) {
        __m512 init = t.bias ? _mm512_loadu_ps(t.bias + s * STRIP) : _mm512_setzero_ps();
        for (long i = 0; i < rows; i++) acc[i][s] = init;
    }
    const float *w1 = t.w0 + t.K * STRIP;
    for (long k = 0; k < t.K; k++) {
        /* 4 KiB ahead in each strip stream (past a panel's end: the next panel, which this
         * thread takes next); about 15% faster at decode sizes than the hardware prefetcher. */
        _mm_prefetch((const char *)(t.w0 + (k + PREFETCH_ROWS) * STRIP), _MM_HINT_T0);
        if (strips == 2) _mm_prefetch((const char *)(w1 + (k + PREFETCH_ROWS) * STRIP), _MM_HINT_T0);
        __m512 b0 = _mm512_loadu_ps(t.w0 + k * STRIP);
        __m512 b1 = strips == 2 ? _mm512_loadu_ps(w1 + k * STRIP) : b0;
        for (long i = 0; i < rows; i++) {
            __m512 xv = _mm512_set1_ps(t.x[i * t.K + k]);
            acc[i][0] = _mm512_fmadd_ps(xv, b0, acc[i][0]);
            if (strips == 2) acc[i][1] = _mm512_fmadd_ps(xv, b1, acc[i][1]);
        }
    }
    for (long i = 0; i < rows; i++)
        for (long s = 0; s < strips; s++) _mm512_storeu_ps(t.y + i * t.N + s * STRIP, acc[i][s]);
}

/* One switch so that every (rows, strips) pair gets its own fully unrolled body. */
static void run_tile(const Tile t, long rows, long strips) {
#define CASE(R)                                          \
    case R:                                              \
        if (strips == 2) micro_tile(t, R, 2);            \
        else micro_tile(t, R, 1);                        \
        break;
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    }
#undef CASE
}

/* x [M, K] and y [M, N] row-major and contiguous; wp [N / 16][K][16]; N % 16 == 0. */
void packed_linear(const float *x, long M, long K, const float *wp, long N, const float *bias,
                   float *y, int num_threads) {
    long num_strips = N / STRIP;
    long num_pairs = (num_strips + 1) / 2; /* the last "pair" is a single strip when odd */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long p = 0; p < num_pairs; p++) {
        long s = 2 * p;
        long strips = s + 1 < num_strips ? 2 : 1;
        for (long m = 0; m < M; m += ROWS) {
            Tile t = {x + m * K, wp + s * K * STRIP, bias ? bias + s * STRIP : 0,
                      y + m * N + s * STRIP, K, N};
            run_tile(t, M - m < ROWS ? M - m : ROWS, strips);
        }
    }
}

/* ------------------------------------------------------------------ paged decode attention
 *
 * One query token per request over its paged context, read in place from the KV cache: no
 * gathered copy of K and V, no padding. One work item is one (request, KV head): its G = H / KV
 * query heads share every key and value row they load (GQA). Per block of the cache, scores
 * for all G heads come first, then an online softmax (running max and sum) folds the block's
 * values into the accumulators. D % 16 == 0.
 */

static inline float dot16(const float *a, const float *b, long D) {
    __m512 s = _mm512_setzero_ps();
    for (long d = 0; d < D; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), s);
    return _mm512_reduce_add_ps(s);
}

/* exp of 16 lanes, within about 2 ulp of expf for x in [-87, 88]: x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, times 2^n. The scalar expf was
 * most of this kernel's time. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2, high bits */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);     /* ln2, low bits */
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first_lanes(long n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

typedef struct {
    const float *cache;  /* [num_blocks, 2, block_size, KV, D] */
    const int *table;    /* this request's blocks */
    long seq_len, block_size, KV, D, G;
    float scale;
} DecodeTask;

/* Softmax weights of one block's n scores, in place, given the running max; returns their sum. */
static inline float block_weights(float *s, long n, float max) {
    __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(max);
    for (long c = 0; c < n; c += 16) {
        __mmask16 lanes = first_lanes(n - c);
        __m512 p = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + c), m)));
        _mm512_mask_storeu_ps(s + c, lanes, p);
        sum = _mm512_add_ps(sum, p);
    }
    return _mm512_reduce_add_ps(sum);
}

static inline float block_max(const float *s, long n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (long c = 0; c < n; c += 16)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(n - c), s + c));
    return _mm512_reduce_max_ps(m);
}

/* Query heads of KV heads [h0, h1) of one request; q and out point at the request's [H, D]. */
static void decode_heads(const DecodeTask t, long h0, long h1, const float *q, float *out) {
    const long G = t.G, D = t.D, bs = t.block_size, row = t.KV * t.D;
    const long first = h0 * G, count = (h1 - h0) * G; /* query heads handled here */
    float scores[count * bs], run_max[count], run_sum[count];
    for (long j = 0; j < count; j++) {
        run_max[j] = -INFINITY;
        run_sum[j] = 0.0f;
        for (long d = 0; d < D; d++) out[(first + j) * D + d] = 0.0f;
    }
    for (long start = 0; start < t.seq_len; start += bs) {
        long n = t.seq_len - start < bs ? t.seq_len - start : bs;
        const float *keys = t.cache + (long)t.table[start / bs] * 2 * bs * row;
        const float *values = keys + bs * row;
        /* Row by row, every KV head in turn: the block's K rows are read as whole lines. */
        for (long i = 0; i < n; i++)
            for (long j = 0; j < count; j++) {
                long head = first + j;
                scores[j * bs + i] = dot16(q + head * D, keys + i * row + head / G * D, D) * t.scale;
            }
        for (long j = 0; j < count; j++) {
            long head = first + j;
            float *s = scores + j * bs, *acc = out + head * D;
            const float *v = values + head / G * D;
            float bmax = block_max(s, n);
            float new_max = bmax > run_max[j] ? bmax : run_max[j];
            /* Earlier blocks' sums and accumulators, rescaled to the new max. */
            float keep = run_max[j] == -INFINITY ? 0.0f : expf(run_max[j] - new_max);
            run_sum[j] = run_sum[j] * keep + block_weights(s, n, new_max);
            run_max[j] = new_max;
            for (long d = 0; d < D; d += 16)
                _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_set1_ps(keep), _mm512_loadu_ps(acc + d)));
            for (long i = 0; i < n; i++) {
                __m512 p = _mm512_set1_ps(s[i]);
                for (long d = 0; d < D; d += 16)
                    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(p, _mm512_loadu_ps(v + i * row + d),
                                                              _mm512_loadu_ps(acc + d)));
            }
        }
    }
    for (long j = 0; j < count; j++) {
        float inv = t.seq_len > 0 ? 1.0f / run_sum[j] : 0.0f;
        for (long d = 0; d < D; d++) out[(first + j) * D + d] *= inv;
    }
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
 * the arithmetic). Rows are independent and split across threads. dim % 16 == 0.
 */

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)), the order of Hugging Face's RMSNorm. */
void rms_norm(const float *x, long rows, long dim, const float *weight, float eps, float *out,
              int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        __m512 ss = _mm512_setzero_ps();
        for (long d = 0; d < dim; d += 16) {
            __m512 v = _mm512_loadu_ps(xr + d);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / dim + eps));
        for (long d = 0; d < dim; d += 16)
            _mm512_storeu_ps(out + r * dim + d, _mm512_mul_ps(_mm512_loadu_ps(weight + d),
                                                              _mm512_mul_ps(_mm512_loadu_ps(xr + d), inv)));
    }
}

/* out = silu(gate) * up, all [n] contiguous. */
void silu_mul(const float *gate, const float *up, long n, float *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n > 65536)
    for (long i = 0; i < n; i += 16) {
        __mmask16 lanes = first_lanes(n - i);
        __m512 x = _mm512_maskz_loadu_ps(lanes, gate + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(out + i, lanes, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(lanes, up + i)));
    }
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
            for (long d = 0; d < half; d += 16) {
                __m512 c = _mm512_loadu_ps(cos + t * half + d), s = _mm512_loadu_ps(sin + t * half + d);
                __m512 a = _mm512_loadu_ps(x1 + d), b = _mm512_loadu_ps(x2 + d);
                _mm512_storeu_ps(o1 + d, _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)));
                _mm512_storeu_ps(o2 + d, _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s)));
            }
        }
    }
}
