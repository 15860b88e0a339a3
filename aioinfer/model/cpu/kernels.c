/* Native float32 kernels for the CPU path, loaded with ctypes by kernels.py.
 *
 * Built on first use by aioinfer/model/cpu/kernels.py with
 *   cc -O3 -march=native -fopenmp -shared -fPIC -lm -mprefer-vector-width=512
 * Written with GCC vector extensions, so one source compiles to AVX-512 (16 lanes) or to
 * AVX2 + FMA (8 lanes); `a += x * b` on vectors becomes a fused multiply-add. The OpenMP
 * runtime resolves to the libgomp that torch has already loaded, so these kernels and torch's
 * own ops share one thread team per calling thread.
 *
 * Kernels: packed_linear, paged_decode_attention, paged_prefill_attention, rms_norm, silu_mul,
 * rotary, and decoder_layers, which runs them as a model's decoder layers; the sampler's
 * top_p_thresholds, race_argmax, apply_token_bitmask and greedy_head (the exact argmax of an
 * LM head, where the CPU has AVX512-BF16); each documented above its code.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
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

/* Gemma 2's soft cap of attention scores, cap * tanh(s / cap), or s itself when cap <= 0:
 * tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates to +-1 where exp_v clamps. Apply it before
 * masking: a capped -inf is -cap. */
static inline vf soft_cap(vf s, float cap) {
    if (cap <= 0.0f) return s;
    vf e = exp_v(s * (2.0f / cap));
    return (1.0f - 2.0f / (e + 1.0f)) * cap;
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
/* 2 ROWS accumulators, 2 weight vectors and a broadcast fit the register file (32 zmm, 16
 * ymm). The more rows share each weight load, the less compute is left for the rows past the
 * first tile, which find the weights in L2 while the memory stream waits: 14 rows instead of
 * 8 took a 16-row decode's linears from 31 to 26 ms. */
#ifndef ROWS
#define ROWS (LANES == 16 ? 14 : 6)
#endif
#define PREFETCH_ROWS 64

typedef struct {
    const float *x;    /* rows of this tile, row stride K */
    const float *w;    /* the tile's first column in its packed strip ([K][16] per strip) */
    const float *up;   /* gated tile: the up projection's same column, or NULL */
    const float *bias; /* bias of the tile's first column, or NULL */
    const float *up_bias;
    float *y;          /* output of the tile, row stride N */
    long K, N;
    int accumulate;    /* add to y (a residual) instead of overwriting it */
    /* A coded weight (see Weight) instead of w and up: the tile's first column in its strip of
     * codes, and in its strip of scales. */
    const signed char *codes, *up_codes;
    const float *scales, *up_scales;
} Tile;

/* A linear weight [N, K] packed for these kernels, in one or both of two forms:
 * - strips: float32 [N / 16][K][16];
 * - codes: signed bytes [N / 16][K][16], and scales: float32 [N / 16][K / 32][2][16], the
 *   scale and offset of each column's runs of 32 k, so that weight = code * scale + offset
 *   (an offset of -0.0 keeps the sign of a zero weight d * 0 with d < 0). The loader
 *   codes a weight only where that rebuilds every float32 weight bit for bit (it does for the
 *   blocks of GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K), and code * scale is exact,
 *   so the FMAs below see the same floats as from strips: the same results, from 1.25 bytes a
 *   weight instead of 4. Decoding costs a convert and an FMA per weight vector: where a step's
 *   rows are few the memory it saves wins (batch-1 linears 1.8-2.7x faster, 8 rows 1.1-1.3x,
 *   16 rows in one transposed tile about 1.15x), at 17 to 20 rows the two forms are even, and
 *   from about 32 rows the FMA units are the limit and strips are faster by 5-10 %; with both
 *   forms each step takes the faster. */
typedef struct {
    const float *strips;
    const signed char *codes;
    const float *scales;
    long amx; /* with codes: steps of many rows read them on AMX (see AMX linears) */
    /* With codes on AMX, or NULL: each code * scale as two bfloat16 parts, and the offsets as
     * runs after K, for the steps of many rows (see "AMX linears from weight parts"). */
    const unsigned short *parts;
} Weight;
#define CODE_BLOCK 32

static inline vi load_codes(const signed char *p) { /* LANES bytes, sign-extended */
#if LANES == 16
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

/* LANES weights of row k of a strip of codes; scales: the strip's scales at the same lane. */
static inline vf decode_weights(const signed char *codes, const float *scales, long k) {
    const float *block = scales + (k / CODE_BLOCK) * 2 * STRIP;
    return __builtin_convertvector(load_codes(codes + k * STRIP), vf) * load(block) +
           load(block + STRIP);
}

/* The packed weight of column `col`, row 0 ([N / 16][K][16] strips). */
static inline const float *strip_column(const float *wp, long K, long col) {
    return wp + (col / STRIP) * K * STRIP + col % STRIP;
}

/* Where vector j of the tile's columns sits in row k of the packed weight; in a gated tile,
 * vector 0 is the gate's LANES columns and vector 1 the up projection's same columns. */
static inline const float *weight_at(const Tile *t, long j, long k, const int gated) {
    if (gated) return (j ? t->up : t->w) + k * STRIP;
    long col = j * LANES;
    return t->w + (col / STRIP) * t->K * STRIP + k * STRIP + col % STRIP;
}

/* The same for a coded tile: where its vector j's codes and scales start. */
static inline const signed char *codes_at(const Tile *t, long j, const int gated) {
    if (gated) return j ? t->up_codes : t->codes;
    long col = j * LANES;
    return t->codes + (col / STRIP) * t->K * STRIP + col % STRIP;
}
static inline const float *scales_at(const Tile *t, long j, const int gated) {
    if (gated) return j ? t->up_scales : t->scales;
    long col = j * LANES;
    return t->scales + (col / STRIP) * (t->K / CODE_BLOCK) * 2 * STRIP + col % STRIP;
}

static inline vf silu_times(vf gate, vf up) { return gate / (1.0f + exp_v(-gate)) * up; }

/* rows x (vecs * LANES) outputs, or, gated, rows x LANES outputs silu(gate) * up; rows, vecs
 * and gated are constants after inlining. */
static inline __attribute__((always_inline)) void micro_tile(const Tile t, const long rows,
                                                             const long vecs, const int gated,
                                                             const int coded) {
    vf acc[ROWS][2];
    for (long j = 0; j < vecs; j++) {
        const float *bias = gated && j ? t.up_bias : t.bias;
        vf init = bias ? load(bias + (gated ? 0 : j * LANES)) : splat(0.0f);
        for (long i = 0; i < rows; i++) acc[i][j] = init;
    }
    const signed char *codes[2] = {0, 0};
    const float *scales[2] = {0, 0};
    for (long j = 0; coded && j < vecs; j++) {
        codes[j] = codes_at(&t, j, gated);
        scales[j] = scales_at(&t, j, gated);
    }
    for (long k = 0; k < t.K; k++) {
        vf b[2];
        for (long j = 0; j < vecs; j++) {
            if (coded) {
                __builtin_prefetch(codes[j] + (k + PREFETCH_ROWS) * STRIP, 0, 3);
                b[j] = decode_weights(codes[j], scales[j], k);
            } else {
                __builtin_prefetch(weight_at(&t, j, k + PREFETCH_ROWS, gated), 0, 3);
                b[j] = load(weight_at(&t, j, k, gated));
            }
        }
        for (long i = 0; i < rows; i++) {
            vf xv = splat(t.x[i * t.K + k]);
            for (long j = 0; j < vecs; j++) acc[i][j] += xv * b[j];
        }
    }
    if (gated) { /* the same sums and expression as a separate silu_mul: identical results */
        for (long i = 0; i < rows; i++) store(t.y + i * t.N, silu_times(acc[i][0], acc[i][1]));
        return;
    }
    /* The residual is added last: summed into from the start, it would round every product
     * to its (larger) magnitude. */
    for (long i = 0; i < rows; i++)
        for (long j = 0; j < vecs; j++) {
            float *out = t.y + i * t.N + j * LANES;
            store(out, t.accumulate ? load(out) + acc[i][j] : acc[i][j]);
        }
}

/* One switch so that every (rows, vecs, gated) case gets its own fully unrolled body. */
static void run_tile(const Tile t, long rows, long vecs) {
#define CASE(R)                                                 \
    case R:                                                     \
        if (t.codes) {                                          \
            if (t.up_codes) micro_tile(t, R, 2, 1, 1);          \
            else if (vecs == 2) micro_tile(t, R, 2, 0, 1);      \
            else micro_tile(t, R, 1, 0, 1);                     \
        } else if (t.up) micro_tile(t, R, 2, 1, 0);             \
        else if (vecs == 2) micro_tile(t, R, 2, 0, 0);          \
        else micro_tile(t, R, 1, 0, 0);                         \
        break;
    switch (rows) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#if ROWS > 6
        CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14)
#endif
    }
#undef CASE
}

/* Rows of x taken per pass over the weights, as floats: a block of x (512 KiB) stays in L2 while
 * every tile of the weights passes over it. Without it a long prefill streams all of x from
 * L3 once per 32 columns (about 10 % slower at 2048 rows); decode steps fit in one block. */
#define ROW_BLOCK_FLOATS (128 * 1024)

/* A weight with both forms is read from its codes where a row block is one row tile (each
 * weight decoded once), else from its strips: at 16 to 20 rows the two measured the same, the
 * second row tile decoding every weight again. A weight with codes alone decodes them in
 * registers, in every row tile, for row blocks of at most DECODE_IN_REGISTERS_ROWS rows, and
 * larger blocks decode each tile's weights once into a float32 panel that their row tiles then
 * read as strips (in registers, the linears of a 128-row prefill ran 7-12 % slower than from
 * strips; through the panel, 1-10 %; a 16-row decode step through the panel about 20 %). */
#define DECODE_IN_REGISTERS_ROWS (2 * ROWS)

/* The float32 weights of a coded tile, written where the same tile from strips reads them. */
static void decode_tile(const Tile *coded, long vecs, int gated, const Tile *panel) {
    for (long j = 0; j < vecs; j++) {
        const signed char *codes = codes_at(coded, j, gated);
        const float *scales = scales_at(coded, j, gated);
        for (long k = 0; k < coded->K; k++) {
            __builtin_prefetch(codes + (k + 4 * PREFETCH_ROWS) * STRIP, 0, 3);
            store((float *)weight_at(panel, j, k, gated), decode_weights(codes, scales, k));
        }
    }
}

/* Coded weights over a step of 15 or 16 rows (concurrency 16's decode steps), with 16 lanes:
 * 14 + 2 rows as above decode every weight twice and leave the second tile's FMAs starved,
 * and the strips' memory stream is the limit (a 16-row step reads 4 bytes a weight). Here
 * one tile takes all 16 rows and one strip: 16 accumulators, one decode per weight vector, and
 * x transposed into [K][16] so that the 16 broadcasts of each k come from one pointer with
 * constant offsets (x's 16 row pointers would not fit the general registers). The same FMAs
 * in the same order as the other tiles: bit-equal results. On two Zen 4 cores, SmolLM2's 30
 * layers of linears over 16 rows, one after another, took 20.4 ms (167 GFLOP/s) against 23.4
 * as 14 + 2 from codes and 25-33 from strips; a 16-sequence decode step 29-31 ms against 34. */
#if LANES == 16
#define T_ROWS 16
#define T_MIN_ROWS (ROWS + 1)

/* Rows [0, rows) of x [rows, K] as xt [K][T_ROWS], the missing rows zero. */
static void transpose_rows(const float *x, long rows, long K, float *xt) {
    for (long k = 0; k < K; k++)
        for (long i = 0; i < T_ROWS; i++) xt[k * T_ROWS + i] = i < rows ? x[i * K + k] : 0.0f;
}

/* The sums of one strip of codes (strip-aligned codes and scales) over the 16 rows of xt,
 * from init: acc[i] = init + sum over k of xt[k][i] * weight[k]. */
