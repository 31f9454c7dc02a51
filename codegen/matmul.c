/* A float32 matrix product for the numpy backend's native code: out = a @ b over the last two
   dimensions, the dimensions before them a batch (all three arrays have the same number of
   dimensions; numpy_gen's `matmul` broadcasts the batch beforehand, broadcast dimensions have
   stride 0).  Any strides: a's elements are broadcast one at a time, so its layout does not
   matter; b is copied into panels of NR columns (`pack`), except in products of fewer rows
   than MR, which read it in place unless it comes packed (`thin`); out's blocks are stored
   a vector at a time where its rows are contiguous, else an element at a time (a product
   computed transposed, y^T x^T, into x y's rows: a few hundred stores a block of 6 x 64 x
   1024 multiply-adds).

   Why not numpy's BLAS: on small products, the ones a transformer layer at a few hundred tokens
   is made of (128 x 256 by 256 x 512), OpenBLAS reached 227 GFLOP/s on 2 cores of an AVX-512
   Xeon where onnxruntime's MLAS reached 347; this reaches 340.  It runs on as many threads as
   the caller asks for (one inside a kernel's parts, which already run on every core): its own
   (`dispatch`), which native groups share (`bb_parallel_for`).

   A constant b (a model's weight) comes packed beforehand (`bb_pack`, `Product.panels`), once
   for every call, as onnxruntime's MLAS packs its initializers.

   The micro-kernel keeps an MR x NR block of out in registers (with AVX-512, 6 rows of 4 vectors
   of 16 floats: 24 of the 32 registers; with 16 registers of 8 floats, 6 rows of 2) and adds,
   for each k, a's 6 elements broadcast times b's packed row: 24 fused multiply-adds per 4 loads
   and 6 broadcasts (on one core, 183 GFLOP/s of the 236 its FMA units peak at; OpenBLAS 153,
   MLAS 180).  The contraction is walked in blocks of KC, so that a packed panel stays in the
   core's L2 cache, each block's products added to out (blocks of 1024 ran magika's
   convolution, 512 x 1280 by 1280 x 512, at 375-385 GFLOP/s on 2 cores, blocks of 384 at
   345-365).  Rounding differs from BLAS's (fused multiply-adds, another order). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define W 16   /* floats in a vector register */
#define NV 4   /* vectors in a row of the block */
#elif defined(__AVX__)
#define W 8
#define NV 2
#else
#define W 4
#define NV 2
#endif
#define MR 6
#define NR (W * NV)
#define KC 1024  /* a panel of 1024 x 64 floats: 256 KiB, within a core's L2 */
#define MAX_DIMS 16

typedef float vec __attribute__((vector_size(4 * W), aligned(4)));
typedef float avec __attribute__((vector_size(4 * W), aligned(4 * W)));

typedef int ivec __attribute__((vector_size(4 * W)));

/* The W x W floats t[0..W) transposed in registers: log2(W) rounds, each exchanging the
   off-diagonal h x h blocks of every 2h x 2h block (h = W/2, ..., 1) between row pairs. */
static inline __attribute__((always_inline)) void transpose(vec *t) {
#pragma GCC unroll 4
    for (int h = W / 2; h >= 1; h /= 2) {
        ivec lo, hi;
#pragma GCC unroll 16
        for (int q = 0; q < W; q++) {
            lo[q] = q & h ? W + q - h : q;
            hi[q] = q & h ? W + q : q + h;
        }
#pragma GCC unroll 16
        for (int i = 0; i < W; i++)
            if (!(i & h)) {
                const vec x = t[i], y = t[i + h];
                t[i] = __builtin_shuffle(x, y, lo);
                t[i + h] = __builtin_shuffle(x, y, hi);
            }
    }
}

/* b's block of kc rows and n <= NR columns (rows sk apart, columns sn), into NR-wide rows of
   `panel` (columns past n zero).  A transposed b (columns contiguous: a weight read as W^T,
   attention's K^T) is moved W x W floats at a time through `transpose`. */