static inline __attribute__((always_inline)) void transposed_sums(const float *xt, long K,
                                                                  const signed char *codes,
                                                                  const float *scales,
                                                                  vf init, vf acc[T_ROWS]) {
    for (long i = 0; i < T_ROWS; i++) acc[i] = init;
    for (long k = 0; k < K; k++) {
        __builtin_prefetch(codes + (k + PREFETCH_ROWS) * STRIP, 0, 3);
        const vf b = decode_weights(codes, scales, k);
        const float *xk = xt + k * T_ROWS;
        for (long i = 0; i < T_ROWS; i++) acc[i] += splat(xk[i]) * b;
    }
}

/* Tile t's rows x 16 columns (strip-aligned: t.codes and t.scales at lane 0), as micro_tile
 * writes them, from the first `rows` rows of xt. */
static void transposed_tile(const Tile t, const float *xt, long rows) {
    vf acc[T_ROWS];
    transposed_sums(xt, t.K, t.codes, t.scales, t.bias ? load(t.bias) : splat(0.0f), acc);
    if (t.up_codes) { /* the gate's sums wait on the stack while the up projection's run */
        vf up[T_ROWS];
        transposed_sums(xt, t.K, t.up_codes, t.up_scales,
                        t.up_bias ? load(t.up_bias) : splat(0.0f), up);
        for (long i = 0; i < rows; i++) store(t.y + i * t.N, silu_times(acc[i], up[i]));
        return;
    }
    for (long i = 0; i < rows; i++) {
        float *out = t.y + i * t.N;
        store(out, t.accumulate ? load(out) + acc[i] : acc[i]);
    }
}

#endif

/* ------------------------------------------------------------------ AMX linears
 *
 * Where the CPU has AMX (Intel Sapphire Rapids and later), a coded weight's linears over many
 * rows run on the tile unit, whose bfloat16 dot products (TDPBF16PS: a 16 x 32 by 32 x 16
 * product into 16 x 16 float32 sums) are about 10x the FMA units' float32 rate, and still
 * give float32 results:
 * - the codes (integers in [-128, 127]) are bfloat16s exactly, converted run by run into the
 *   instruction's second operand (codes_to_tile);
 * - each row of x is split into three bfloat16 parts, x = hi + mid + lo exactly (each part
 *   what the parts before it left, truncated: 8 significant bits apiece, 24 in all);
 * - a product of two bfloat16s is exact in float32, and the unit adds the products in float32:
 *   sum(x c) over a run of 32 k is hi c + mid c + lo c summed in float32, as an FMA chain
 *   would sum x c, and then y += scale * that + offset * sum(x), per run, on the vector units.
 * Against a float64 reference the results are as close as the FMA path's (fewer additions in
 * each chain), but not the same bits: the order of the additions differs. Steps of few rows
 * keep the FMA path (a tile's 16 rows would be mostly padding), so results depend on the
 * step's row count, as with any GEMM that picks its kernel by shape.
 * Tiles: 0-3 the sums of 2 row tiles x 2 column strips, 4-5 the row tiles' parts of x, 6-7
 * the strips' codes. Each run's sums go through memory to be scaled into float32
 * accumulators that stay in L1. The scaling is the price of codes with a scale per run: a
 * 64-row linear with it took 1.4-1.7x as long as the same tile work without it, the vector
 * units' work adding to the tile unit's rather than overlapping it (software pipelining the
 * scaling one run behind made no difference). SmolLM2's linears run 1.5-2x faster than on
 * the FMA units at 16 to 4096 rows. Steps of 128 rows or more over weights that also have
 * parts skip the scaling (see "AMX linears from weight parts", below).
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && LANES == 16
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define AMX_ROWS 16           /* rows of a tile */
#define AMX_MIN_ROWS (ROWS + 1) /* steps of one FMA row tile keep the codes' FMA path */
#define AMX_BLOCK_BYTES (512 * 1024) /* x's parts taken per pass over the weights, as in L2 */

/* Columns of x's parts for K: K, then the sum of each run of 32 of the row, zeros up to a whole
 * run (the offsets' columns of weight parts, see "AMX linears from weight parts"). */
static long split_cols(long K) {
    const long runs = K / CODE_BLOCK;
    return K + (runs + CODE_BLOCK - 1) / CODE_BLOCK * CODE_BLOCK;
}

/* x [M, K] as AMX linears read it: parts [3][rows][cols] bfloat16 (rows = M rounded up to a
 * tile, the padding zero; cols = split_cols(K)) and sums [rows][K / 32], the float32 sum of
 * each run of 32. */
typedef struct {
    const unsigned short *parts;
    const float *sums;
    long rows, cols;
} SplitRows;

/* Floats of scratch that split_rows needs for M rows of K. */
static long split_floats(long M, long K) {
    long rows = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    return rows * split_cols(K) * 3 / 2 + rows * (K / CODE_BLOCK) + 16; /* and a flag */
}

/* Rows whose values reach past these stay on the FMA path (see split_rows). */
#define AMX_LARGEST 0x1p100f
#define AMX_SMALLEST 0x1p-100f

#ifdef HAVE_AMX
typedef struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} TileConfig;

/* Whether AMX linears can run here: the OS must grant the process the tile data state. */
int amx_available(void) {
    static int state = -1; /* unknown, 0 no, 1 yes; asked once, before any thread uses tiles */
    if (state < 0) {
        enum { REQ_XCOMP_PERM = 0x1023, XTILEDATA = 18 };
        state = syscall(SYS_arch_prctl, REQ_XCOMP_PERM, XTILEDATA) == 0;
    }
    return state;
}

static void configure_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&config);
}

/* The mask of the first n of 16 lanes (none for n <= 0). */
static inline unsigned run_lanes(long n) { return n <= 0 ? 0 : n >= 16 ? 0xFFFFu : (1u << n) - 1; }

/* Inside a parallel region (ends with its barrier): x [M, K] into `buffer`
 * (split_floats(M, K) floats) as AMX linears read it; 0 where a row cannot go to AMX, and x
 * must stay on the FMA path: a value beyond AMX_LARGEST (a run's sum of codes times x would
 * overflow float32 before its scale brings it down; infinities would meet codes of 0), NaN,
 * or a row whose largest value is below AMX_SMALLEST but not 0 (the tile unit flushes
 * subnormal parts, which would be all of such a row's lowest). */
static int split_rows(const float *x, long M, long K, float *buffer, SplitRows *s) {
    const long runs = K / CODE_BLOCK, cols = split_cols(K);
    s->rows = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    s->cols = cols;
    unsigned short *parts = (unsigned short *)buffer;
    float *sums = buffer + s->rows * cols * 3 / 2;
    int *unfit = (int *)(sums + s->rows * runs); /* shared by the team */
    s->parts = parts;
    s->sums = sums;
#pragma omp single
    *unfit = 0;
    /* The part is the top 16 bits of what the parts before it left: a float truncated to a
     * bfloat16. Of x's 24 significant bits, each part takes the first 8 left, and the
     * subtraction is exact, so the third takes the last of them whole. */
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512i odd_halves; /* 16-bit lanes 1, 3, .., 31 of a, then of b */
    for (int i = 0; i < 32; i++) ((short *)&odd_halves)[i] = (short)(2 * i + 1);
#pragma omp for schedule(static)
    for (long m = 0; m < s->rows; m++) {
        vf largest = splat(0.0f);
        vi nan = {0};
        float *row_sums = sums + m * runs;
        for (long k = 0; k < cols; k += CODE_BLOCK) { /* x's runs, then their sums' */
            __m512 a = _mm512_setzero_ps(), b = a;
            if (k < K) {
                if (m < M) {
                    a = _mm512_loadu_ps(x + m * K + k);
                    b = _mm512_loadu_ps(x + m * K + k + 16);
                    largest = max_v(largest, max_v(_mm512_abs_ps(a), _mm512_abs_ps(b)));
                    nan |= (a != a) | (b != b);
                }
                row_sums[k / CODE_BLOCK] = sum_lanes(a + b); /* 0 in padding rows */
            } else if (m < M) {
                const __mmask16 lanes_a = _cvtu32_mask16(run_lanes(runs - (k - K)));
                const __mmask16 lanes_b = _cvtu32_mask16(run_lanes(runs - (k - K) - 16));
                a = _mm512_maskz_loadu_ps(lanes_a, row_sums + (k - K));
                b = _mm512_maskz_loadu_ps(lanes_b, row_sums + (k - K) + 16);
            }
            for (long p = 0; p < 3; p++) {
                __m512i part = _mm512_permutex2var_epi16((__m512i)a, odd_halves, (__m512i)b);
                _mm512_storeu_si512(parts + (p * s->rows + m) * cols + k, part);
                a -= (__m512)((__m512i)a & top);
                b -= (__m512)((__m512i)b & top);
            }
        }
        float row_max = 0.0f;
        int any_nan = 0;
        for (int i = 0; i < LANES; i++) {
            any_nan |= nan[i];
            row_max = largest[i] > row_max ? largest[i] : row_max;
        }
        if (any_nan || row_max > AMX_LARGEST || (row_max > 0.0f && row_max < AMX_SMALLEST)) {
#pragma omp atomic write
            *unfit = 1;
        }
    }
    return !*unfit; /* after the loop's barrier: every thread reads the same */
}

/* Run `run` of a strip of codes (32 rows of k, 16 codes each) as the instruction's second
 * operand, in `tile`: bfloat16 [16][16][2], lane c of pair p holding the codes of k = 2p and
 * 2p + 1 of column c, each the top half of the code as a float32 (exact: 8 bits). Converted
 * from the byte codes for every pass of a row block, not kept as bfloat16 tiles beside them:
 * half the bytes to read, which made a 64-row linear 5-10 % faster, and no memory besides the
 * codes. */
static inline void codes_to_tile(const signed char *codes, long run, unsigned short *tile) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    const signed char *k = codes + run * CODE_BLOCK * STRIP;
    for (long pair = 0; pair < 16; pair++, k += 2 * STRIP) {
        __m512i even = (__m512i)_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)k)));
        __m512i odd = (__m512i)_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(k + STRIP))));
        _mm512_store_si512(tile + pair * 32, (odd & high) | _mm512_srli_epi32(even, 16));
    }
}

/* One AMX tile job: rows [m0, m1) of the split x (a row block) against 1 or 2 strips of codes
 * (2: columns col .. col + 32, or, gated, the gate's and the up projection's 16). */
typedef struct {
    const SplitRows *x;
    long K, N, M, m0, m1;
    const signed char *codes[2];
    const float *scales[2], *bias[2];
    float *y;
    int accumulate;
} AmxTile;

#define AMX_BLOCK_ROWS 128 /* the most rows of a row block: their sums stay in L1 (16 KiB) */

/* acc [rows][32] += each column's scale * the run's sums c [row tile][strip][16][16] + its
 * offset * the row's sum over the run, for the row_tiles tiles from row r. */
static inline __attribute__((always_inline)) void scale_run(float (*acc)[32],
                                                            float (*c)[2][16][16],
                                                            const AmxTile *t, long run, long r,
                                                            const long row_tiles,
                                                            const long strips) {
    const long runs = t->K / CODE_BLOCK;
    for (long j = 0; j < strips; j++) {
        const float *block = t->scales[j] + run * 2 * STRIP;
        vf scale = load(block), offset = load(block + STRIP);
        for (long i = 0; i < row_tiles * AMX_ROWS; i++) {
            vf sum = splat(t->x->sums[(r + i) * runs + run]);
            float *out = acc[r - t->m0 + i] + j * STRIP;
            store(out, load(out) + load(c[i / AMX_ROWS][j][i % AMX_ROWS]) * scale + sum * offset);
        }
    }
}

/* Run by run, the run's codes converted once for every row tile of the block. */
static inline __attribute__((always_inline)) void amx_tile(const AmxTile *t, const long strips,
                                                           const int gated) {
    float acc[AMX_BLOCK_ROWS][32] __attribute__((aligned(64)));
    float c[2][2][16][16] __attribute__((aligned(64)));
    unsigned short tiles[2][512] __attribute__((aligned(64)));
    const long K = t->K, rows = t->x->rows, cols = t->x->cols;
    for (long j = 0; j < strips; j++) {
        vf init = t->bias[j] ? load(t->bias[j]) : splat(0.0f);
        for (long i = 0; i < t->m1 - t->m0; i++) store(acc[i] + j * STRIP, init);
    }
    for (long run = 0; run < K / CODE_BLOCK; run++) {
        for (long j = 0; j < strips; j++) {
            /* the codes of two runs on: 8-15 % at decode sizes, where they come from memory */
            for (long line = 0; line < 8; line++)
                _mm_prefetch((const char *)(t->codes[j] + (run + 2) * 512 + line * 64),
                             _MM_HINT_T0);
            codes_to_tile(t->codes[j], run, tiles[j]);
        }
        /* tile numbers must be constants: 0-3 sums, 4-5 x, 6-7 codes */
        _tile_loadd(6, tiles[0], 64);
        if (strips == 2) _tile_loadd(7, tiles[1], 64);
        for (long r = t->m0; r < t->m1; r += 2 * AMX_ROWS) {
            const unsigned short *a = t->x->parts + r * cols + run * CODE_BLOCK;
            const int two = t->m1 - r > AMX_ROWS; /* row tiles from r: 2, or the last 1 */
            _tile_zero(0);
            if (strips == 2) _tile_zero(1);
            if (two) {
                _tile_zero(2);
                if (strips == 2) _tile_zero(3);
            }
            for (long p = 0; p < 3; p++) {
                const unsigned short *part = a + p * rows * cols;
                _tile_loadd(4, part, cols * 2);
                _tile_dpbf16ps(0, 4, 6);
                if (strips == 2) _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, part + AMX_ROWS * cols, cols * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (strips == 2) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0][0], 64);
            if (strips == 2) _tile_stored(1, c[0][1], 64);
            if (two) {
                _tile_stored(2, c[1][0], 64);
                if (strips == 2) _tile_stored(3, c[1][1], 64);
                scale_run(acc, c, t, run, r, 2, strips);
            } else {
                scale_run(acc, c, t, run, r, 1, strips);
            }
        }
    }
    for (long i = t->m0; i < t->m1 && i < t->M; i++) {
        float *out = t->y + i * t->N, *sums = acc[i - t->m0];
        if (gated) { /* as micro_tile's epilogue */
            store(out, silu_times(load(sums), load(sums + STRIP)));
            continue;
        }
        for (long j = 0; j < strips; j++) {
            vf sum = load(sums + j * STRIP);
            store(out + j * STRIP, t->accumulate ? load(out + j * STRIP) + sum : sum);
        }
    }
}

/* linear_tiles' AMX path (see there); x split by split_rows. */
static void amx_linear_tiles(const SplitRows *x, long M, long K, const Weight *w, long N,
                             const float *bias, const Weight *up, const float *up_bias,
                             float *y, int accumulate) {
    const int gated = up != 0;
    const long tile_cols = gated ? STRIP : 2 * STRIP;
    const long num_tiles = (N + tile_cols - 1) / tile_cols; /* the last may be half wide */
    const long runs = K / CODE_BLOCK;
    long block = AMX_BLOCK_BYTES / (x->cols * 6) / (2 * AMX_ROWS) * (2 * AMX_ROWS);
    block = block < 2 * AMX_ROWS ? 2 * AMX_ROWS : block > AMX_BLOCK_ROWS ? AMX_BLOCK_ROWS : block;
    configure_tiles();
    for (long m0 = 0; m0 < x->rows; m0 += block) {
#pragma omp for schedule(static) nowait
        for (long p = 0; p < num_tiles; p++) {
            long col = p * tile_cols, strip = col / STRIP;
            long strips = gated || N - col >= 2 * STRIP ? 2 : 1;
            AmxTile t = {.x = x, .K = K, .N = N, .M = M, .m0 = m0, .y = y + col,
                         .m1 = m0 + block < x->rows ? m0 + block : x->rows,
                         .accumulate = accumulate};
            for (long j = 0; j < strips; j++) { /* gated: the gate's strip, then up's */
                const Weight *wj = gated && j ? up : w;
                const float *bj = gated && j ? up_bias : bias;
                long s = gated ? strip : strip + j;
                t.codes[j] = wj->codes + s * K * STRIP;
                t.scales[j] = wj->scales + s * runs * 2 * STRIP;
                t.bias[j] = bj ? bj + s * STRIP : 0;
            }
            if (strips == 2) amx_tile(&t, 2, gated);
            else amx_tile(&t, 1, 0);
        }
    }
    _tile_release();
}

/* ------------------------------------------------------------------ AMX linears from weight parts
 *
 * For steps of many rows, a coded weight can also be held as parts: each code * scale (exact
 * in float32) as two bfloat16s, hi + lo exactly, which holds where it has at most 16
 * significant bits, as a float16 scale times a code of up to 5 bits has (GGUF's Q4_0, Q4_1,
 * Q5_0 and Q5_1). The offsets follow as extra runs: offset * the run's sum of x is one more
 * product of x's split columns (split_cols) with the weight's. Then no run needs its own
 * scaling: the tile unit sums every run of a column in its float32 accumulators, five
 * products a multiply-add (x's three parts times hi, its first two times lo; the sixth, lo
 * times lo, is below 2^-24 of the product and dropped), against three and a per-run scaling
 * for the codes (above). Over SmolLM2's linears: at 4096 rows 1.2-1.5x faster; at 128-256
 * rows 1.1x; at 64 rows 1.1-1.4x alone but no faster in the engine's decode steps, whose
 * parts (4 bytes a weight) come from memory every step beside the KV cache; hence steps of
 * AMX_PARTS_MIN_ROWS and more. Against float64 the error is an FMA chain's (one accumulator
 * over K): 1-2e-7 of sum |x w| on plain inputs, up to 1.1e-6 where x spans 2^-20 .. 2^20.
 * The parts take 4 bytes a weight besides the codes, as float32 strips would.
 * Layout: [N / 16][split_cols(K) / 32][2][16][16][2] bfloat16, per strip and run the hi tile
 * then the lo tile, each as codes_to_tile lays out a run. Tiles: 0-3 the sums of 4 row tiles
 * of one strip, 4-5 x's parts, 6-7 the weight's hi and lo. */
#define AMX_PARTS_MIN_ROWS 128
#define AMX_PARTS_GROUP (4 * AMX_ROWS) /* rows of the 4 tiles of sums */

/* Tile C += x's three parts of row tile T times the weight's hi (tile 6), and its first two
 * parts times lo (tile 7); a0: part 0 of the row tiles' run, parts `part` apart. */
#define PARTS_PRODUCTS(C, T)                                                                    \
    do {                                                                                        \
        const unsigned short *a = a0 + (T) * AMX_ROWS * cols;                                  \
        _tile_loadd(4, a, cols * 2);                                                            \
        _tile_dpbf16ps(C, 4, 6);                                                                \
        _tile_dpbf16ps(C, 4, 7);                                                                \
        _tile_loadd(5, a + part, cols * 2);                                                     \
        _tile_dpbf16ps(C, 5, 6);                                                                \
        _tile_dpbf16ps(C, 5, 7);                                                                \
        _tile_loadd(4, a + 2 * part, cols * 2);                                                 \
        _tile_dpbf16ps(C, 4, 6);                                                                \
    } while (0)

/* sums [4][16][16] = rows [r, r + 16 * tiles) of x times the strip of weight parts w. */
static inline void parts_group(const SplitRows *x, long r, long tiles, const unsigned short *w,
                               float (*sums)[16][16]) {
    const long cols = x->cols, part = x->rows * cols;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long run = 0; run < cols / CODE_BLOCK; run++) {
        const unsigned short *b = w + run * 1024; /* hi tile, then lo */
        for (long line = 0; line < 32; line++) /* 4 runs on, into L2: 10-20 % at 64 rows */
            _mm_prefetch((const char *)(b + 4 * 1024 + line * 32), _MM_HINT_T1);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        const unsigned short *a0 = x->parts + r * cols + run * CODE_BLOCK;
        PARTS_PRODUCTS(0, 0);
        if (tiles > 1) PARTS_PRODUCTS(1, 1);
        if (tiles > 2) PARTS_PRODUCTS(2, 2);
        if (tiles > 3) PARTS_PRODUCTS(3, 3);
    }
    _tile_stored(0, sums[0], 64);
    if (tiles > 1) _tile_stored(1, sums[1], 64);
    if (tiles > 2) _tile_stored(2, sums[2], 64);
    if (tiles > 3) _tile_stored(3, sums[3], 64);
}

/* linear_tiles' path for weights with parts (see there): groups of 64 rows, each over every
 * strip (the weight's parts stay in L2 or L3 between groups). */
static void amx_parts_linear_tiles(const SplitRows *x, long M, const Weight *w, long N,
                                   const float *bias, const Weight *up, const float *up_bias,
                                   float *y, int accumulate) {
    const long strip_parts = x->cols / CODE_BLOCK * 1024; /* bfloat16s a strip */
    float sums[4][16][16] __attribute__((aligned(64)));
    float up_sums[4][16][16] __attribute__((aligned(64)));
    configure_tiles();
    for (long r = 0; r < x->rows; r += AMX_PARTS_GROUP) {
        const long tiles = (x->rows - r) / AMX_ROWS < 4 ? (x->rows - r) / AMX_ROWS : 4;
#pragma omp for schedule(static) nowait
        for (long s = 0; s < N / STRIP; s++) {
            parts_group(x, r, tiles, w->parts + s * strip_parts, sums);
            if (up) parts_group(x, r, tiles, up->parts + s * strip_parts, up_sums);
            const vf b = bias ? load(bias + s * STRIP) : splat(0.0f);
            const vf ub = up && up_bias ? load(up_bias + s * STRIP) : splat(0.0f);
            for (long i = 0; i < tiles * AMX_ROWS && r + i < M; i++) {
                float *out = y + (r + i) * N + s * STRIP;
                vf sum = load(sums[i / AMX_ROWS][i % AMX_ROWS]) + b;
                if (up) sum = silu_times(sum, load(up_sums[i / AMX_ROWS][i % AMX_ROWS]) + ub);
                store(out, accumulate ? load(out) + sum : sum);
            }
        }
    }
    _tile_release();
}
#else
int amx_available(void) { return 0; }
#endif

/* The tiles of one linear, shared out among the threads of the enclosing parallel region
 * without a barrier at the end, so several linears of one input run back to back.
 * x [M, K] and y [M, N] row-major and contiguous; N % 16 == 0, and K % 32 == 0 for a coded
 * weight. With `up` (packed in the same form as w, with its bias up_bias), y [M, N] =
 * silu(x W^T + bias) * (x Wup^T + up_bias): the MLP's gate and up projections and their
 * activation, without writing either. */