static void pack(const float *b, long sk, long sn, long kc, long n, float *panel) {
    long k = 0;
    if (sn == 1 && n == NR) {
        for (; k < kc; k++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                *(avec *)(panel + k * NR + W * v) = *(const vec *)(b + k * sk + W * v);
    } else if (sk == 1 && n == NR) {
        for (; k + W <= kc; k += W)
            for (int v = 0; v < NV; v++) {
                vec t[W];
#pragma GCC unroll 16
                for (int i = 0; i < W; i++)
                    t[i] = *(const vec *)(b + (W * v + i) * sn + k);
                transpose(t);
#pragma GCC unroll 16
                for (int i = 0; i < W; i++)
                    *(avec *)(panel + (k + i) * NR + W * v) = t[i];
            }
    }
    for (; k < kc; k++)
        for (long j = 0; j < NR; j++)
            panel[k * NR + j] = j < n ? b[k * sk + j * sn] : 0.0f;
}

/* The addend's row r from column j (columns scn apart; 0: one number broadcast) as a vector. */
static inline __attribute__((always_inline)) vec addend_row(const float *c, long scn) {
    if (scn == 1)
        return *(const vec *)c;
    vec x;
#pragma GCC unroll 16
    for (int i = 0; i < W; i++)
        x[i] = c[i * scn];
    return x;
}

/* out's block of m <= MR rows and n <= NR columns (rows so apart, columns son) (+)= `scale`
   times a's m rows (kc long) times the panel: added to out where `add`, else to the addend
   `c` (rows scm apart, columns scn; 0 where it is broadcast; the block's first row `row` of
   out adds its row row % period) where there is one (the contraction's first block). */
static inline __attribute__((always_inline)) void
block(const float *a, long sm, long sk, const float *panel, long kc, float *out, long so,
      long son, long m, long n, int add, const float *c, long row, long period, long scm,
      long scn, float scale) {
    const float *rows[MR];
    for (int r = 0; r < MR; r++)  /* rows past m repeat the last one; they are not stored */
        rows[r] = a + (r < m ? r : m - 1) * sm;
    avec acc[MR][NV];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            acc[r][v] = (avec){0};
#pragma GCC unroll 4
    for (long k = 0; k < kc; k++) {
        const avec *p = (const avec *)(panel + k * NR);
        avec row[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            row[v] = p[v];
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const float x = rows[r][k * sk];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                acc[r][v] += x * row[v];
        }
    }
    for (long r = 0; r < m; r++) {
        float *o = out + r * so;
        const float *cr = c == NULL ? NULL : c + (row + r) % period * scm;
        if (n == NR && son == 1) {
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                *(vec *)(o + W * v) = (add ? *(vec *)(o + W * v)
                                       : cr ? addend_row(cr + W * v * scn, scn) : (vec){0})
                                      + scale * acc[r][v];
        } else {  /* (out's columns apart: a transposed product's, `Product.so`) */
            const float *s = (const float *)acc[r];
            for (long j = 0; j < n; j++)
                o[j * son] = (add ? o[j * son] : cr ? cr[j * scn] : 0.0f) + scale * s[j];
        }
    }
}

typedef struct {
    long batch, m, n, k;              /* sizes */
    long chunks;                      /* runs of rows a panel is cut into (`run`) */
    int dims;                         /* batch dimensions */
    long shape[MAX_DIMS];             /* the batch's shape */
    /* strides in floats (out's columns may lie apart: a product computed transposed, y^T x^T,
       written into the rows of x y) */
    long sa[MAX_DIMS + 2], sb[MAX_DIMS + 2], so[MAX_DIMS + 2];
    const float *a, *b;
    float *out;
    const float *c;                   /* the addend (out = c + scale a @ b), NULL where none */
    long sc[MAX_DIMS + 2];            /* its strides, 0 along dimensions it is broadcast */
    long period;                      /* out's row r adds the addend's row r % period */
    float scale;
    const float *panels;              /* b packed beforehand (`bb_pack`), NULL where it is not */
} Product;

/* The offset of element `index` (row-major) of dimensions of `extents`, at `strides`. */
static long offset_of(const long *extents, const long *strides, int dims, long index) {
    long at = 0;
    for (int d = dims - 1; d >= 0; d--) {
        at += (index % extents[d]) * strides[d];
        index /= extents[d];
    }
    return at;
}

/* The offset of batch entry `index` of product `p`, at `strides`. */
static long offset(const Product *p, const long *strides, long index) {
    return offset_of(p->shape, strides, p->dims, index);
}

/* Thin products: fewer rows than the micro-kernel's MR (a vector times a matrix: a bias
   through a weight, a decode step's projections; decode attention's one query).  Packing a
   panel would serve one block of rows, so b is read where it is: by rows where they are
   contiguous (each k adds a's elements times b's row; 1 x 1024 by 1024 x 1024 packed took
   290 µs, 3 times numpy's), by columns where those are (a dot product along k per element
   of out).  A constant b packed beforehand is read from its panels, one contiguous stream
   per item where b's own rows are read 256 bytes a row apart: a 1 x 3072 by 3072 x 768
   product, weights beyond the cache, took 339 µs on 2 cores of the AMD EPYC from panels
   against 723 in place (onnxruntime, which packs its weights too: 380).  M is a constant at
   each call (`thin`), so the loops over rows unroll. */

/* The first `count` (<= W) floats from p, `step` apart, in a vector (zeros past them): a
   masked load with AVX-512, which reads nothing past them. */
static inline __attribute__((always_inline)) vec first_floats(const float *p, long count,
                                                                long step) {
#if defined(__AVX512F__)
    if (step == 1)
        return (vec)_mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
#endif
    float t[W] = {0};
    for (long i = 0; i < count; i++)
        t[i] = p[i * step];
    vec x;
    memcpy(&x, t, sizeof x);
    return x;
}

/* The first `count` (<= W) floats of x into p: a masked store with AVX-512, which writes
   nothing past them. */
static inline __attribute__((always_inline)) void first_floats_into(float *p, vec x,
                                                                    long count) {
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1), (__m512)x);
#else
    float t[W];
    memcpy(t, &x, sizeof x);
    memcpy(p, t, sizeof(float) * count);
#endif
}

/* `n` floats from `s` into a row of out whose columns are `son` apart. */
static inline __attribute__((always_inline)) void
store_row(float *o, long son, const float *s, long n) {
    if (son == 1)
        memcpy(o, s, sizeof(float) * n);
    else
        for (long j = 0; j < n; j++)
            o[j * son] = s[j];
}

/* out's M rows, columns [0, n), n <= NR, from b's rows (columns contiguous), of which
   `readable` columns may be read (NR in a panel, whose columns past n are zeros). */
static inline __attribute__((always_inline)) void
thin_rows(const float *a, long sm, long sk, const float *b, long sbk, long k, float *out,
          long so, long son, long n, long readable, const int M) {
    avec acc[MR][NV];
    for (int r = 0; r < M; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = (avec){0};
    float tail[NR] __attribute__((aligned(64))) = {0};
    for (long kk = 0; kk < k; kk++) {
        const float *row = b + kk * sbk;
        if (readable < NR) {  /* the last columns: through a zero-padded copy */
            memcpy(tail, row, sizeof(float) * n);
            row = tail;
        }
        vec x[NV];
        for (int v = 0; v < NV; v++)
            x[v] = *(const vec *)(row + W * v);
        for (int r = 0; r < M; r++) {
            const float ar = a[r * sm + kk * sk];
            for (int v = 0; v < NV; v++)
                acc[r][v] += ar * x[v];
        }
    }
    for (int r = 0; r < M; r++)
        store_row(out + r * so, son, (const float *)acc[r], n);
}

/* The sum of v's W floats: halves added log2(W) times. */
static inline __attribute__((always_inline)) float hsum(vec v) {
    float t[W];
    memcpy(t, &v, sizeof t);
#pragma GCC unroll 4
    for (int h = W / 2; h >= 1; h /= 2)
#pragma GCC unroll 8
        for (int l = 0; l < h; l++)
            t[l] += t[l + h];
    return t[0];
}

/* out's M rows, columns [0, n), each a dot product of a's row and b's column, both
   contiguous along k: four columns at a time, each in a vector of partial sums. */
static inline __attribute__((always_inline)) void
thin_dots(const float *a, long sm, const float *b, long sbn, long k, float *out, long so,
          long son, long n, const int M) {
    for (int r = 0; r < M; r++) {
        const float *ar = a + r * sm;
        for (long j = 0; j < n; j += 4) {
            const int cols = n - j < 4 ? (int)(n - j) : 4;
            const float *col[4];
            for (int c = 0; c < 4; c++)  /* columns past n repeat the last; not stored */
                col[c] = b + (j + (c < cols ? c : cols - 1)) * sbn;
            vec acc[4] = {{0}, {0}, {0}, {0}};
            long kk = 0;
            for (; kk + W <= k; kk += W) {
                const vec x = *(const vec *)(ar + kk);
                for (int c = 0; c < 4; c++)
                    acc[c] += x * *(const vec *)(col[c] + kk);
            }
            float sums[4];
            for (int c = 0; c < 4; c++) {  /* (all four: acc stays in registers) */
                sums[c] = hsum(acc[c]);
                for (long t = kk; t < k; t++)
                    sums[c] += ar[t] * col[c][t];
            }
            store_row(out + r * so + j * son, son, sums, cols);
        }
    }
}

/* Batch entry e's columns from j (at most NR) of a thin product, from b or its panel
   `packed` (NULL: none); 0 where its operands are laid out for neither kernel (the caller
   packs). */
static int thin(const Product *p, const float *a, const float *b, const float *packed,
                float *out, long n) {
    const int d = p->dims;
    const long sm = p->sa[d], sk = p->sa[d + 1];
    const long sbk = packed ? NR : p->sb[d], sbn = packed ? 1 : p->sb[d + 1];
    const long readable = packed ? NR : n;
    const int rowwise = sbn == 1, dots = !rowwise && sbk == 1 && sk == 1;
    if (packed)
        b = packed;
    if (!rowwise && !dots)
        return 0;
    switch (p->m) {
#define THIN(M) \
    case M: \
        if (rowwise) \
            thin_rows(a, sm, sk, b, sbk, p->k, out, p->so[d], p->so[d + 1], n, readable, M); \
        else \
            thin_dots(a, sm, b, sbn, p->k, out, p->so[d], p->so[d + 1], n, M); \
        return 1;
    THIN(1) THIN(2) THIN(3) THIN(4) THIN(5)
#undef THIN
    }
    return 0;
}

/* Thin products of one row across the batch: where a product's row is one and its batch's
   innermost dimension is contiguous in b but b is neither by rows nor by columns (a
   depthwise convolution's window over channels laid innermost: y[c, o] = sum over taps k of
   w[c, k] x[o + k, c], each channel a 1 x K by K x N product), W batch entries at a time,
   one a vector lane: each column a K-long chain of vector multiply-adds of b's contiguous
   lanes, its lanes then stored at out's strides.  Packing b for each channel's product took
   Conformer's 15-tap convolution over 384 channels and 256 positions 700 µs on one core. */
#define ACROSS_K 64  /* the longest contraction: a's lanes are held a vector a k */

static int across(const Product *p) {
    const int d = p->dims - 1;
    return p->m == 1 && d >= 0 && p->k <= ACROSS_K && p->sb[d] == 1 &&
           p->shape[d] >= W && p->sb[p->dims + 1] != 1 && p->sb[p->dims] != 1;
}

static long across_items(const Product *p) {
    return p->batch / p->shape[p->dims - 1] * ((p->shape[p->dims - 1] + W - 1) / W);
}

/* Item `item` of an `across` product: its W lanes (fewer at the end of a row of lanes). */
static void across_item(const Product *p, long item) {
    const int d = p->dims - 1;
    const long lanes = p->shape[d], chunks = (lanes + W - 1) / W;
    const long first = item % chunks * W, count = lanes - first < W ? lanes - first : W;
    const long e = item / chunks * lanes + first;  /* lane 0's batch entry */
    const float *a = p->a + offset(p, p->sa, e), *b = p->b + offset(p, p->sb, e);
    const float *c = p->c == NULL ? NULL : p->c + offset(p, p->sc, e);
    float *out = p->out + offset(p, p->so, e);
    const long sbk = p->sb[p->dims], sbn = p->sb[p->dims + 1];
    const long son = p->so[p->dims + 1], scn = p->sc[p->dims + 1];
    avec ak[ACROSS_K];
    for (long k = 0; k < p->k; k++) {
        float *lane = (float *)&ak[k];
        for (long l = 0; l < W; l++)
            lane[l] = l < count ? a[l * p->sa[d] + k * p->sa[p->dims + 1]] : 0.0f;
    }
    for (long j = 0; j < p->n; j++) {
        const float *bj = b + j * sbn;
        avec acc = {0};
        for (long k = 0; k < p->k; k++)  /* (of a last run of fewer lanes, only theirs read) */
            acc += ak[k] * (count == W ? *(const vec *)(bj + k * sbk)
                                       : first_floats(bj + k * sbk, count, 1));
        const float *sums = (const float *)&acc;
        for (long l = 0; l < count; l++)
            out[l * p->so[d] + j * son] =
                (c ? c[l * p->sc[d] + j * scn] : 0.0f) + p->scale * sums[l];
    }
}

/* Rows [r0, r1), columns [j, j + n), of batch entry e of out scaled by `scale` and added to
   the addend where there is one (after a thin product, which writes a @ b as a whole; into
   an empty product's zeros). */
static void finish(const Product *p, float scale, long e, long j, long r0, long r1, long n) {
    const long d = p->dims, son = p->so[d + 1];
    const float *c = p->c == NULL ? NULL : p->c + offset(p, p->sc, e) + j * p->sc[d + 1];
    float *out = p->out + offset(p, p->so, e) + j * son;
    for (long r = r0; r < r1; r++)
        for (long t = 0; t < n; t++)
            out[r * p->so[d] + t * son] =
                (c ? c[r % p->period * p->sc[d] + t * p->sc[d + 1]] : 0.0f) +
                scale * out[r * p->so[d] + t * son];
}

/* Rows [r0, r1) of batch entry e's panel of columns from j (`packed`: `panel` holds it). */
static void rows(const Product *p, long e, long j, long r0, long r1, float *panel, int packed) {
    const long n = p->n - j < NR ? p->n - j : NR, d = p->dims;
    const float *a = p->a + offset(p, p->sa, e), *b = p->b + offset(p, p->sb, e) + j * p->sb[d + 1];
    float *out = p->out + offset(p, p->so, e) + j * p->so[d + 1];
    const float *c = p->c == NULL ? NULL : p->c + offset(p, p->sc, e) + j * p->sc[d + 1];
    const long scm = p->sc[d], scn = p->sc[d + 1];
    const float *held = p->panels == NULL ? panel : p->panels + j * p->k;
    if (p->m < MR && thin(p, a, b, p->panels == NULL ? NULL : held, out, n)) {
        if (c != NULL || p->scale != 1.0f)
            finish(p, p->scale, e, j, r0, r1, n);
        return;
    }
    for (long k0 = 0; k0 < p->k; k0 += KC) {
        const long kc = p->k - k0 < KC ? p->k - k0 : KC;
        const float *from = p->panels == NULL ? panel : held + k0 * NR;
        if (!packed && p->panels == NULL)
            pack(b + k0 * p->sb[d], p->sb[d], p->sb[d + 1], kc, n, panel);
        for (long r = r0; r < r1; r += MR) {
            const long m = r1 - r < MR ? r1 - r : MR;
            const float *ar = a + r * p->sa[d] + k0 * p->sa[d + 1];
            if (p->sa[d + 1] == 1)  /* (the common case, specialised: unit steps along k) */
                block(ar, p->sa[d], 1, from, kc, out + r * p->so[d], p->so[d], p->so[d + 1],
                      m, n, k0 > 0, c, r, p->period, scm, scn, p->scale);
            else
                block(ar, p->sa[d], p->sa[d + 1], from, kc, out + r * p->so[d], p->so[d],
                      p->so[d + 1], m, n, k0 > 0, c, r, p->period, scm, scn, p->scale);
        }
    }
}

/* ---------------------------------------------------------------------------------------
   Threads.  Not OpenMP's: libgomp's idle threads spin for milliseconds after a region (300,000
   pauses) without yielding, on the cores that other threads (OpenBLAS's, the numpy backend's
   parts) need; a product run beside spinning threads took 2-4 times as long.  These spin
   while a next product is likely (a layer's products come every 0.1-0.3 ms), yielding their
   core to any other thread after YIELD_NS, then sleep.  Waking a sleeping worker costs more
   than a small product gains from it: LLaMA's layer at 128 tokens ran 1.40-1.50 ms with
   workers sleeping after 0.1 ms, 1.17-1.19 ms after 1 ms.

   A worker joins whatever job is running, whenever it gets there, and its caller waits only
   for the workers that joined.  On this VM a worker woken from sleep may be woken onto its
   caller's core and run only once the caller's time slice ends: a caller that waited for its
   workers took 1.9 ms for a product of 0.11 after 2 ms idle (128 x 256 by 256 x 512), and a
   worker that could only take jobs handed out after it woke slept again before each next
   one: magika's 2 ms convolution took 4 ms call after call once its worker had slept. */

#define SPIN_NS 1000000L
#define YIELD_NS 20000L
#define WAIT_SPINS 256
#define MAX_WORKERS 255

/* An item of work: `item` of a job, with the calling thread's `scratch` (a `Scratch`). */
typedef void (*Work)(const void *ctx, long item, void *scratch);

/* A thread's scratch: the panel it packs a product's columns into, and which batch entry and
   panel it holds there (-1: none, at the start of each job). */
typedef struct {
    float *panel;
    long packed;
} Scratch;

/* The job handed out, if `running`.  A worker counts itself in `busy` before it checks that
   the job runs, so that the job's caller waits for it, and the next caller does not rewrite
   the job before it has left (it then finds no item left: it never calls `work`). */
typedef struct {
    Work work;
    const void *ctx;
    atomic_long ends;           /* the items left, [front, back): front in the low 32 bits */
    atomic_int seats;           /* workers that may still join: the caller's threads - 1 */
    atomic_int busy;            /* workers inside the job */
    atomic_int running;
} Job;

static struct {
    pthread_mutex_t owner;      /* held by the caller whose work the workers share */
    pthread_mutex_t lock;       /* with `wake`: where idle workers sleep */
    pthread_cond_t wake;
    atomic_long generation;     /* bumped for each job */
    atomic_int sleepers;
    int workers;                /* started */
    Job job;
} pool = {.owner = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Take items of `job` until none is left: the caller from the front, workers from the back
   (`back`), so that each thread walks neighbouring items, a product's next panel or a group's
   next rows, which the core's prefetchers fetched beside its last.  Taking them alternately,
   as one counter hands them out, made LLaMA's products at 128 tokens 3-7% slower (its
   attention's batched ones 30%).  (Items fit 32 bits: each is a product's 64 columns of a
   run of rows, or a group's 16,384 elements at least.) */
static void take(Job *job, Scratch *scratch, int back) {
    scratch->packed = -1;
    for (;;) {
        long ends = atomic_load(&job->ends), item;
        do {
            const long front = ends & 0xffffffffL, end = ends >> 32;
            if (front >= end)
                return;
            item = back ? end - 1 : front;
        } while (!atomic_compare_exchange_weak(&job->ends, &ends,
                                               back ? ends - (1L << 32) : ends + 1));
        job->work(job->ctx, item, scratch);
    }
}

/* Until `busy` is 0, yielding the core to any thread woken onto it. */
static void wait_idle(Job *job) {
    for (int spins = 0; atomic_load(&job->busy) > 0; spins++) {
        if (spins > WAIT_SPINS)
            sched_yield();
        relax();
    }
}

/* Sleep until a job after generation `seen` is handed out. */
static void sleep_after(long seen) {
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add(&pool.sleepers, 1);
    while (atomic_load(&pool.generation) == seen)
        pthread_cond_wait(&pool.wake, &pool.lock);
    atomic_fetch_sub(&pool.sleepers, 1);
    pthread_mutex_unlock(&pool.lock);
}

static void *worker(void *arg) {
    long joined = (long)arg;    /* the generation of the last job it joined */
    Scratch scratch = {aligned_alloc(64, sizeof(float) * KC * NR), -1};  /* (a multiple of 64) */
    if (scratch.panel == NULL)
        return NULL;
    Job *job = &pool.job;
    long last = now_ns();       /* when it last joined a job */
    for (int spins = 1;; spins++) {
        if (atomic_load(&job->running) && atomic_load(&pool.generation) != joined) {
            atomic_fetch_add(&job->busy, 1);
            const long current = atomic_load(&pool.generation);
            if (atomic_load(&job->running) && current != joined) {
                joined = current;
                if (atomic_fetch_sub(&job->seats, 1) > 0)
                    take(job, &scratch, 1);
                last = now_ns();
            }
            atomic_fetch_sub(&job->busy, 1);
        }
        if ((spins & 255) == 0) {
            const long now = now_ns();
            if (now - last > YIELD_NS)
                sched_yield();
            if (now - last > SPIN_NS) {
                sleep_after(atomic_load(&pool.generation));
                last = now_ns();
            }
        }
        relax();
    }
    return NULL;
}

/* After fork() the child has none of the workers. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.owner, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.job.busy, 0);
    atomic_store(&pool.job.running, 0);
    atomic_store(&pool.sleepers, 0);
    pool.workers = 0;
}

/* Items 0 .. items - 1 of `work` on `threads` threads (the caller and the workers that join),
   taken one at a time (`take`): a thread slowed by other work takes fewer.  Alone where
   another caller holds the workers. */
static void dispatch(Work work, const void *ctx, long items, int threads, Scratch *mine) {
    if (threads > 1 && items > 1 && pthread_mutex_trylock(&pool.owner) == 0) {
        static int registered;
        if (!registered)
            registered = pthread_atfork(NULL, NULL, forget_workers) == 0;
        while (pool.workers < threads - 1 && pool.workers < MAX_WORKERS) {
            pthread_t t;
            if (pthread_create(&t, NULL, worker, (void *)atomic_load(&pool.generation)) != 0)
                break;
            pthread_detach(t);
            pool.workers++;
        }
        Job *job = &pool.job;
        wait_idle(job);  /* workers still leaving the last job */
        job->work = work, job->ctx = ctx;
        atomic_store(&job->ends, items << 32);
        atomic_store(&job->seats, threads - 1);
        atomic_fetch_add(&pool.generation, 1);
        atomic_store(&job->running, 1);
        if (atomic_load(&pool.sleepers) > 0) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_broadcast(&pool.wake);
            pthread_mutex_unlock(&pool.lock);
        }
        take(job, mine, 0);
        wait_idle(job);
        atomic_store(&job->running, 0);
        pthread_mutex_unlock(&pool.owner);
    } else {
        Job alone = {.work = work, .ctx = ctx, .ends = items << 32};
        take(&alone, mine, 0);
    }
}

/* Native groups (`codegen.native`) run their rows on the same threads: `work`'s items 0 ..
   items - 1 on `threads` threads, its scratch unused. */
void bb_parallel_for(Work work, const void *ctx, long items, int threads) {
    Scratch none = {NULL, -1};
    dispatch(work, ctx, items, threads, &none);
}

/* Several products run as one job (`bb_matmuls`): a kernel's products that can run at once
   (a layer's K and V projections, an MLP's gate and up) share one dispatch and one finish,
   where the last items of one product and the first of the next run side by side.  LLaMA's
   K and V kernel at 128 tokens (two 128 x 256 by 256 x 128 products) took 91.3 and 93.2 µs
   with a job each, 88.7 and 89.6 with one (warm, alternating, 2 cores of the README's Xeon);
   two 128 x 256 by 256 x 512 products, 341 µs as two jobs, took 312 as one product of twice
   the columns. */
#define MAX_PRODUCTS 8

typedef struct {
    Product p[MAX_PRODUCTS];
    long first[MAX_PRODUCTS + 1];     /* product q's items are [first[q], first[q + 1]) */
    int count;
} Products;

/* A product's item: one batch entry's panel over a run of rows (`Product.chunks` runs a
   panel).  The panel is packed unless this thread holds it already (once per item where the
   contraction is longer than a block). */
static void product_item(const void *ctx, long i, void *scratch) {
    const Products *set = ctx;
    Scratch *s = scratch;
    int q = 0;
    while (i >= set->first[q + 1])
        q++;
    const Product *p = &set->p[q];
    i -= set->first[q];
    if (across(p)) {
        across_item(p, i);
        return;
    }
    const long panels = (p->n + NR - 1) / NR, blocks = (p->m + MR - 1) / MR;
    const long group = i / p->chunks, chunk = i % p->chunks;
    const long r0 = blocks * chunk / p->chunks * MR, r1 = blocks * (chunk + 1) / p->chunks * MR;
    const long held = set->first[q] + group;  /* (distinct across the products) */
    rows(p, group / panels, group % panels * NR, r0, r1 < p->m ? r1 : p->m, s->panel,
         held == s->packed && p->k <= KC);
    s->packed = held;
}

static long items_of(const Product *p) {
    if (across(p))
        return across_items(p);
    return p->batch * ((p->n + NR - 1) / NR) * p->chunks;
}

/* The products on `threads` threads.  Each panel's rows are cut into as few runs as give every
   thread four items, so that a thread packs a panel once per run.  0 when done, 1 where
   memory for a panel could not be had. */
static int run(Products *set, int threads) {
    for (int q = 0; q < set->count; q++)
        set->p[q].chunks = 1;
    for (int doubled = 1; doubled;) {  /* every product's runs doubled, while too few items */
        long items = 0;
        for (int q = 0; q < set->count; q++)
            items += items_of(&set->p[q]);
        doubled = 0;
        for (int q = 0; items < 4L * threads && q < set->count; q++) {
            Product *p = &set->p[q];
            if (p->chunks * 2 <= (p->m + MR - 1) / MR)
                p->chunks *= 2, doubled = 1;
        }
    }
    set->first[0] = 0;
    for (int q = 0; q < set->count; q++)
        set->first[q + 1] = set->first[q] + items_of(&set->p[q]);
    Scratch mine = {aligned_alloc(64, sizeof(float) * KC * NR), -1};
    if (mine.panel == NULL)
        return 1;
    dispatch(product_item, set, set->first[set->count], threads, &mine);
    free(mine.panel);
    return 0;
}

static int fits(const Py_buffer *v, int nd) {
    if (v->ndim != nd || v->itemsize != 4 || v->format == NULL || strcmp(v->format, "f") != 0)
        return 0;
    for (int d = 0; d < nd; d++)
        if (v->strides[d] % 4 != 0)
            return 0;
    return 1;
}

/* Product `p` of out = a @ b from their buffers: 0 where they are not float32 arrays of the
   same number of dimensions and matching shapes. */
static int product_of(const Py_buffer *v, Product *p) {
    const int nd = v[0].ndim;
    if (nd < 2 || nd - 2 > MAX_DIMS || !fits(&v[0], nd) || !fits(&v[1], nd) || !fits(&v[2], nd))
        return 0;
    memset(p, 0, sizeof *p);
    p->dims = nd - 2;
    p->m = v[1].shape[nd - 2], p->k = v[1].shape[nd - 1], p->n = v[2].shape[nd - 1];
    if (v[2].shape[nd - 2] != p->k || v[0].shape[nd - 2] != p->m || v[0].shape[nd - 1] != p->n)
        return 0;
    p->batch = 1;
    for (int d = 0; d < nd; d++) {
        if (d < p->dims) {
            p->shape[d] = v[0].shape[d];
            if (v[1].shape[d] != p->shape[d] || v[2].shape[d] != p->shape[d])
                return 0;
            p->batch *= p->shape[d];
        }
        p->so[d] = v[0].strides[d] / 4, p->sa[d] = v[1].strides[d] / 4,
        p->sb[d] = v[2].strides[d] / 4;
    }
    p->out = v[0].buf, p->a = v[1].buf, p->b = v[2].buf;
    p->scale = 1.0f;
    p->period = p->m > 0 ? p->m : 1;
    return 1;
}

/* The addend `c` of product `p` (of `nd` dimensions) from its buffer: 0 where it is not a
   float32 array of nd dimensions each out's extent or 1 (broadcast), or for the rows a
   divisor of out's, which out's rows repeat (`period`: the query heads of a group, rows of
   one product, each adding the mask the addend's rows hold). */
static int addend_of(const Py_buffer *c, Product *p, int nd) {
    if (!fits(c, nd))
        return 0;
    for (int d = 0; d < nd; d++) {
        const long extent = d < p->dims ? p->shape[d] : d == p->dims ? p->m : p->n;
        const int period = d == p->dims && c->shape[d] > 0 && extent % c->shape[d] == 0;
        if (c->shape[d] != extent && c->shape[d] != 1 && !period)
            return 0;
        p->sc[d] = c->shape[d] == 1 ? 0 : c->strides[d] / 4;
        if (d == p->dims && c->shape[d] > 1)
            p->period = c->shape[d];
    }
    p->c = c->buf;
    return 1;
}

/* b's panels packed beforehand, `panels` (`bb_pack`), for product `p`: 0 where it is not a
   contiguous float32 array of b's panels, K rows of NR floats each, aligned to a vector, or
   the product has a batch. */
static int panels_of(const Py_buffer *v, Product *p) {
    if (p->dims != 0 || !fits(v, 3) || (unsigned long)v->buf % (4 * W) != 0 ||
        v->shape[0] != (p->n + NR - 1) / NR ||
        v->shape[1] != p->k || v->shape[2] != NR || v->strides[2] != 4 ||
        v->strides[1] != 4 * NR || v->strides[0] != 4 * NR * p->k)
        return 0;
    p->panels = v->buf;
    return 1;
}

/* out = c + scale a @ b for each group of six (out, a, b, c, scale, panels) of the `n`
   `arrays` (c None where there is no addend, scale a Python float, panels b packed
   beforehand or None), as one job on `threads` threads: 0 when done; 1 (no Python error set)
   where some group does not fit (`product_of`, `addend_of`, `panels_of`), there are more than
   MAX_PRODUCTS or memory ran out: the caller falls back to numpy. */
int bb_matmuls(PyObject *const *arrays, long n, int threads) {
    const long count = n / 6;
    if (n % 6 != 0 || count < 1 || count > MAX_PRODUCTS)
        return 1;
    Py_buffer v[5 * MAX_PRODUCTS];
    int held[5 * MAX_PRODUCTS] = {0};
    Products set = {.count = 0};
    int ok = 1;
    for (long q = 0; ok && q < count; q++)
        for (long k = 0; ok && k < 5; k++) {
            PyObject *array = arrays[6 * q + (k < 4 ? k : 5)];
            if (k >= 3 && array == Py_None)
                continue;
            int flags = PyBUF_STRIDES | PyBUF_FORMAT | (k == 0 ? PyBUF_WRITABLE : 0);
            held[5 * q + k] = ok = PyObject_GetBuffer(array, &v[5 * q + k], flags) == 0;
            if (!ok)
                PyErr_Clear();
        }
    for (int q = 0; ok && q < count; q++) {
        const double scale = PyFloat_AsDouble(arrays[6 * q + 4]);
        ok = !PyErr_Occurred() && product_of(&v[5 * q], &set.p[q]) &&
             (!held[5 * q + 3] || addend_of(&v[5 * q + 3], &set.p[q], v[5 * q].ndim)) &&
             (!held[5 * q + 4] || panels_of(&v[5 * q + 4], &set.p[q]));
        set.p[q].scale = (float)scale;
        PyErr_Clear();
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (int q = 0; q < count; q++) {  /* the empty ones now: the job takes the rest */
            const Product *p = &set.p[q];
            if (p->k == 0) {
                for (long e = 0; e < p->batch; e++) {
                    float *out = p->out + offset(p, p->so, e);
                    for (long r = 0; r < p->m; r++)
                        for (long j = 0; j < p->n; j++)
                            out[r * p->so[p->dims] + j * p->so[p->dims + 1]] = 0.0f;
                    finish(p, 1.0f, e, 0, 0, p->m, p->n);
                }
            } else if (p->m > 0 && p->n > 0) {
                set.p[set.count++] = *p;
            }
        }
        if (set.count > 0)
            ok = run(&set, threads < 1 ? 1 : threads) == 0;
        Py_END_ALLOW_THREADS
    }
    for (long k = 0; k < 5 * count; k++)
        if (held[k])
            PyBuffer_Release(&v[k]);
    return !ok;
}

/* out = c + scale a @ b (c None: no addend; panels: b packed beforehand, or None) on
   `threads` threads (`bb_matmuls` of one). */
int bb_matmul(PyObject *out, PyObject *a, PyObject *b, PyObject *c, PyObject *scale,
              PyObject *panels, int threads) {
    PyObject *const arrays[6] = {out, a, b, c, scale, panels};
    return bb_matmuls(arrays, 6, threads);
}

/* ---------------------------------------------------------------------------------------
   Window products: one row per batch entry, b a window whose taps and positions are each
   several dimensions that no view merges.  A depthwise 2-D convolution, y[c, i, j] = sum over
   taps (s, t) of w[c, s, t] x[c, i + s, j + t] (x padded), reads x's rows by i and by s:
   (s, t) and (i, j) merge only in a copy, which took MBConv's 3 x 3 window over 3072 channels
   of a 10 x 10 image 4.6 ms on 2 cores of an AMD EPYC, its product then 0.7.  Here each tap
   adds a's number times b's positions into out, a few rows of the innermost positions at a
   time (`window_rows`), W positions a register: out[e, n] = sum over taps t of
   a[e, t] b[e, t, n], e, t and n each any number of dimensions, out contiguous. */

typedef struct {
    long entries, per;                /* batch entries, and how many an item takes */
    int dims;                         /* batch dimensions */
    long shape[MAX_DIMS], sa[MAX_DIMS], sb[MAX_DIMS];  /* the batch's, a's and b's strides */
    long taps, rows, inner;           /* taps; positions, rows of `inner` innermost ones */
    const long *at, *bt, *br;         /* each tap's offset in a and in b; each row's in b */
    long sbn;                         /* b's stride along the innermost positions */
    const float *a, *b;
    float *out;
} Window;

/* Rows of a window product summed at once, each in a register of its own: one row's taps are
   a chain of dependent multiply-adds, which ConvNeXt's 7 x 7 window over 768 channels of a
   10 x 10 image ran at 36 GFLOP/s on 2 cores of a Xeon (its 10 rows 5 at a time: 63). */
#define WR 5

/* Rows r .. r + R - 1 (R <= WR, a constant where it is inlined) of entry a, b of a window
   product into out: each W positions of them summed over the taps in registers. */
static inline __attribute__((always_inline)) void
window_rows(const Window *w, const float *a, const float *b, float *out, long r, const int R) {
    const long n = w->inner, sbn = w->sbn;
    for (long j = 0; j < n; j += W) {
        const long count = n - j < W ? n - j : W;
        const float *row[WR];
        for (int q = 0; q < R; q++)
            row[q] = b + w->br[r + q] + j * sbn;
        vec acc[WR] = {{0}};
        if (count == W && sbn == 1)
            for (long t = 0; t < w->taps; t++) {
                const float x = a[w->at[t]];
#pragma GCC unroll 5
                for (int q = 0; q < R; q++)
                    acc[q] += x * *(const vec *)(row[q] + w->bt[t]);
            }
        else
            for (long t = 0; t < w->taps; t++) {
                const float x = a[w->at[t]];
#pragma GCC unroll 5
                for (int q = 0; q < R; q++)
                    acc[q] += x * first_floats(row[q] + w->bt[t], count, sbn);
            }
#pragma GCC unroll 5
        for (int q = 0; q < R; q++)  /* (unrolled: the registers stay registers) */
            first_floats_into(out + (r + q) * n + j, acc[q], count);
    }
}

/* Entries [item * per, (item + 1) * per) of a window product, their rows in groups of at most
   WR as even as can be (10 rows: 5 and 5, not 5, 5 and none; 16: four of 4). */
static void window_item(const void *ctx, long item, void *scratch) {
    (void)scratch;
    const Window *w = ctx;
    const long last = (item + 1) * w->per < w->entries ? (item + 1) * w->per : w->entries;
    const long groups = (w->rows + WR - 1) / WR;
    for (long e = item * w->per; e < last; e++) {
        const float *a = w->a + offset_of(w->shape, w->sa, w->dims, e);
        const float *b = w->b + offset_of(w->shape, w->sb, w->dims, e);
        float *out = w->out + e * w->rows * w->inner;
        for (long g = 0, r = 0; g < groups; g++) {
            const long rows = w->rows / groups + (g < w->rows % groups);
            switch (rows) {
            case 1: window_rows(w, a, b, out, r, 1); break;
            case 2: window_rows(w, a, b, out, r, 2); break;
            case 3: window_rows(w, a, b, out, r, 3); break;
            case 4: window_rows(w, a, b, out, r, 4); break;
            default: window_rows(w, a, b, out, r, WR); break;
            }
            r += rows;
        }
    }
}

/* The offsets of elements 0 .. count - 1 of dimensions of `extents`, at `strides`. */
static void offsets_of(const long *extents, const long *strides, int dims, long count,
                       long *offsets) {
    for (long i = 0; i < count; i++)
        offsets[i] = offset_of(extents, strides, dims, i);
}

/* out = a's taps times b's window (`Window`) for a of `batch` + T dimensions, b of batch + T
   + N and out of batch + N (T: the taps, N: the positions, at least one), each of a's and
   b's dimensions its out's extent or 1 (broadcast), out contiguous: 0 when done, 1 where
   the arrays do not fit or memory ran out (the caller falls back to numpy). */
int bb_window(PyObject *out, PyObject *a, PyObject *b, PyObject *batch, int threads) {
    Py_buffer v[3];
    int held = 0, ok = 1;
    for (; ok && held < 3; held++) {
        PyObject *array = held == 0 ? out : held == 1 ? a : b;
        ok = PyObject_GetBuffer(array, &v[held], PyBUF_STRIDES | PyBUF_FORMAT |
                                (held == 0 ? PyBUF_WRITABLE : 0)) == 0;
        if (!ok) {
            PyErr_Clear();
            break;
        }
    }
    const long dims = ok ? PyLong_AsLong(batch) : -1;
    PyErr_Clear();
    const int nt = ok ? v[1].ndim - (int)dims : 0, nn = ok ? v[0].ndim - (int)dims : 0;
    ok = ok && dims >= 0 && dims <= MAX_DIMS && nt >= 1 && nn >= 1 && nt + nn <= MAX_DIMS &&
         fits(&v[0], v[0].ndim) && fits(&v[1], v[1].ndim) && fits(&v[2], v[2].ndim) &&
         v[2].ndim == dims + nt + nn && PyBuffer_IsContiguous(&v[0], 'C');
    Window w = {.dims = (int)dims, .entries = 1, .taps = 1, .rows = 1};
    long kshape[MAX_DIMS], ka[MAX_DIMS], kb[MAX_DIMS], nshape[MAX_DIMS], nb[MAX_DIMS];
    for (int d = 0; ok && d < dims + nt + nn; d++) {  /* extents, broadcast strides */
        const int tap = d >= dims && d < dims + nt, cell = d >= dims + nt;
        const long extent = !tap ? v[0].shape[cell ? d - nt : d]
                            : v[1].shape[d] > v[2].shape[d] ? v[1].shape[d] : v[2].shape[d];
        const long sb = v[2].shape[d] == 1 ? 0 : v[2].strides[d] / 4;
        const long sa = cell || v[1].shape[d] == 1 ? 0 : v[1].strides[d] / 4;
        ok = v[2].shape[d] == extent || v[2].shape[d] == 1;
        if (!cell)
            ok = ok && (v[1].shape[d] == extent || v[1].shape[d] == 1);
        if (tap)
            kshape[d - dims] = extent, ka[d - dims] = sa, kb[d - dims] = sb, w.taps *= extent;
        else if (cell)
            nshape[d - dims - nt] = extent, nb[d - dims - nt] = sb;
        else
            w.shape[d] = extent, w.sa[d] = sa, w.sb[d] = sb, w.entries *= extent;
    }
    long *tables = NULL;
    if (ok) {
        w.inner = nshape[nn - 1], w.sbn = nb[nn - 1];
        for (int d = 0; d < nn - 1; d++)
            w.rows *= nshape[d];
        tables = malloc(sizeof(long) * (2 * w.taps + w.rows + 1));
        ok = tables != NULL;
    }
    if (ok && w.entries * w.rows * w.inner > 0 && w.taps > 0) {
        offsets_of(kshape, ka, nt, w.taps, tables);
        offsets_of(kshape, kb, nt, w.taps, tables + w.taps);
        offsets_of(nshape, nb, nn - 1, w.rows, tables + 2 * w.taps);
        w.at = tables, w.bt = tables + w.taps, w.br = tables + 2 * w.taps;
        w.a = v[1].buf, w.b = v[2].buf, w.out = v[0].buf;
        const long work = w.taps * w.rows * w.inner;  /* items of 16,384 multiply-adds at least */
        w.per = (16384 + work - 1) / work;
        Py_BEGIN_ALLOW_THREADS
        bb_parallel_for(window_item, &w, (w.entries + w.per - 1) / w.per,
                        threads < 1 ? 1 : threads);
        Py_END_ALLOW_THREADS
    } else if (ok) {
        memset(v[0].buf, 0, v[0].len);
    }
    free(tables);
    for (int k = 0; k < held; k++)
        PyBuffer_Release(&v[k]);
    return !ok;
}

/* ---------------------------------------------------------------------------------------
   Copies between float32 arrays of one shape and any strides: a window's padded copy of its
   values (`numpy_runtime._window`), whose rows numpy copied a short run at a time: MBConv's
   10 x 10 images, 3072 of them, into rows of 12 took 118-180 µs on a Xeon (in C: 37). */

typedef struct {
    int dims;                          /* the dimensions above the innermost */
    long shape[MAX_DIMS], so[MAX_DIMS], sv[MAX_DIMS];
    long n, son, svn;                  /* the innermost: extent, out's and values' strides */
    long rows, per;                    /* rows of the innermost, and how many an item takes */
    float *out;
    const float *values;
} Copy;

/* Rows [item * per, (item + 1) * per) of a copy, walked by an index carried from row to row
   (two divisions a row, `offset_of`'s, took longer than copying a row of 10 floats). */
static void copy_item(const void *ctx, long item, void *scratch) {
    (void)scratch;
    const Copy *c = ctx;
    const long first = item * c->per;
    const long last = first + c->per < c->rows ? first + c->per : c->rows;
    long at[MAX_DIMS];
    for (long d = c->dims - 1, rest = first; d >= 0; d--)
        at[d] = rest % c->shape[d], rest /= c->shape[d];
    float *o = c->out + offset_of(c->shape, c->so, c->dims, first);
    const float *v = c->values ? c->values + offset_of(c->shape, c->sv, c->dims, first) : NULL;
    for (long r = first; r < last; r++) {
        if (v == NULL) {
            for (long j = 0; j < c->n; j++)
                o[j * c->son] = 0.0f;
        } else if (c->son == 1 && c->svn == 1) {
            long j = 0;
            for (; j + W <= c->n; j += W)
                *(vec *)(o + j) = *(const vec *)(v + j);
            if (j < c->n)
                first_floats_into(o + j, first_floats(v + j, c->n - j, 1), c->n - j);
        } else {
            for (long j = 0; j < c->n; j++)
                o[j * c->son] = v[j * c->svn];
        }
        for (int d = c->dims - 1; d >= 0; d--) {  /* the next row */
            o += c->so[d];
            v = v ? v + c->sv[d] : NULL;
            if (++at[d] < c->shape[d])
                break;
            o -= c->so[d] * c->shape[d];
            v = v ? v - c->sv[d] * c->shape[d] : NULL;
            at[d] = 0;
        }
    }
}

/* out[...] = values (zeros where values is None) for float32 arrays of one shape, on
   `threads` threads: 0 when done, 1 where they do not fit (the caller copies with numpy).
   Dimensions both arrays walk in step merge, so that a row is as long as can be. */
int bb_copy(PyObject *out, PyObject *values, int threads) {
    Py_buffer v[2];
    const int given = values != Py_None;
    if (PyObject_GetBuffer(out, &v[0], PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
        PyErr_Clear();
        return 1;
    }
    if (given && PyObject_GetBuffer(values, &v[1], PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        PyBuffer_Release(&v[0]);
        return 1;
    }
    const int nd = v[0].ndim;
    int ok = nd <= MAX_DIMS && fits(&v[0], nd) && (!given || fits(&v[1], nd));
    for (int d = 0; ok && given && d < nd; d++)
        ok = v[0].shape[d] == v[1].shape[d];
    if (ok && v[0].len > 0) {
        Copy c = {.dims = 0, .n = 1, .son = 1, .svn = 1, .rows = 1, .out = v[0].buf,
                  .values = given ? v[1].buf : NULL};
        long shape[MAX_DIMS + 1], so[MAX_DIMS + 1], sv[MAX_DIMS + 1];
        int m = 0;  /* the merged dimensions, extents of 1 left out */
        for (int d = 0; d < nd; d++) {
            const long n = v[0].shape[d], o = v[0].strides[d] / 4;
            const long x = given ? v[1].strides[d] / 4 : 0;
            if (n == 1)
                continue;
            if (m > 0 && so[m - 1] == o * n && sv[m - 1] == x * n) {
                shape[m - 1] *= n, so[m - 1] = o, sv[m - 1] = x;
                continue;
            }
            shape[m] = n, so[m] = o, sv[m] = x, m++;
        }
        if (m > 0) {
            c.dims = m - 1, c.n = shape[m - 1], c.son = so[m - 1], c.svn = sv[m - 1];
            for (int d = 0; d < m - 1; d++)
                c.shape[d] = shape[d], c.so[d] = so[d], c.sv[d] = sv[d], c.rows *= shape[d];
        }
        c.per = (16384 + c.n - 1) / c.n;  /* items of 16,384 floats at least */
        Py_BEGIN_ALLOW_THREADS
        bb_parallel_for(copy_item, &c, (c.rows + c.per - 1) / c.per, threads < 1 ? 1 : threads);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&v[0]);
    if (given)
        PyBuffer_Release(&v[1]);
    return !ok;
}

/* The 2-D float32 array b (K x N) packed into `out`, a contiguous float32 array of its
   panels, each K rows of NR floats (columns past N zero), which products then read in place
   of packing b each call (`panels`): 0 when done, 1 where the arrays do not fit.  For a
   constant b (a model's weight) read each call: packing it took 10-20% of 128 x 768 by 768 x
   3072, whose 9.4 MB of weights the threads read from memory a panel at a time. */
int bb_pack(PyObject *out, PyObject *b, int threads) {
    (void)threads;
    Py_buffer v[2];
    if (PyObject_GetBuffer(out, &v[0], PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
        PyErr_Clear();
        return 1;
    }
    if (PyObject_GetBuffer(b, &v[1], PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        PyBuffer_Release(&v[0]);
        return 1;
    }
    Product p = {.dims = 0};
    int ok = fits(&v[1], 2);
    if (ok) {
        p.k = v[1].shape[0], p.n = v[1].shape[1];
        ok = panels_of(&v[0], &p);
    }
    if (ok) {
        const long sk = v[1].strides[0] / 4, sn = v[1].strides[1] / 4;
        Py_BEGIN_ALLOW_THREADS
        for (long j = 0; j < p.n; j += NR)
            pack((const float *)v[1].buf + j * sn, sk, sn, p.k, p.n - j < NR ? p.n - j : NR,
                 (float *)p.panels + j * p.k);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&v[0]);
    PyBuffer_Release(&v[1]);
    return !ok;
}

/* The address of an array's first element, 0 where it has none to give: the key its kept
   panels are found by (numpy's `__array_interface__` builds a dict to say it, 2 µs a product). */
long bb_address(PyObject *array, int threads) {
    (void)threads;
    Py_buffer v;
    if (PyObject_GetBuffer(array, &v, PyBUF_STRIDES) != 0) {
        PyErr_Clear();
        return 0;
    }
    const long address = (long)(intptr_t)v.buf;
    PyBuffer_Release(&v);
    return address;
}

/* The columns of a panel (`bb_pack`'s NR). */
int bb_panel_width(int threads) {
    (void)threads;
    return NR;
}