static void linear_tiles(const float *x, long M, long K, const Weight *w, long N,
                         const float *bias, const Weight *up, const float *up_bias, float *y,
                         int accumulate, const SplitRows *split) {
#ifdef HAVE_AMX
    if (split && w->parts && M >= AMX_PARTS_MIN_ROWS && (!up || up->parts)) {
        amx_parts_linear_tiles(split, M, w, N, bias, up, up_bias, y, accumulate);
        return;
    }
    if (split && w->amx) {
        amx_linear_tiles(split, M, K, w, N, bias, up, up_bias, y, accumulate);
        return;
    }
#endif
    const int gated = up != 0;
    const long tile_cols = gated ? LANES : TILE_COLS;
    long num_tiles = (N + tile_cols - 1) / tile_cols; /* the last may be half wide */
    long block = ROW_BLOCK_FLOATS / K / ROWS * ROWS;
    if (block < ROWS) block = ROWS;
    /* This thread's panel (2 K x 16 floats), allocated on first use, freed at the end; without
     * one (out of memory) the tiles decode in registers. */
    float *panel = 0;
    int panel_tried = 0;
    for (long m0 = 0; m0 < M; m0 += block) {
        long m1 = m0 + block < M ? m0 + block : M;
        /* x's rows transposed for transposed_tile (K x 64 bytes), or NULL: each thread its
         * own copy (about 1 us at K = 576, 3 at 1536), so that none waits for another */
        float *xt = 0;
#if LANES == 16
        if (w->codes && (!gated || up->codes) && m1 - m0 >= T_MIN_ROWS && m1 - m0 <= T_ROWS) {
            xt = aligned_alloc(64, K * T_ROWS * sizeof(float));
            if (xt) transpose_rows(x + m0 * K, m1 - m0, K, xt);
        }
#endif
        int coded = w->codes && (!w->strips || m1 - m0 <= ROWS || xt);
        int use_panel = coded && m1 - m0 > DECODE_IN_REGISTERS_ROWS;
#pragma omp for schedule(static) nowait
        for (long p = 0; p < num_tiles; p++) {
            long col = p * tile_cols;
            long vecs = gated || N - col >= TILE_COLS ? 2 : 1;
            Tile t = {.bias = bias ? bias + col : 0, .up_bias = up_bias ? up_bias + col : 0,
                      .K = K, .N = N, .accumulate = accumulate};
            if (!coded) {
                t.w = strip_column(w->strips, K, col);
                t.up = gated ? strip_column(up->strips, K, col) : 0;
            } else {
                long strip = col / STRIP, lane = col % STRIP;
                t.codes = w->codes + strip * K * STRIP + lane;
                t.scales = w->scales + strip * (K / CODE_BLOCK) * 2 * STRIP + lane;
                if (gated) {
                    t.up_codes = up->codes + strip * K * STRIP + lane;
                    t.up_scales = up->scales + strip * (K / CODE_BLOCK) * 2 * STRIP + lane;
                }
                if (use_panel && !panel_tried) {
                    panel = aligned_alloc(64, 2 * K * STRIP * sizeof(float)); /* K % 32 == 0 */
                    panel_tried = 1;
                }
                if (use_panel && panel) {
                    Tile decoded = t;
                    decoded.codes = decoded.up_codes = 0;
                    decoded.w = panel;
                    decoded.up = gated ? panel + K * STRIP : 0;
                    decode_tile(&t, vecs, gated, &decoded);
                    t = decoded;
                }
            }
#if LANES == 16
            if (xt) { /* coded, strip-aligned (col % 32 == 0 or gated col % 16 == 0) */
                t.y = y + m0 * N + col;
                for (long j = 0; j < (gated ? 1 : vecs); j++) {
                    Tile s = t;
                    s.codes += j * K * STRIP;
                    s.scales += j * (K / CODE_BLOCK) * 2 * STRIP;
                    s.bias = bias ? bias + col + j * STRIP : 0;
                    s.y += j * STRIP;
                    transposed_tile(s, xt, m1 - m0);
                }
                continue;
            }
#endif
            for (long m = m0; m < m1; m += ROWS) {
                t.x = x + m * K;
                t.y = y + m * N + col;
                run_tile(t, m1 - m < ROWS ? m1 - m : ROWS, vecs);
            }
        }
        free(xt);
    }
    free(panel);
}

/* Whether a linear of w over M rows runs on AMX (see AMX linears). */
static int takes_amx(const Weight *w, long M) {
#ifdef HAVE_AMX
    return w->amx && M >= AMX_MIN_ROWS && amx_available(); /* asked at load: cached */
#else
    (void)w, (void)M;
    return 0;
#endif
}

/* Inside a parallel region: x split into `buffer` for the AMX linears of weights w (a
 * DecoderLayer's linears of one input: the first one whose weight takes AMX decides), or NULL
 * where none does. */
static const SplitRows *split_for(const float *x, long M, long K, const Weight *const *w,
                                  long count, float *buffer, SplitRows *split) {
#ifdef HAVE_AMX
    for (long i = 0; i < count; i++)
        if (takes_amx(w[i], M)) return split_rows(x, M, K, buffer, split) ? split : 0;
#else
    (void)x, (void)M, (void)K, (void)w, (void)count, (void)buffer, (void)split;
#endif
    return 0;
}

/* y = x @ W^T + bias (or += with accumulate), or the gated pass with up (see linear_tiles);
 * split_work: split_floats(M, K) floats of scratch for the AMX path, or NULL to allocate it. */
static void linear(const float *x, long M, long K, const Weight *w, long N, const float *bias,
                   const Weight *up, const float *up_bias, float *y, int accumulate,
                   float *split_work, int num_threads) {
    float *owned = 0;
    if (!split_work && takes_amx(w, M)) split_work = owned = malloc(split_floats(M, K) * 4);
#pragma omp parallel num_threads(num_threads)
    {
        SplitRows split;
        const Weight *ws[1] = {w};
        const SplitRows *s = split_work ? split_for(x, M, K, ws, 1, split_work, &split) : 0;
        linear_tiles(x, M, K, w, N, bias, up, up_bias, y, accumulate, s);
    }
    free(owned);
}

/* y = x @ W^T + bias, or y += x @ W^T + bias when accumulate is set. */
void packed_linear(const float *x, long M, long K, const Weight *w, long N, const float *bias,
                   float *y, int accumulate, int num_threads) {
    linear(x, M, K, w, N, bias, 0, 0, y, accumulate, 0, num_threads);
}

/* The codes of `runs` runs of CODE_BLOCK weights under a scale and an offset per run (see Weight):
 * each code the integer nearest (w - offset) / scale, in [-128, 127]; fits[r] = 1 where the codes
 * rebuild run r bit for bit as the linears decode them (code * scale + offset, with code *
 * scale exact: a scale of at most 17 significant bits, as a float16 times a K-quant's 6-bit
 * sub-block scale has, times a code of 7 bits and a sign). The loader's check, in one pass:
 * torch took ten over the weights, a second at start for 135M weights. */
void code_runs(const float *w, long runs, const float *scale, const float *offset,
               signed char *codes, unsigned char *fits, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long r = 0; r < runs; r++) {
        const float s = scale[r], o = offset[r], divisor = s == 0.0f ? 1.0f : s;
        unsigned bits;
        memcpy(&bits, &s, sizeof bits);
        int fit = (bits & 0x7F) == 0;
        for (long i = r * CODE_BLOCK; i < (r + 1) * CODE_BLOCK; i++) {
            float code = rintf((w[i] - o) / divisor); /* to even on ties, as torch.round */
            code = code >= -128.0f ? (code <= 127.0f ? code : 127.0f) : -128.0f; /* NaN too */
            codes[i] = (signed char)code;
            /* From the stored byte, as the linears decode it: a code of -0.0 becomes +0.0. */
            const float rebuilt = (float)codes[i] * s + o;
            unsigned a, b;
            memcpy(&a, &rebuilt, sizeof a);
            memcpy(&b, &w[i], sizeof b);
            fit &= a == b;
        }
        fits[r] = (unsigned char)fit;
    }
}

/* A coded weight's parts (see "AMX linears from weight parts"): codes [strips][K][16] and
 * scales [strips][K / 32][2][16] into parts [strips][split_cols(K) / 32][2][16][16][2]
 * (bfloat16 bit patterns). Returns 1 where every code * scale and offset is hi + lo exactly
 * with each part 0 or in [2^-100, 2^12], else 0 (parts then unusable). */
int weight_parts(const signed char *codes, const float *scales, long strips, long K,
                 unsigned short *parts, int num_threads) {
    const long runs = K / CODE_BLOCK, cols = split_cols(K);
    int fits = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(&& : fits)
    for (long s = 0; s < strips; s++) {
        for (long k = 0; k < cols; k++) {
            unsigned short *tile = parts + (s * (cols / CODE_BLOCK) + k / CODE_BLOCK) * 1024 +
                                   (k % CODE_BLOCK) / 2 * 32 + k % 2;
            for (long c = 0; c < STRIP; c++) {
                float value = 0.0f;
                if (k < K)
                    value = codes[(s * K + k) * STRIP + c] *
                            scales[((s * runs) + k / CODE_BLOCK) * 2 * STRIP + c];
                else if (k - K < runs)
                    value = scales[((s * runs) + (k - K)) * 2 * STRIP + STRIP + c];
                unsigned bits, lo_bits;
                memcpy(&bits, &value, 4);
                float hi, lo;
                unsigned hi_bits = bits & 0xFFFF0000u;
                memcpy(&hi, &hi_bits, 4);
                lo = value - hi; /* exact: what the truncation left */
                memcpy(&lo_bits, &lo, 4);
                const float a = fabsf(hi), b = fabsf(lo);
                fits = fits && !(lo_bits & 0xFFFFu) && (a == 0.0f || (a >= 0x1p-100f && a <= 0x1p12f)) &&
                       (b == 0.0f || b >= 0x1p-100f);
                tile[c * 2] = (unsigned short)(hi_bits >> 16);
                tile[512 + c * 2] = (unsigned short)(lo_bits >> 16);
            }
        }
    }
    return fits;
}

/* ------------------------------------------------------------------ paged decode attention
 *
 * One query token per request over its paged context, read in place from the KV cache: no
 * gathered copy of K and V, no padding. Block by block of the cache and head by head, the
 * scores of LANES keys at a time come first, then an online softmax (running max and sum)
 * folds the block's values into the head's accumulators. A query head reads the K/V of its KV
 * head (GQA). D % 16 == 0 and D <= 256; specialised for D = 64 and 128, where the query and the
 * accumulators stay in registers.
 */

#define MAX_HEAD_VECS (256 / LANES)

/* p[0..LANES) -> one vector whose lane i is the sum of p[i]'s lanes: a tree of half-swaps and
 * adds, about 3 operations a lane where a sum_lanes of each would take about 8. */
static inline vf sum_each(const vf *p) {
#define HALVES(a, b, ...)                                                                          \
    (__builtin_shufflevector(a, b, __VA_ARGS__))
#if LANES == 16
    vf r[8], s[4], t[2];
    for (int i = 0; i < 8; i++)
        r[i] = HALVES(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               HALVES(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                      30, 31);
    for (int i = 0; i < 4; i++)
        s[i] = HALVES(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               HALVES(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                      30, 31);
    for (int i = 0; i < 2; i++)
        t[i] = HALVES(s[2 * i], s[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               HALVES(s[2 * i], s[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                      30, 31);
    return HALVES(t[0], t[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           HALVES(t[0], t[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf r[4], s[2];
    for (int i = 0; i < 4; i++)
        r[i] = HALVES(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               HALVES(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        s[i] = HALVES(r[2 * i], r[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               HALVES(r[2 * i], r[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return HALVES(s[0], s[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           HALVES(s[0], s[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
#undef HALVES
}

static inline float max_lanes(vf v) { /* a tree of half swaps */
#if LANES == 16
    v = max_v(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = max_v(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = max_v(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = max_v(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
    v = max_v(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = max_v(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = max_v(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
    return v[0];
}

typedef struct {
    const float *cache; /* [num_blocks, 2, block_size, KV, D] */
    const int *table;   /* this request's blocks */
    long seq_len, block_size, KV, D, G;
    float scale, softcap; /* softcap: see soft_cap */
    long first_key;     /* keys before it are outside the sliding window */
    const float *after; /* the first block this thread reads after this task's, or NULL */
} DecodeTask;

/* scores[0:LANES) = soft_cap(scale * (q . k_i), cap) for the n <= LANES keys
 * k_i = keys + i * row, and -inf past n; q is in registers (nv vectors). Returns the vector of
 * scores. */
static inline __attribute__((always_inline)) vf key_scores(const vf *q, const float *keys,
                                                           long row, long n, long nv,
                                                           float scale, float cap) {
    vf part[LANES];
    for (long i = 0; i < LANES; i++) {
        vf acc = splat(0.0f);
        if (i < n)
            for (long v = 0; v < nv; v++) acc += q[v] * load(keys + i * row + v * LANES);
        part[i] = acc;
    }
    vf scores = soft_cap(sum_each(part) * splat(scale), cap);
    if (n < LANES) {
        vi lane;
        for (int i = 0; i < LANES; i++) lane[i] = i;
        scores = select_v(lane < (int)n, scores, splat(-INFINITY));
    }
    return scores;
}

/* Prefetch into L2 the lines [from, to) of the `lines` lines at p, or nothing if p is NULL. */
static inline void prefetch_share(const float *p, long lines, long from, long to) {
    if (p)
        for (long l = from; l < to && l < lines; l++) __builtin_prefetch(p + l * 16, 0, 1);
}

#define DECODE_CHUNK_KEYS 64 /* keys per online-softmax step, whole blocks */

/* Query heads of KV heads [h0, h1) of one request; q and out point at the request's [H, D].
 * Inlined with a constant D, the loops over D unroll and q and acc live in registers. The
 * context goes in chunks of whole blocks, about DECODE_CHUNK_KEYS keys, each in three passes
 * over the heads: scores, block by block; the softmax; values, block by block. The softmax's
 * max, exps and sums are a chain of dependent shuffles paid once per chunk: per block of 16
 * keys they were 40 % of the kernel's work on cached data. */
static inline __attribute__((always_inline)) void decode_heads_impl(const DecodeTask t, long h0,
                                                                    long h1, const float *q,
                                                                    float *out, const long D) {
    const long G = t.G, bs = t.block_size, row = t.KV * D, nv = D / LANES;
    const long first = h0 * G, count = (h1 - h0) * G; /* query heads handled here */
    const long padded = (bs + LANES - 1) / LANES * LANES;
    const long chunk_blocks = bs < DECODE_CHUNK_KEYS ? DECODE_CHUNK_KEYS / bs : 1;
    const long width = chunk_blocks * padded; /* a head's scores of one chunk */
    /* On the heap, as blocks can be larger than a worker thread's stack allows. */
    float *scores = malloc(count * width * sizeof(float)), run_max[count], run_sum[count];
    float keep[count];
    for (long j = 0; j < count; j++) {
        run_max[j] = -INFINITY;
        run_sum[j] = 0.0f;
        memset(out + (first + j) * D, 0, D * sizeof(float));
    }
    /* Each block's K, then V, and each pass reads the next in that order: what a pass reads
     * next is prefetched while it computes, a share per head (all at once and into L1, the
     * prefetches stalled on the line fill buffers). After the context's last V comes the
     * first block of the thread's next task. */
    const long half = bs * row / 16, share = (half + count - 1) / count; /* lines */
    const long num_blocks = (t.seq_len + bs - 1) / bs;
#define BLOCK_KEYS(c) (t.cache + (long)t.table[c] * 2 * bs * row)
    for (long c0 = t.first_key / bs; c0 < num_blocks; c0 += chunk_blocks) {
        const long c1 = c0 + chunk_blocks < num_blocks ? c0 + chunk_blocks : num_blocks;
        const long vecs = (c1 - c0) * padded / LANES; /* of each head's scores */
        for (long c = c0; c < c1; c++) {
            const long n = t.seq_len - c * bs < bs ? t.seq_len - c * bs : bs;
            const float *keys = BLOCK_KEYS(c);
            const float *next = c + 1 < c1 ? BLOCK_KEYS(c + 1) : BLOCK_KEYS(c0) + bs * row;
            for (long j = 0; j < count; j++) {
                long head = first + j;
                prefetch_share(next, half, j * share, (j + 1) * share);
                vf qv[MAX_HEAD_VECS];
                for (long v = 0; v < nv; v++) qv[v] = load(q + head * D + v * LANES);
                for (long i = 0; i * LANES < bs; i++) {
                    long rest = n - i * LANES;
                    vf s = rest > 0 ? key_scores(qv, keys + i * LANES * row + head / G * D, row,
                                                 rest < LANES ? rest : LANES, nv, t.scale,
                                                 t.softcap)
                                    : splat(-INFINITY);
                    const long key0 = c * bs + i * LANES; /* the window's first block */
                    if (key0 < t.first_key) {
                        vi lane;
                        for (int l = 0; l < LANES; l++) lane[l] = l;
                        s = select_v(lane + (int)key0 >= (int)t.first_key, s, splat(-INFINITY));
                    }
                    store(scores + j * width + (c - c0) * padded + i * LANES, s);
                }
            }
        }
        for (long j = 0; j < count; j++) {
            float *s = scores + j * width;
            vf m = load(s);
            for (long i = 1; i < vecs; i++) m = max_v(m, load(s + i * LANES));
            float chunk_max = max_lanes(m);
            float new_max = chunk_max > run_max[j] ? chunk_max : run_max[j];
            /* Earlier chunks' sums and accumulators, rescaled to the new max. */
            keep[j] = run_max[j] == -INFINITY ? 0.0f : expf(run_max[j] - new_max);
            vf sum = splat(0.0f);
            for (long i = 0; i < vecs; i++) {
                vf p = exp_v(load(s + i * LANES) - new_max);
                store(s + i * LANES, p);
                sum += p;
            }
            run_sum[j] = run_sum[j] * keep[j] + sum_lanes(sum);
            run_max[j] = new_max;
        }
        for (long c = c0; c < c1; c++) {
            const long n = t.seq_len - c * bs < bs ? t.seq_len - c * bs : bs;
            const float *values = BLOCK_KEYS(c) + bs * row;
            const float *next = c + 1 < c1          ? BLOCK_KEYS(c + 1) + bs * row
                                : c1 < num_blocks ? BLOCK_KEYS(c1)
                                                  : t.after;
            for (long j = 0; j < count; j++) {
                long head = first + j;
                const float *s = scores + j * width + (c - c0) * padded;
                const float *value = values + head / G * D;
                float *acc_out = out + head * D;
                prefetch_share(next, half, j * share, (j + 1) * share);
                const float scale = c == c0 ? keep[j] : 1.0f;
                vf acc[MAX_HEAD_VECS];
                for (long v = 0; v < nv; v++) acc[v] = load(acc_out + v * LANES) * scale;
                /* Keys before the window weigh exp(-87), not 0 (exp_v clamps): skip them. */
                for (long i = c * bs < t.first_key ? t.first_key - c * bs : 0; i < n; i++) {
                    vf p = splat(s[i]);
                    for (long v = 0; v < nv; v++) acc[v] += p * load(value + i * row + v * LANES);
                }
                for (long v = 0; v < nv; v++) store(acc_out + v * LANES, acc[v]);
            }
        }
    }
#undef BLOCK_KEYS
    for (long j = 0; j < count; j++) {
        float inv = t.seq_len > 0 ? 1.0f / run_sum[j] : 0.0f;
        for (long d = 0; d < D; d++) out[(first + j) * D + d] *= inv;
    }
    free(scores);
}

static void decode_heads(const DecodeTask t, long h0, long h1, const float *q, float *out) {
    if (t.D == 64)
        decode_heads_impl(t, h0, h1, q, out, 64);
    else if (t.D == 128)
        decode_heads_impl(t, h0, h1, q, out, 128);
    else
        decode_heads_impl(t, h0, h1, q, out, t.D);
}

/* q, out [B, H, D]; tables [B, table_width] int32; seq_lens [B] int32; H % KV == 0. A work
 * item is a whole request when there are enough to keep every thread busy (its block rows are
 * then read whole, once), else one (request, KV head). Each thread takes a contiguous run of
 * items with about its share of the context, so it knows which block it reads next at the end
 * of each item and prefetches it (a dynamic schedule cannot: 25.4 -> 21.1 ms above). */
void paged_decode_attention(const float *q, const float *cache, const int *tables,
                            long table_width, const int *seq_lens, long B, long H, long KV,
                            long D, long block_size, long window, float scale,
                            float softcap, float *out, int num_threads) {
    const long G = H / KV;
    const long splits = B >= 2 * num_threads ? 1 : KV; /* KV heads split this many ways */
    const long items = B * splits;
    /* The first key a request's query sees: a sliding window's keys only. */
#define FIRST_KEY(b) (window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0)
#define ITEM_COST(i) ((long)seq_lens[(i) / splits] - FIRST_KEY((i) / splits) + block_size)
    long total = 0;
    for (long i = 0; i < items; i++) total += ITEM_COST(i);
#pragma omp parallel num_threads(num_threads)
    {
        /* This thread's items [lo, hi): those whose middle falls in its share of the total. */
        const long T = omp_get_num_threads(), me = omp_get_thread_num();
        long lo = items, hi = items, before = 0;
        for (long i = 0; i < items; i++) {
            const long cost = ITEM_COST(i), owner = (2 * before + cost) * T / (2 * total);
            if (owner >= me && lo == items) lo = i;
            if (owner > me) {
                hi = i;
                break;
            }
            before += cost;
        }
        for (long item = lo; item < hi; item++) {
            long b = item / splits, part = item % splits;
            long h0 = part * KV / splits, h1 = (part + 1) * KV / splits;
            long following = (item + 1) / splits;
            const float *after =
                item + 1 < hi && seq_lens[following] > 0
                    ? cache + (long)tables[following * table_width +
                                           FIRST_KEY(following) / block_size] *
                                  2 * block_size * KV * D
                    : 0;
            DecodeTask t = {cache, tables + b * table_width, seq_lens[b], block_size, KV, D, G,
                            scale, softcap, FIRST_KEY(b), after};
            decode_heads(t, h0, h1, q + b * H * D, out + b * H * D);
        }
    }
#undef ITEM_COST
#undef FIRST_KEY
}

/* ------------------------------------------------------------------ paged prefill attention
 *
 * The query tokens of a request's chunk over its paged context, causal (the chunk's own K/V
 * already in the cache). A work item is one KV head of one request over up to PREFILL_TOKENS
 * of its queries: the rows (token, query head of the group) go through the context KEYS keys
 * at a time. The keys are transposed once per chunk into [D][KEYS], so each row's scores are
 * broadcast FMAs (no horizontal sums) and every key serves all the item's rows; then an online
 * softmax per row and the values, eight rows per pass over them. Against prompt tokens
 * attending one by one through the decode kernel (SmolLM2's shapes, one layer): a 1024-token
 * prompt 15.3-16.9 -> 7.6 ms, 32 prompts of 128 tokens 9.8-13.1 -> 5.8-6.6 ms (chunks of 16
 * keys instead of 32: 8.4-9.0 and 6.2-7.4 ms).
 */
#define PREFILL_TOKENS 64 /* query tokens per work item */
#define SCORE_ROWS 8      /* rows whose scores share each load of the transposed keys */
#define VALUE_ROWS 8      /* rows whose outputs share each load of a value row */
#define KEYS (2 * LANES)  /* keys per chunk: the softmax's per-row work is paid once per KEYS */

typedef struct {
    const float *cache; /* [num_blocks, 2, block_size, KV, D] */
    const int *table;   /* the request's blocks */
    const float *q;     /* the request's first query token, [tokens, H, D] */
    float *out;         /* the same rows of the output */
    long before;        /* context tokens before the chunk */
    long t0, t1;        /* the item's query tokens, within the chunk */
    long g;             /* its KV head */
    long H, KV, G, block_size;
    long window;        /* a query at position p sees keys p - window + 1 .. p, or all if 0 */
    float scale, softcap; /* softcap: see soft_cap */
} PrefillItem;

static inline __attribute__((always_inline)) void prefill_item_impl(const PrefillItem t,
                                                                    float *work, const long D) {
    const long G = t.G, rows = (t.t1 - t.t0) * G, row_stride = t.KV * D, bs = t.block_size;
    const long nv = D / LANES;
    /* Rows padded to whole tiles, so that every tile loop has constant trips and keeps its
     * accumulators in registers; the padding rows compute on copies of the last row and are
     * never written out. work: keys transposed [D][KEYS], the rows' queries [padded][D] (one
     * base pointer for a tile's rows: no pointer per row spilled from registers), probabilities
     * [padded][KEYS], outputs [padded][D], running max [padded], running sums [padded][LANES]
     * (lane by lane, summed once at the end). */
    const long padded = (rows + SCORE_ROWS - 1) / SCORE_ROWS * SCORE_ROWS;
    float *kt = work, *query = kt + D * KEYS, *prob = query + padded * D;
    float *acc = prob + padded * KEYS;
    float *run_max = acc + padded * D, *run_sum = run_max + padded;
    const float *vrow[KEYS];
    for (long r = 0; r < padded; r++) {
        long row = r < rows ? r : rows - 1;
        memcpy(query + r * D, t.q + ((t.t0 + row / G) * t.H + t.g * G + row % G) * D,
               D * sizeof(float));
        run_max[r] = -INFINITY;
    }
    memset(run_sum, 0, padded * LANES * sizeof(float));
    memset(acc, 0, padded * D * sizeof(float));
    vi lane;
    for (int i = 0; i < LANES; i++) lane[i] = i;
    const long last = t.before + t.t1 - 1; /* the last key any row reads */
    /* The first key any row reads: the window of the item's first token. */
    const long lowest = t.window > 0 && t.before + t.t0 >= t.window ? t.before + t.t0 - t.window + 1
                                                                     : 0;
    for (long start = lowest / KEYS * KEYS; start <= last; start += KEYS) {
        const long n = last + 1 - start < KEYS ? last + 1 - start : KEYS;
        for (long j = 0; j < KEYS; j++) {
            if (j < n) {
                long pos = start + j;
                const float *key = t.cache + ((long)t.table[pos / bs] * 2 * bs + pos % bs) *
                                                 row_stride + t.g * D;
                vrow[j] = key + bs * row_stride;
                for (long d = 0; d < D; d++) kt[d * KEYS + j] = key[d];
            } else {
                for (long d = 0; d < D; d++) kt[d * KEYS + j] = 0.0f;
            }
        }
        /* Rows whose token comes before this chunk of keys see none of it. */
        long first_token = start - t.before > t.t0 ? start - t.before : t.t0;
        const long r0 = (first_token - t.t0) * G;
        const long r_first = r0 / SCORE_ROWS * SCORE_ROWS;
        for (long r = r_first; r < rows; r += SCORE_ROWS) {
            const float *qr = query + r * D;
            vf s[SCORE_ROWS][2];
            for (long i = 0; i < SCORE_ROWS; i++) s[i][0] = s[i][1] = splat(0.0f);
            for (long d = 0; d < D; d++) {
                vf k0 = load(kt + d * KEYS), k1 = load(kt + d * KEYS + LANES);
                for (long i = 0; i < SCORE_ROWS; i++) {
                    vf b = splat(qr[i * D + d]);
                    s[i][0] += b * k0;
                    s[i][1] += b * k1;
                }
            }
            for (long i = 0; i < SCORE_ROWS; i++) {
                const long row = r + i;
                const long pos = t.before + t.t0 + (row < rows ? row : rows - 1) / G;
                const int lo = t.window > 0 ? (int)(pos - t.window + 1) : 0; /* its window */
                vi valid0 = (lane < (int)n) & (lane + (int)start <= (int)pos) &
                            (lane + (int)start >= lo);
                vi valid1 = (lane + LANES < (int)n) & (lane + (int)(start + LANES) <= (int)pos) &
                            (lane + (int)(start + LANES) >= lo);
                vf sc0 = select_v(valid0, soft_cap(s[i][0] * t.scale, t.softcap), splat(-INFINITY));
                vf sc1 = select_v(valid1, soft_cap(s[i][1] * t.scale, t.softcap), splat(-INFINITY));
                float block_max = max_lanes(max_v(sc0, sc1));
                float new_max = block_max > run_max[row] ? block_max : run_max[row];
                float keep = new_max == run_max[row]      ? 1.0f /* the usual case, once settled */
                             : run_max[row] == -INFINITY ? 0.0f
                                                         : expf(run_max[row] - new_max);
                vf p0 = select_v(valid0, exp_v(sc0 - new_max), splat(0.0f));
                vf p1 = select_v(valid1, exp_v(sc1 - new_max), splat(0.0f));
                store(run_sum + row * LANES, load(run_sum + row * LANES) * keep + (p0 + p1));
                run_max[row] = new_max;
                store(prob + row * KEYS, p0);
                store(prob + row * KEYS + LANES, p1);
                if (keep != 1.0f)
                    for (long v = 0; v < nv; v++)
                        store(acc + row * D + v * LANES, load(acc + row * D + v * LANES) * keep);
            }
        }
        for (long r = r_first; r < rows; r += VALUE_ROWS) {
            for (long v = 0; v < nv; v++) {
                vf o[VALUE_ROWS];
                for (long i = 0; i < VALUE_ROWS; i++) o[i] = load(acc + (r + i) * D + v * LANES);
                for (long j = 0; j < n; j++) {
                    vf value = load(vrow[j] + v * LANES);
                    for (long i = 0; i < VALUE_ROWS; i++)
                        o[i] += splat(prob[(r + i) * KEYS + j]) * value;
                }
                for (long i = 0; i < VALUE_ROWS; i++) store(acc + (r + i) * D + v * LANES, o[i]);
            }
        }
    }
    for (long row = 0; row < rows; row++) {
        float *o = t.out + ((t.t0 + row / G) * t.H + t.g * G + row % G) * D;
        /* key 0 is in every row's context: the sum is never 0 */
        float inv = 1.0f / sum_lanes(load(run_sum + row * LANES));
        for (long d = 0; d < D; d++) o[d] = acc[row * D + d] * inv;
    }
}

/* q, out [T, H, D] for the tokens of requests [first, last): request r owns tokens
 * [query_start[r], query_start[r + 1]) and its context after them is seq_lens[r] tokens, its
 * blocks tables[r] [table_width]. */
void paged_prefill_attention(const float *q, const float *cache, const int *tables,
                             long table_width, const int *query_start, const int *seq_lens,
                             long first, long last, long H, long KV, long D, long block_size,
                             long window, float scale, float softcap, float *out,
                             int num_threads) {
    const long G = H / KV;
    long num_items = 0;
    for (long r = first; r < last; r++) {
        long tokens = query_start[r + 1] - query_start[r];
        num_items += KV * ((tokens + PREFILL_TOKENS - 1) / PREFILL_TOKENS);
    }
    const long padded = (PREFILL_TOKENS * G + SCORE_ROWS - 1) / SCORE_ROWS * SCORE_ROWS;
    const long work_floats = D * KEYS + padded * (KEYS + LANES + 2 * D + 1);
#pragma omp parallel num_threads(num_threads)
    {
        float *work = malloc(work_floats * sizeof(float));
#pragma omp for schedule(dynamic)
        for (long item = 0; item < num_items; item++) {
            /* the item-th (request, token group, KV head), in request order */
            long r = first, rest = item;
            for (;; r++) {
                long tokens = query_start[r + 1] - query_start[r];
                long here = KV * ((tokens + PREFILL_TOKENS - 1) / PREFILL_TOKENS);
                if (rest < here) break;
                rest -= here;
            }
            const long tokens = query_start[r + 1] - query_start[r];
            const long group = rest / KV, t0 = group * PREFILL_TOKENS;
            PrefillItem t = {cache, tables + r * table_width, q + query_start[r] * H * D,
                             out + query_start[r] * H * D, seq_lens[r] - tokens, t0,
                             t0 + PREFILL_TOKENS < tokens ? t0 + PREFILL_TOKENS : tokens,
                             rest % KV, H, KV, G, block_size, window, scale, softcap};
            if (D == 64)
                prefill_item_impl(t, work, 64);
            else if (D == 128)
                prefill_item_impl(t, work, 128);
            else
                prefill_item_impl(t, work, D);
        }
        free(work);
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
        store(out + i, silu_times(load(gate + i), load(up + i)));
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

/* ------------------------------------------------------------------ decoder layer
 *
 * One Llama decoder layer over the T tokens of a step, in the order of model/llama.py's
 * modules, x [T, hidden] updated in place:
 *   h = rms_norm(x); q, k, v = h Wq, h Wk, h Wv (+ biases); per-head rms_norm of q and k
 *   (Qwen3); rotary(q, k); k, v into their cache slots; x += attention(q) Wo (+ bias);
 *   h = rms_norm(x); x += (silu(h Wgate) * h Wup) Wdown (+ biases).
 * One call instead of a dozen ops: at decode sizes the Python and dispatch between them cost
 * about as much as the attention itself. The three projections of h share one parallel
 * region, so no thread waits between them; the MLP's gate and up projections are one gated
 * pass whose tiles apply silu(gate) * up to their sums (a separate pass over both outputs was
 * 3 % of a prefill step).
 */
typedef struct {
    long hidden, heads, kv_heads, head_dim, intermediate;
    long window;          /* sliding window of the attention, or 0 */
    float eps, scale, softcap; /* softcap: of the attention scores, see soft_cap */
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], or both NULL */
    Weight q, k, v, o, gate, up, down;
    const float *q_bias, *k_bias, *v_bias, *o_bias, *gate_bias, *up_bias, *down_bias; /* or NULL */
} DecoderLayer;

/* The step's R requests: request r owns tokens [query_start[r], query_start[r + 1]) (int32,
 * query_start[R] = B), has seq_lens[r] tokens of context after them (int32) and its blocks in
 * tables[r] [table_width] (int32). Its first num_decodes requests have one token each and
 * attend through paged_decode_attention, the others' chunks through paged_prefill_attention;
 * all K/V of the step are stored before any token attends.
 * cache [num_blocks, 2, block_size, kv_heads, head_dim]; slots [B] int64 (block * block_size +
 * offset of each token); cos/sin [B, head_dim / 2]; work: decoder_layer_work_floats(l, B)
 * floats of scratch, reused across calls (a fresh allocation of that size page-faults every
 * call). Every width a multiple of 16, head_dim of 32. */
long decoder_layer_work_floats(const DecoderLayer *l, long B) {
    const long qn = l->heads * l->head_dim, kvn = l->kv_heads * l->head_dim;
    long widest = l->hidden > qn ? l->hidden : qn;
    widest = widest > l->intermediate ? widest : l->intermediate;
    const Weight *w[] = {&l->q, &l->k, &l->v, &l->o, &l->gate, &l->down};
    long split = 0; /* x split for AMX linears, where any takes them */
    for (long i = 0; i < 6; i++)
        if (takes_amx(w[i], B)) split = split_floats(B, widest);
    return B * (l->hidden + 2 * qn + 2 * kvn + l->intermediate) + split;
}

/* Row b of k and v [B, kvn] into slot slots[b] of the cache, the rows shared among the
 * threads: the first write to each page of the cache (mapped lazily, see the runner) faults,
 * and one thread alone spent 0.3 s of the 8192 prompt tokens of the offline benchmark here. */
static void store_kv(float *cache, const long *slots, const float *k, const float *v, long B,
                     long kvn, long block_size, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (long b = 0; b < B; b++) {
        long block = slots[b] / block_size, offset = slots[b] % block_size;
        float *key_row = cache + (block * 2 * block_size + offset) * kvn;
        memcpy(key_row, k + b * kvn, kvn * sizeof(float));
        memcpy(key_row + block_size * kvn, v + b * kvn, kvn * sizeof(float)); /* V half */
    }
}

static void decoder_layer(const DecoderLayer *l, float *x, long B, const float *cos,
                          const float *sin, float *cache, const long *slots, const int *tables,
                          long table_width, const int *query_start, const int *seq_lens,
                          long num_reqs, long num_decodes, long block_size, float *work,
                          int num_threads) {
    const long H = l->hidden, D = l->head_dim, I = l->intermediate;
    const long qn = l->heads * D, kvn = l->kv_heads * D;
    float *h = work;
    float *q = h + B * H, *k = q + B * qn, *v = k + B * kvn, *attn = v + B * kvn;
    float *act = attn + B * qn; /* silu(gate) * up */
    float *split_work = act + B * I; /* x split for AMX linears, if any takes them */

    rms_norm(x, B, H, l->input_norm, l->eps, h, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        SplitRows split;
        const Weight *qkv[] = {&l->q, &l->k, &l->v};
        const SplitRows *s = split_for(h, B, H, qkv, 3, split_work, &split);
        linear_tiles(h, B, H, &l->q, qn, l->q_bias, 0, 0, q, 0, s);
        linear_tiles(h, B, H, &l->k, kvn, l->k_bias, 0, 0, k, 0, s);
        linear_tiles(h, B, H, &l->v, kvn, l->v_bias, 0, 0, v, 0, s);
    }
    if (l->q_norm) {
        rms_norm(q, B * l->heads, D, l->q_norm, l->eps, q, num_threads);
        rms_norm(k, B * l->kv_heads, D, l->k_norm, l->eps, k, num_threads);
    }
    rotary(q, B, l->heads, D, cos, sin, q, num_threads);
    rotary(k, B, l->kv_heads, D, cos, sin, k, num_threads);
    store_kv(cache, slots, k, v, B, kvn, block_size, num_threads);
    if (num_decodes > 0)
        paged_decode_attention(q, cache, tables, table_width, seq_lens, num_decodes, l->heads,
                               l->kv_heads, D, block_size, l->window, l->scale, l->softcap,
                               attn, num_threads);
    if (num_decodes < num_reqs)
        paged_prefill_attention(q, cache, tables, table_width, query_start, seq_lens,
                                num_decodes, num_reqs, l->heads, l->kv_heads, D, block_size,
                                l->window, l->scale, l->softcap, attn, num_threads);
    linear(attn, B, qn, &l->o, H, l->o_bias, 0, 0, x, 1, split_work, num_threads);

    rms_norm(x, B, H, l->post_norm, l->eps, h, num_threads);
    linear(h, B, H, &l->gate, I, l->gate_bias, &l->up, l->up_bias, act, 0, split_work,
           num_threads);
    linear(act, B, I, &l->down, H, l->down_bias, 0, 0, x, 1, split_work, num_threads);
}

/* The decoder layers layers[0 .. num_layers) in turn, layer i with its own cache caches[i] and
 * the rest shared: a step's whole stack in one call. Called layer by layer from Python, the
 * interpreter ran between the layers on caches each layer's weights had just flushed, about
 * 90 us a layer: 2.7 ms of a 37 ms decode step of 16 sequences. */
void decoder_layers(const DecoderLayer *const *layers, float *const *caches, long num_layers,
                    float *x, long B, const float *cos, const float *sin, const long *slots,
                    const int *tables, long table_width, const int *query_start,
                    const int *seq_lens, long num_reqs, long num_decodes, long block_size,
                    float *work, int num_threads) {
    for (long i = 0; i < num_layers; i++)
        decoder_layer(layers[i], x, B, cos, sin, caches[i], slots, tables, table_width,
                      query_start, seq_lens, num_reqs, num_decodes, block_size, work,
                      num_threads);
}

/* ------------------------------------------------------------------ top-p threshold
 *
 * For each row of logits [rows, V] (-inf for tokens already removed), the smallest logit t such
 * that the tokens with logits above t hold less than top_p[r] of the row's probability: the
 * tokens with logit >= t are top_p's nucleus, ties included, as a descending sort, a cumulative
 * sum and a search would find it, without the sort (21 ms over 16 x 49152 on two cores; this
 * 0.9 ms). The row's weights exp(logit - max) go into NUCLEUS_BUCKETS buckets of equal logit
 * width below the max; the bucket where the cumulative weight from the top reaches top_p holds
 * the threshold (its largest token always has less than top_p above it), and a quickselect
 * over that bucket's (logit, weight) pairs, three-way partitioned around a median of three,
 * finds it. top_p >= 1 gives -inf (keep all), top_p <= 0 the row's largest logit.
 */
#define NUCLEUS_BUCKETS 4096
#define NUCLEUS_SPAN 32.0f /* logits further below the max share the last bucket */

static inline long nucleus_bucket(float max, float logit) {
    float b = (max - logit) * (NUCLEUS_BUCKETS / NUCLEUS_SPAN); /* inf for removed tokens */
    if (b >= 0 && b < NUCLEUS_BUCKETS - 1) return (long)b;
    return b < 0 ? 0 : NUCLEUS_BUCKETS - 1; /* NaN (a broken model's logits) last */
}

/* The threshold among the n candidates (values, weights), `above` (< target) being the weight
 * of every token above them; the largest candidate must have less than target above it. */
static float select_threshold(float *values, float *weights, long n, double above,
                              double target) {
    long lo = 0, hi = n;
    for (;;) {
        float a = values[lo], b = values[lo + (hi - lo) / 2], c = values[hi - 1];
        float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        /* [lo, gt) > pivot, [gt, i) == pivot, [lt, hi) < pivot */
        long gt = lo, i = lo, lt = hi;
        double greater = 0.0, equal = 0.0;
        while (i < lt) {
            float v = values[i], w = weights[i];
            if (v > pivot) {
                values[i] = values[gt], weights[i] = weights[gt];
                values[gt] = v, weights[gt] = w;
                gt++, i++;
                greater += w;
            } else if (v < pivot) {
                lt--;
                values[i] = values[lt], weights[i] = weights[lt];
                values[lt] = v, weights[lt] = w;
            } else {
                i++;
                equal += w;
            }
        }
        if (above + greater >= target) { /* the pivot's own mass above it is too much */
            hi = gt;
        } else if (lt == hi || above + greater + equal >= target) {
            return pivot;
        } else { /* a smaller logit still has less than target above it */
            above += greater + equal;
            lo = lt;
        }
    }
}

static float nucleus_threshold(const float *logits, long V, float top_p, float *values,
                               float *weights) {
    const long full = V / LANES * LANES;
    vf vmax = splat(-INFINITY);
    for (long i = 0; i < full; i += LANES) vmax = max_v(load(logits + i), vmax); /* NaN skipped */
    float max = max_lanes(vmax);
    for (long i = full; i < V; i++) max = logits[i] > max ? logits[i] : max;
    if (!(top_p < 1.0f) || max == -INFINITY) return -INFINITY;
    if (!(top_p > 0.0f)) return max;
    for (long i = 0; i < full; i += LANES) {
        vf l = load(logits + i); /* exp_v clamps -inf to exp(-87): mask the removed ones */
        store(weights + i, select_v(l > splat(-INFINITY), exp_v(l - max), splat(0.0f)));
    }
    for (long i = full; i < V; i++) weights[i] = logits[i] > -INFINITY ? expf(logits[i] - max) : 0;
    double mass[NUCLEUS_BUCKETS] = {0}, total = 0.0;
    for (long i = 0; i < V; i++) mass[nucleus_bucket(max, logits[i])] += weights[i];
    for (long b = 0; b < NUCLEUS_BUCKETS; b++) total += mass[b];
    const double target = top_p * total;
    double above = 0.0;
    long bucket = 0;
    while (bucket < NUCLEUS_BUCKETS - 1 && above + mass[bucket] < target) above += mass[bucket++];
    long n = 0; /* the bucket's tokens, compacted in place (n <= i) */
    for (long i = 0; i < V; i++)
        if (nucleus_bucket(max, logits[i]) == bucket) {
            values[n] = logits[i];
            weights[n++] = weights[i];
        }
    if (n == 0) return -INFINITY; /* cannot happen: above sums the buckets in total's order */
    return select_threshold(values, weights, n, above, target);
}

void top_p_thresholds(const float *logits, long rows, long V, const float *top_p,
                      float *thresholds, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows > 1)
    {
        float *scratch = malloc(2 * V * sizeof(float));
#pragma omp for schedule(dynamic)
        for (long r = 0; r < rows; r++) /* without scratch, keep every token */
            thresholds[r] = scratch ? nucleus_threshold(logits + r * V, V, top_p[r], scratch,
                                                        scratch + V)
                                    : -INFINITY;
        free(scratch);
    }
}

/* ------------------------------------------------------------------ race sampling
 *
 * For each row of logits [rows, V] (temperature applied, -inf where removed), the index of the
 * largest exp(logit - max) / E_i: the exponential race, a draw from softmax(logits), in one
 * pass after the row's max instead of a softmax, a noise tensor, a division and an argmax over
 * [rows, V] (torch's generators alone take 2.8 ns an element, `exponential_` 17). E_i = -log(u)
 * with u = (k + 1/2) / 2^23 for a 23-bit k hashed from (keys[r], i) alone, so a row's draw
 * depends on its key and logits only, whatever the batch; u is never 0 or 1 (24 bits would
 * round the top value to 1.0f, a zero E that wins for its token whatever its probability). The
 * hash is two rounds of a 32-bit integer mixer (lowbias32) with the key's halves folded in.
 * The first index on ties; index 0 when every token is removed.
 */
typedef unsigned vu __attribute__((vector_size(LANES * 4)));

static inline vu mix32(vu x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* Natural log of positive normal x: Cephes' logf polynomial, about 1 ulp. */
static inline vf log_v(vf x) {
    vi bits = (vi)x;
    vi e = ((bits >> 23) & 0xff) - 127;
    vf m = (vf)((bits & 0x7fffff) | 0x3f800000); /* [1, 2) */
    vi big = m > 1.41421356f;                      /* to [sqrt(1/2), sqrt(2)) */
    m = select_v(big, m * 0.5f, m);
    e -= big; /* big is -1 where true */
    vf f = m - 1.0f, z = f * f;
    vf y = splat(7.0376836292e-2f);
    y = y * f - 1.1514610310e-1f;
    y = y * f + 1.1676998740e-1f;
    y = y * f - 1.2420140846e-1f;
    y = y * f + 1.4249322787e-1f;
    y = y * f - 1.6668057665e-1f;
    y = y * f + 2.0000714765e-1f;
    y = y * f - 2.4999993993e-1f;
    y = y * f + 3.3333331174e-1f;
    y = y * f * z;
    vf ef = __builtin_convertvector(e, vf);
    y += ef * -2.12194440e-4f - 0.5f * z;
    return f + y + ef * 0.693359375f;
}

/* Exp(1) draws of the LANES indices `index` under the key (lo, hi). */
static inline vf race_noise(vu index, unsigned lo, unsigned hi) {
    vu h = mix32(mix32(index ^ lo) + hi);
    vf u = (__builtin_convertvector(h >> 9, vf) + 0.5f) * (1.0f / 8388608);
    return -log_v(u);
}

static inline int any_lane(vi mask) { /* whether any lane of a comparison is true */
    typedef long long vq __attribute__((vector_size(LANES * 4)));
    vq q = (vq)mask;
    long long bits = 0;
    for (int i = 0; i < LANES / 2; i++) bits |= q[i];
    return bits != 0;
}

static long race_row(const float *logits, long V, unsigned long long key) {
    const unsigned lo = (unsigned)key, hi = (unsigned)(key >> 32);
    const long full = V / LANES * LANES;
    float tail[LANES]; /* the last partial vector, padded with removed tokens */
    vi lane;
    for (int i = 0; i < LANES; i++) {
        lane[i] = i;
        tail[i] = full + i < V ? logits[full + i] : -INFINITY;
    }
    vf vmax = load(tail); /* NaN (a broken model's logits) never becomes the max */
    for (long i = 0; i < full; i += LANES) vmax = max_v(load(logits + i), vmax);
    const float max = max_lanes(vmax);
    vf best = splat(-1.0f);
    vi best_index = lane - lane;
    for (long i = 0; i < V; i += LANES) {
        vf l = i < full ? load(logits + i) : load(tail);
        /* Removed tokens score -1 and never win: skip vectors of them, as top_p, top_k and
         * min_p leave most of a row (the noise costs most of the pass). */
        if (!any_lane(l > splat(-INFINITY))) continue;
        vf noise = race_noise((vu)(lane + (int)i), lo, hi);
        vf score = select_v(l > splat(-INFINITY), exp_v(l - max) / noise, splat(-1.0f));
        vi better = score > best; /* strict: a lane keeps its first index on ties */
        best = select_v(better, score, best);
        best_index = (better & (lane + (int)i)) | (~better & best_index);
    }
    const float top = max_lanes(best);
    long index = V;
    for (int i = 0; i < LANES; i++)
        if (best[i] == top && best_index[i] < index) index = best_index[i];
    return index < V ? index : 0;
}

void race_argmax(const float *logits, long rows, long V, const unsigned long long *keys,
                 long *out, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (long r = 0; r < rows; r++) out[r] = race_row(logits + r * V, V, keys[r]);
}

/* Allowed-token masks (core/constraints.py): row rows[r] of logits [*, V] gets -inf at every
 * token t whose bit t % 32 of word t / 32 is clear in masks[r] ([num_rows, words] int32). A
 * byte-table lookup and an add in torch took 8 ms for 32 rows of 49152; this, a fraction. */
void apply_token_bitmask(float *logits, long V, const long *rows, long num_rows,
                         const unsigned int *masks, long words, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_rows > 1)
    for (long r = 0; r < num_rows; r++) {
        float *row = logits + rows[r] * V;
        const unsigned int *mask = masks + r * words;
        for (long w = 0; w < words; w++) {
            const unsigned int bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue; /* all 32 allowed */
            const long base = w * 32, end = base + 32 < V ? base + 32 : V;
            for (long t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u)) row[t] = -INFINITY;
        }
    }
}

/* ------------------------------------------------------------------ greedy LM head
 *
 * The argmax of each row of x [M, K] @ W^T [K, V] exactly as packed_linear's float32 logits
 * and an argmax would find it (the first index on ties), for about half their cost: a
 * bfloat16 pass (AVX512-BF16 dot products, twice the float32 FMA rate and half the bytes)
 * screens every column, and float32 recomputes only the columns it cannot rule out.
 *
 * The bound: with x and W rounded to bfloat16 (unit roundoff u = 2^-8) and K float32 additions
 * (gamma = K 2^-23 / (1 - K 2^-23)), the screened logit s_v and packed_linear's l_v differ by
 * at most eps_v = (2u + u^2 + gamma ((1 + u)^2 + 1)) sum_k |x_k W_vk| + the few denormals the
 * bfloat16 unit flushes, and sum_k |x_k W_vk| <= |x| |W_v| (Cauchy-Schwarz). So the argmax lies
 * among the columns with s_v + eps_v >= max_u (s_u - eps_u), whose float32 values come from
 * the same chain of FMAs as packed_linear's, strip by strip: bit-identical. On real rows of
 * SmolLM2 that leaves one 16-column strip in the median, five in the mean; the head of a
 * 16-row decode step takes 3.3 ms instead of 5.3 (plus 0.3 for the argmax).
 * wb [V / 16][K / 2][16] bfloat16 pairs (W_v,2i in the low half), wp packed_linear's strips,
 * norms [V] the rows' norms |W_v| rounded up, norm_max their largest; V % 32 == 0, K even;
 * scratch M * V floats, xb M * K / 2 words, each for M rounded up to 16 rows (AMX tiles; and
 * the 16 rows of screen_transposed, which takes xb as [K / 2][16]). Returns 0, or 1 where a row
 * is not finite or has more than max_strips strips left: the caller then computes the logits.
 */
#if defined(__AVX512BF16__) && LANES == 16
#include <immintrin.h>

int greedy_head_available(void) { return 1; }

#define SCREEN_ROWS 14

static inline unsigned bf16_bits(float f) { /* round to nearest even; f finite */
    unsigned bits;
    memcpy(&bits, &f, sizeof bits);
    return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

static inline __attribute__((always_inline)) void screen_tile(const unsigned *xb, long KP,
                                                              const unsigned *w, long rows,
                                                              float *y, long V) {
    __m512 acc[SCREEN_ROWS][2];
    for (long i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const unsigned *w1 = w + KP * STRIP; /* the next strip */
    for (long k = 0; k < KP; k++) {
        __builtin_prefetch(w + (k + PREFETCH_ROWS) * STRIP, 0, 3);
        __builtin_prefetch(w1 + (k + PREFETCH_ROWS) * STRIP, 0, 3);
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(w + k * STRIP);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + k * STRIP);
        for (long i = 0; i < rows; i++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)xb[i * KP + k]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
    }
    for (long i = 0; i < rows; i++) {
        _mm512_storeu_ps(y + i * V, acc[i][0]);
        _mm512_storeu_ps(y + i * V + STRIP, acc[i][1]);
    }
}

static void screen_rows(const unsigned *xb, long KP, const unsigned *w, long rows, float *y,
                        long V) {
    switch (rows) { /* one fully unrolled body per row count */
#define SCREEN_CASE(R) case R: screen_tile(xb, KP, w, R, y, V); break;
        SCREEN_CASE(1) SCREEN_CASE(2) SCREEN_CASE(3) SCREEN_CASE(4) SCREEN_CASE(5)
        SCREEN_CASE(6) SCREEN_CASE(7) SCREEN_CASE(8) SCREEN_CASE(9) SCREEN_CASE(10)
        SCREEN_CASE(11) SCREEN_CASE(12) SCREEN_CASE(13) SCREEN_CASE(14)
#undef SCREEN_CASE
    }
}

/* Steps of 15 or 16 rows in one tile, as transposed_tile does for the linears: 16 rows x 1
 * strip, each bfloat16 weight vector loaded once, the rows' pairs broadcast from xbt [KP][16]
 * (the missing row zero). The same dot products as screen_tile's. */
static void screen_transposed(const unsigned *xbt, long KP, const unsigned *w, float *y,
                              long V) {
    __m512 acc[T_ROWS];
    for (long i = 0; i < T_ROWS; i++) acc[i] = _mm512_setzero_ps();
    for (long k = 0; k < KP; k++) {
        __builtin_prefetch(w + (k + PREFETCH_ROWS) * STRIP, 0, 3);
        const __m512bh b = (__m512bh)_mm512_loadu_si512(w + k * STRIP);
        const unsigned *xk = xbt + k * T_ROWS;
        for (long i = 0; i < T_ROWS; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], b, (__m512bh)_mm512_set1_epi32((int)xk[i]));
    }
    for (long i = 0; i < T_ROWS; i++) _mm512_storeu_ps(y + i * V, acc[i]);
}

typedef double vd __attribute__((vector_size(64)));

typedef long vl __attribute__((vector_size(64)));

typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));

static inline vd widen(const float *p) { return __builtin_convertvector(*(const v8f_u *)p, vd); }
static inline vd max_d(vd a, vd b) { vl m = a > b; return (vd)(((vl)a & m) | ((vl)b & ~m)); }

/* Row r's argmax among the strips that the screen left, or -1 when more than max_strips are
 * or a screened logit overflowed. y: the row's screened logits; the bounds run in double, in
 * one pass over y that also keeps each strip's highest s + margin in tops [V / 16] (two
 * passes, each testing its lanes one by one, took 3 of the 5 ms of a 64-row head). */
static long rescore_row(const float *x, long K, const float *y, const float *wp,
                        const float *norms, double norm_max, long V, long max_strips,
                        double *tops) {
    /* gamma with 2^-23: an addition of the bfloat16 unit need only be faithfully rounded */
    const double u = 1.0 / 256, gamma = K * 0x1p-23 / (1 - K * 0x1p-23);
    const double rel = (2 * u + u * u + gamma * ((1 + u) * (1 + u) + 1)) * 1.01;
    double sq = 0, l1 = 0;
    for (long k = 0; k < K; k++) {
        sq += (double)x[k] * x[k];
        l1 += fabs(x[k]);
    }
    /* Flushed denormals: products below 2^-126 with either factor, and partial sums. */
    const double floor = 0x1p-126 * (l1 + sqrt((double)K) * norm_max + 2.0 * K) * 1.01;
    /* The bound assumes no partial sum overflows: in float32 each is at most (1 + gamma) |x|
     * |W_v|, so below 2^127 none can (and 0 * an infinite norm, NaN, fails this too). */
    if (!(sqrt(sq) * norm_max * (1 + gamma) < 0x1p127)) return -1;
    const double scale = rel * sqrt(sq) * 1.0000001;
    vd lower = (vd){} - INFINITY, big = (vd){} + INFINITY;
    vl finite = (vl){} - 1; /* all lanes true while every screened logit is finite */
    for (long v = 0; v < V; v += STRIP) {
        vd s0 = widen(y + v), s1 = widen(y + v + 8);
        vd m0 = scale * widen(norms + v) + floor, m1 = scale * widen(norms + v + 8) + floor;
        lower = max_d(lower, max_d(s0 - m0, s1 - m1));
        finite &= (s0 < big) & (s0 > -big) & (s1 < big) & (s1 > -big);
        tops[v / STRIP] = _mm512_reduce_max_pd((__m512d)max_d(s0 + m0, s1 + m1));
    }
    for (int j = 0; j < 8; j++)
        if (!finite[j]) return -1; /* overflowed: let float32 decide */
    const double low = _mm512_reduce_max_pd((__m512d)lower);
    long best = -1, strips = 0;
    float best_logit = 0;
    for (long v = 0; v < V; v += STRIP) {
        if (!(tops[v / STRIP] >= low)) continue; /* no column of this strip within reach */
        if (++strips > max_strips) return -1;
        float logits[STRIP]; /* packed_linear's own tile over this strip: the same FMAs */
        run_tile((Tile){.x = x, .w = strip_column(wp, K, v), .y = logits, .K = K, .N = STRIP}, 1, 1);
        for (long j = 0; j < STRIP; j++)
            if (best < 0 || logits[j] > best_logit) {
                best = v + j;
                best_logit = logits[j];
            }
    }
    return best;
}

#ifdef HAVE_AMX
/* The same screen on AMX tiles, where K % 32 == 0 and a step has a few rows: wb's strips are
 * the instruction's second operand as they are (16 pairs of k by 16 columns per run of 32 k,
 * 1 KiB apart), xb's rows its first. The products and their float32 sums are the same as
 * AVX512-BF16's, in another order, which the bound allows. SmolLM2's head (49152 x 576) at 64
 * rows took 5 ms instead of 20; at 4 rows 1.5 against 1.8, at 1 row 1.5 against 1.2. xb and y
 * hold M rounded up to 16 rows. Tiles: 0-3 the sums of 2 row tiles x 2 strips, 4-5 rows of
 * xb, 6-7 the strips. */
#define AMX_SCREEN_MIN_ROWS 4
static void screen_amx(const unsigned *xb, long M, long KP, const unsigned *wb, float *y,
                       long V) {
    const long rows = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS, runs = KP / 16;
    configure_tiles();
#pragma omp for schedule(static)
    for (long p = 0; p < V / (2 * STRIP); p++) {
        const unsigned *w0 = wb + 2 * p * KP * STRIP, *w1 = w0 + KP * STRIP;
        for (long r = 0; r < rows; r += 2 * AMX_ROWS) {
            const int two = rows - r > AMX_ROWS;
            const unsigned *a = xb + r * KP;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (long run = 0; run < runs; run++) {
                _tile_loadd(6, w0 + run * 16 * STRIP, 64);
                _tile_loadd(7, w1 + run * 16 * STRIP, 64);
                _tile_loadd(4, a + run * 16, KP * 4);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, a + AMX_ROWS * KP + run * 16, KP * 4);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *out = y + r * V + 2 * p * STRIP;
            _tile_stored(0, out, V * 4);
            _tile_stored(1, out + STRIP, V * 4);
            if (two) {
                _tile_stored(2, out + AMX_ROWS * V, V * 4);
                _tile_stored(3, out + AMX_ROWS * V + STRIP, V * 4);
            }
        }
    }
    _tile_release();
}
#endif

int greedy_head(const float *x, long M, long K, const unsigned *wb, const float *wp,
                const float *norms, double norm_max, long V, long max_strips, float *scratch,
                unsigned *xb, long *out, int num_threads) {
    const long KP = K / 2;
    for (long i = 0; i < M * K; i++)
        if (!(fabsf(x[i]) < 1e38f)) return 1; /* NaN, inf, or too close to bfloat16's range */
#ifdef HAVE_AMX
    const int amx = K % 32 == 0 && M >= AMX_SCREEN_MIN_ROWS && amx_available();
#else
    const int amx = 0;
#endif
    /* 15 or 16 rows: xb as [KP][16] for screen_transposed, the missing row zero */
    const int transposed = M > SCREEN_ROWS && M <= T_ROWS && !amx;
    const long row_step = transposed ? 1 : KP, k_step = transposed ? T_ROWS : 1;
    for (long r = 0; r < (transposed ? T_ROWS : M); r++)
        for (long k = 0; k < KP; k++) {
            const float *pair = x + r * K + 2 * k;
            xb[r * row_step + k * k_step] =
                r < M ? bf16_bits(pair[0]) | bf16_bits(pair[1]) << 16 : 0;
        }
#ifdef HAVE_AMX
    if (amx) /* the padding rows of the last tile */
        memset(xb + M * KP, 0, ((M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS - M) * KP * 4);
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#ifdef HAVE_AMX
        if (amx) {
            screen_amx(xb, M, KP, wb, scratch, V);
        } else
#endif
        if (transposed) {
#pragma omp for schedule(static)
            for (long p = 0; p < V / STRIP; p++)
                screen_transposed(xb, KP, wb + p * KP * STRIP, scratch + p * STRIP, V);
        } else {
#pragma omp for schedule(static)
            for (long p = 0; p < V / (2 * STRIP); p++)
                for (long m = 0; m < M; m += SCREEN_ROWS)
                    screen_rows(xb + m * KP, KP, wb + 2 * p * KP * STRIP,
                                M - m < SCREEN_ROWS ? M - m : SCREEN_ROWS,
                                scratch + m * V + 2 * p * STRIP, V);
        }
        double *tops = malloc(V / STRIP * sizeof(double));
#pragma omp for schedule(static) reduction(| : failed)
        for (long r = 0; r < M; r++) {
            out[r] = tops ? rescore_row(x + r * K, K, scratch + r * V, wp, norms, norm_max, V,
                                        max_strips, tops)
                          : -1;
            failed |= out[r] < 0;
        }
        free(tops);
    }
    return failed;
}
#else
int greedy_head_available(void) { return 0; }
#endif
