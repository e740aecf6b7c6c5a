/* Small-batch matmuls: y = x W^T (+ bias) for a few bfloat16 rows, over oneDNN's own
 * packed weights (no copy of their own), on AMX tiles or on AVX-512 bf16 dot products.
 *
 * Included by rowops.c; called through engine/models/rowmatmul.py. A decode step
 * multiplies a few rows by every weight of the model once. oneDNN pays ~17 us of set-up
 * per call and, for a few rows, leaves much of the core unused: on one core of an AMX
 * Xeon it streamed SmolLM2's weights at 8.3-9.7 GB/s where the AMX kernel here reads the
 * very same packed bytes at 10-12.6 GB/s (a bare read loop: 14.5); on a Zen 4 core its
 * AVX-512 bf16 matmul of 16 rows ran at ~150 GFLOP/s against ~218 for large products,
 * which the AVX-512 kernel here comes close to (numbers in rowmatmul.py).
 *
 * AMX (oneDNN's AB16b32a2b layout: per 32 outputs, per 32 inputs, 16 input pairs x 32
 * outputs x 2): x rows are tile A straight from memory (up to 16 rows x 32 inputs); the
 * packed weights are tile B (16 input pairs x 16 outputs), read as one sequential stream
 * per 32 outputs; the accumulators hold 16 rows x 16 outputs in float32.
 *
 * AVX-512 bf16 without AMX (oneDNN's AB16b64a2b layout there: per 64 outputs, input
 * pairs x 64 outputs x 2): up to 6 rows x 64 outputs of float32 accumulators in 24
 * registers, one VDPBF16PS per input pair, 16 outputs and one row.
 *
 * Both: every output is one float32 sum over the input pairs in their order, whatever the
 * number of rows (a row gets the same bits alone or in a batch); rowmatmul.py says where
 * that equals oneDNN's own bits (measured). With two threads the upper half of each
 * call's outputs goes to the second thread of torch's own OpenMP team (or, where the
 * process has no OpenMP runtime, to a helper thread of this library's).
 *
 * Shapes: inputs multiples of 32; outputs multiples of 32 on AMX, of 16 on AVX-512 bf16
 * (where oneDNN pads the last block to 64 outputs).
 */

#if defined(__AVX512F__) && defined(__linux__) && \
    ((defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(__AVX512BF16__))
#include <dlfcn.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* acc: rows x 16 float32 (row stride lda floats); y[m][0..15] = bf16(acc[m] + bias),
 * rounded as every bf16 store of rowops.c (vstore_bf16). bias: 16 values or NULL. */
static inline void store_rows(const float *acc, int64_t lda, int64_t rows, const bf16 *bias,
                              bf16 *y, int64_t ldy) {
    const vf add = bias ? vload_bf16(bias) : (vf){0};
    for (int64_t m = 0; m < rows; m++) vstore_bf16(y + m * ldy, vload_f32(acc + lda * m) + add);
}

/* One call's operands, and the outputs [n_begin, n_end) one thread computes. */
typedef struct {
    const bf16 *x, *packed, *bias;
    bf16 *y;
    int64_t m, ldx, k, ldy, n_begin, n_end;
} matmul_job;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

int rowmatmul_block(void) { return 32; } /* outputs per packed block */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int rowmatmul_ready(void) {
    /* Linux hands out the tile state per process on request (torch may have asked already). */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static void configure(int64_t rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) cfg.colsb[t] = 64; /* tile 7 unused: rows and bytes 0 */
    for (int t = 0; t < 4; t++) cfg.rows[t] = (uint8_t)rows; /* accumulators: rows x 16 */
    cfg.rows[4] = (uint8_t)rows;                             /* x: rows x 32 inputs */
    cfg.rows[5] = cfg.rows[6] = 16;                          /* weights: 16 pairs x 16 */
    _tile_loadconfig(&cfg);
}

/* One 32-input step of a 32-output block (weights w) into accumulators c0, c1; the
 * step's x columns are in tile 4. */
#define BLOCK_STEP(w, c0, c1)              \
    do {                                   \
        _tile_loadd(5, (w), 128);          \
        _tile_loadd(6, (w) + 32, 128);     \
        _tile_dpbf16ps(c0, 4, 5);          \
        _tile_dpbf16ps(c1, 4, 6);          \
    } while (0)

/* Accumulates x rows [rows x k] times the outputs of one or two 32-output blocks
 * (`pair`) into tiles 0-3 and writes them, rounded and with the bias, to y. */
static inline void block_rows(const bf16 *x, int64_t rows, int64_t ldx, int64_t kb,
                              const bf16 *w0, int64_t block, int pair, const bf16 *bias,
                              bf16 *y, int64_t ldy) {
    float acc[4][256] __attribute__((aligned(64)));
    const bf16 *w1 = w0 + block;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < kb; b++) {
        _tile_loadd(4, x + b * 32, ldx * 2);
        BLOCK_STEP(w0 + b * 1024, 0, 1);
        if (pair) BLOCK_STEP(w1 + b * 1024, 2, 3);
    }
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
    for (int j = 0; j < (pair ? 4 : 2); j++)
        store_rows(acc[j], 16, rows, bias ? bias + 16 * j : NULL, y + 16 * j, ldy);
}

/* Outputs are walked in pairs of blocks (64), rows in tiles of 16 inside each pair, so a
 * pair's weights (64 x k) come from memory once and from cache for the next 16 rows. */
static void matmul_range(const matmul_job *j) {
    const int64_t kb = j->k / 32, block = 32 * j->k; /* elements of one 32-output block */
    int64_t configured = -1;
    for (int64_t n0 = j->n_begin; n0 < j->n_end; n0 += 64) {
        const int pair = n0 + 64 <= j->n_end;
        const bf16 *w0 = j->packed + (n0 / 32) * block;
        for (int64_t m0 = 0; m0 < j->m; m0 += 16) {
            const int64_t rows = j->m - m0 < 16 ? j->m - m0 : 16;
            if (rows != configured) {
                configure(rows);
                configured = rows;
            }
            block_rows(j->x + m0 * j->ldx, rows, j->ldx, kb, w0, block, pair,
                       j->bias ? j->bias + n0 : NULL, j->y + m0 * j->ldy + n0, j->ldy);
        }
    }
    _tile_release();
}

int rowmatmul_plain_bf16(const bf16 *x, int64_t m, int64_t ldx, int64_t k, int64_t n,
                         const bf16 *w, int64_t ldw, const bf16 *bias, bf16 *y, int64_t ldy) {
    (void)x; (void)m; (void)ldx; (void)k; (void)n; (void)w; (void)ldw; (void)bias; (void)y;
    (void)ldy;
    return -1; /* AMX: torch's matmul already gives the kernel's bits (rowmatmul.py) */
}

#else /* AVX-512 bf16 dot products, no AMX */

int rowmatmul_block(void) { return 64; } /* outputs per packed block */

int rowmatmul_ready(void) { return 1; }

#define TILE_ROWS 6 /* 6 rows x 4 vectors of accumulators: 24 of the 32 registers */

/* rows (1..TILE_ROWS, a constant after inlining) x 64 outputs of one packed block w
 * ([pairs][64][2]), the first `vectors` x 16 of them rounded with the bias into y (a last
 * block oneDNN padded to 64 outputs holds fewer). */
static inline __attribute__((always_inline)) void tile_rows(const bf16 *x, int64_t ldx,
                                                            int64_t pairs, const bf16 *w,
                                                            const int rows, int vectors,
                                                            const bf16 *bias, bf16 *y,
                                                            int64_t ldy) {
    __m512 acc[TILE_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const bf16 *wp = w + p * 128;
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(wp);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(wp + 64);
        const __m512bh b3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * p, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
        }
    }
    float out[TILE_ROWS][64] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(out[r] + 16 * c, acc[r][c]);
    for (int c = 0; c < vectors; c++)
        store_rows(out[0] + 16 * c, 64, rows, bias ? bias + 16 * c : NULL, y + 16 * c, ldy);
}

/* Outputs are walked by packed block (64), rows in tiles of TILE_ROWS inside each, so a
 * block's weights (64 x k) come from memory once and from cache for the next rows. */
static void matmul_range(const matmul_job *j) {
    const int64_t pairs = j->k / 2, block = 64 * j->k;
    for (int64_t n0 = j->n_begin; n0 < j->n_end; n0 += 64) {
        const bf16 *w = j->packed + (n0 / 64) * block;
        const bf16 *bias = j->bias ? j->bias + n0 : NULL;
        const int vectors = (int)((j->n_end - n0 < 64 ? j->n_end - n0 : 64) / 16);
        for (int64_t m0 = 0; m0 < j->m; m0 += TILE_ROWS) {
            const bf16 *x = j->x + m0 * j->ldx;
            bf16 *y = j->y + m0 * j->ldy + n0;
            switch (j->m - m0 < TILE_ROWS ? j->m - m0 : TILE_ROWS) {
            case 1: tile_rows(x, j->ldx, pairs, w, 1, vectors, bias, y, j->ldy); break;
            case 2: tile_rows(x, j->ldx, pairs, w, 2, vectors, bias, y, j->ldy); break;
            case 3: tile_rows(x, j->ldx, pairs, w, 3, vectors, bias, y, j->ldy); break;
            case 4: tile_rows(x, j->ldx, pairs, w, 4, vectors, bias, y, j->ldy); break;
            case 5: tile_rows(x, j->ldx, pairs, w, 5, vectors, bias, y, j->ldy); break;
            default: tile_rows(x, j->ldx, pairs, w, 6, vectors, bias, y, j->ldy); break;
            }
        }
    }
}

/* r[o] = 16 input pairs (32-bit) of output o  ->  r[p] = pair p of the 16 outputs. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane: pairs 4L..4L+3 of rows i, i+1 */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + j], lane L: rows i..i+3 at pair 4L + j */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* lanes across the four row groups: a 4 x 4 transpose */
        const __m512i s0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        const __m512i s2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        t[j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
        t[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
    }
    for (int p = 0; p < 16; p++) r[p] = t[p];
}

/* The same sums from the checkpoint's row-major weights (w: [n][ldw]), for layers not
 * packed yet: a row gets the bits the packed kernel will give it once they are. Per 16
 * outputs, 16 input pairs of each output's row (one cache line) are loaded and transposed
 * in registers, so the weights stream row by row (16 sequential streams; gathering pairs
 * across rows instead ran the 1.5 GiB Llama's first pass 3x slower than torch's unpacked
 * matmul). It only runs in the first passes, while packing is spread over them
 * (packing.PACK_STEP_BYTES). */
#define PLAIN_ROWS 8 /* 8 accumulators beside the 16 transposed vectors */

/* rows (1..PLAIN_ROWS, a constant after inlining) x 16 outputs (their rows w[o * ldw]). */
static inline __attribute__((always_inline)) void plain_rows(const bf16 *x, int64_t ldx,
                                                             int64_t pairs, const bf16 *w,
                                                             int64_t ldw, const int rows,
                                                             const bf16 *bias, bf16 *y,
                                                             int64_t ldy) {
    __m512 acc[PLAIN_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const int count = pairs - p0 < 16 ? (int)(pairs - p0) : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        __m512i t[16];
        for (int o = 0; o < 16; o++) t[o] = _mm512_maskz_loadu_epi32(mask, w + o * ldw + 2 * p0);
        transpose16(t);
        for (int p = 0; p < count; p++) {
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, x + r * ldx + 2 * (p0 + p), 4);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair),
                                          (__m512bh)t[p]);
            }
        }
    }
    float out[PLAIN_ROWS][16] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++) _mm512_store_ps(out[r], acc[r]);
    store_rows(out[0], 16, rows, bias, y, ldy);
}

/* Outputs n0 .. n0 + 16 * vectors of w, packed as the packed kernel reads a block
 * (block: [pairs][64][2]; outputs past `vectors` zero). */
static void pack_block(const bf16 *w, int64_t ldw, int64_t pairs, int vectors, bf16 *block) {
    for (int g = 0; g < 4; g++) {
        for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
            const int count = pairs - p0 < 16 ? (int)(pairs - p0) : 16;
            __m512i t[16];
            if (g < vectors) {
                const __mmask16 mask = (__mmask16)((1u << count) - 1);
                const bf16 *rows16 = w + g * 16 * ldw + 2 * p0;
                for (int o = 0; o < 16; o++) t[o] = _mm512_maskz_loadu_epi32(mask, rows16 + o * ldw);
                transpose16(t);
            } else {
                for (int o = 0; o < 16; o++) t[o] = _mm512_setzero_si512();
            }
            for (int p = 0; p < count; p++)
                _mm512_storeu_si512(block + (p0 + p) * 128 + g * 32, t[p]);
        }
    }
}

/* Above one tile of rows, each 64 outputs' weights are packed once into a scratch block
 * and run through the packed kernel's tiles (6 rows x 64 outputs), instead of transposed
 * again for every PLAIN_ROWS rows. Measured on Zen 4, one thread, against torch's unpacked
 * matmul: 1 row 0.4-0.9x its time, 6 rows 0.6-1.3x, 16 rows 0.9-1.05x, 64-256 rows even
 * (without the scratch block 64-256 rows took 1.4-1.6x). */
#define PLAIN_PACK_ROWS (PLAIN_ROWS + 1)

int rowmatmul_plain_bf16(const bf16 *x, int64_t m, int64_t ldx, int64_t k, int64_t n,
                         const bf16 *w, int64_t ldw, const bf16 *bias, bf16 *y, int64_t ldy) {
    if (n % 16 || k % 2 || ldw % 2) return -1;
    const int64_t pairs = k / 2;
    if (m >= PLAIN_PACK_ROWS) {
        bf16 *block = aligned_alloc(64, (size_t)pairs * 256);
        if (block) {
            for (int64_t n0 = 0; n0 < n; n0 += 64) {
                const int vectors = (int)((n - n0 < 64 ? n - n0 : 64) / 16);
                pack_block(w + n0 * ldw, ldw, pairs, vectors, block);
                matmul_job job = {x, block, bias ? bias + n0 : NULL, y + n0, m, ldx, k, ldy, 0,
                                  16 * vectors};
                matmul_range(&job);
            }
            free(block);
            return 0;
        }
    }
    for (int64_t n0 = 0; n0 < n; n0 += 16) {
        const bf16 *rows16 = w + n0 * ldw, *b = bias ? bias + n0 : NULL;
        for (int64_t m0 = 0; m0 < m; m0 += PLAIN_ROWS) {
            const bf16 *xm = x + m0 * ldx;
            bf16 *ym = y + m0 * ldy + n0;
            switch (m - m0 < PLAIN_ROWS ? m - m0 : PLAIN_ROWS) {
            case 1: plain_rows(xm, ldx, pairs, rows16, ldw, 1, b, ym, ldy); break;
            case 2: plain_rows(xm, ldx, pairs, rows16, ldw, 2, b, ym, ldy); break;
            case 3: plain_rows(xm, ldx, pairs, rows16, ldw, 3, b, ym, ldy); break;
            case 4: plain_rows(xm, ldx, pairs, rows16, ldw, 4, b, ym, ldy); break;
            case 5: plain_rows(xm, ldx, pairs, rows16, ldw, 5, b, ym, ldy); break;
            case 6: plain_rows(xm, ldx, pairs, rows16, ldw, 6, b, ym, ldy); break;
            case 7: plain_rows(xm, ldx, pairs, rows16, ldw, 7, b, ym, ldy); break;
            default: plain_rows(xm, ldx, pairs, rows16, ldw, 8, b, ym, ldy); break;
            }
        }
    }
    return 0;
}

#endif

/* --- a second thread for two-thread processes ----------------------------------- *
 * The upper half of each call's outputs goes to a second thread (the same sums: the bits
 * do not depend on the split).
 *
 * First choice: torch's OpenMP team, through the runtime already in the process (torch's
 * libgomp, or libiomp's GOMP entry points). A thread of our own beside it was measured
 * to lose: after any torch operator that ran on two threads, torch's OpenMP worker spins
 * for milliseconds on the second core, and a helper of ours then shares that core with
 * it (Zen 4, SmolLM2 bf16, two threads: a 16-row decode step 24.0 ms with the own helper,
 * 19.1 ms on torch's team; one row 10.5 against 7.8 ms; the prefill of 16 prompts 159
 * against 87 ms). Sharing torch's team, the one thread that spins is the one that
 * computes. */

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn omp_parallel;
static int (*omp_thread)(void), (*omp_team)(void);
static int omp_state; /* 0 not looked up, 1 found, -1 none (or switched off) */
static int omp_forked; /* in a forked child: libgomp's team is not there, and waits for it */

static void omp_forget(void) {
    omp_forked = 1;
    omp_state = -1;
}

/* At load, not at first use: a child forked before the first call must not find it. */
__attribute__((constructor)) static void omp_watch_forks(void) {
    if (pthread_atfork(NULL, NULL, omp_forget) != 0) omp_forked = 1; /* unwatched: helper */
}

static int omp_found(void) {
    int state = __atomic_load_n(&omp_state, __ATOMIC_ACQUIRE);
    if (state) return state > 0;
    /* torch loads its OpenMP runtime into the global scope (libtorch_global_deps) */
    omp_parallel = (gomp_parallel_fn)dlsym(RTLD_DEFAULT, "GOMP_parallel");
    *(void **)&omp_thread = dlsym(RTLD_DEFAULT, "omp_get_thread_num");
    *(void **)&omp_team = dlsym(RTLD_DEFAULT, "omp_get_num_threads");
    state = omp_parallel && omp_thread && omp_team && !omp_forked ? 1 : -1;
    __atomic_store_n(&omp_state, state, __ATOMIC_RELEASE);
    return state > 0;
}

/* Which second thread two-thread calls use: 1 torch's OpenMP team, 2 a helper thread of
 * this library's (also in a forked child, where a torch operator on two threads hangs).
 * use: 0 look (OpenMP where found), 2 the own helper (tests compare). */
int rowmatmul_second_thread(int use) {
    if (use == 2) __atomic_store_n(&omp_state, -1, __ATOMIC_RELEASE);
    if (use == 0 && __atomic_load_n(&omp_state, __ATOMIC_ACQUIRE) < 0)
        __atomic_store_n(&omp_state, 0, __ATOMIC_RELEASE);
    return omp_found() ? 1 : 2;
}

static void omp_halves(void *data) {
    const matmul_job *halves = data; /* a team of one (nested, or limited) runs both */
    for (int i = omp_thread(); i < 2; i += omp_team()) matmul_range(&halves[i]);
}

/* Without OpenMP: one helper thread of our own. Between calls it spins briefly (a decode
 * step's matmuls come tens of microseconds apart), then sleeps on a futex until woken. */

#define HELPER_SPINS 4096 /* pauses before sleeping, ~0.2 ms */

static matmul_job helper_job;
static unsigned helper_generation, helper_done; /* __atomic accesses only */
static int helper_sleeping, helper_state;       /* state: 0 none, 1 running, -1 failed */
static pthread_mutex_t helper_lock = PTHREAD_MUTEX_INITIALIZER;

static long futex(unsigned *address, int op, unsigned value) {
    return syscall(SYS_futex, address, op, value, NULL, NULL, 0);
}

static void *helper_main(void *unused) {
    (void)unused;
    unsigned seen = 0;
    for (;;) {
        unsigned generation;
        int spins = 0;
        while ((generation = __atomic_load_n(&helper_generation, __ATOMIC_ACQUIRE)) == seen) {
            if (++spins < HELPER_SPINS) {
                _mm_pause();
                continue;
            }
            __atomic_store_n(&helper_sleeping, 1, __ATOMIC_SEQ_CST);
            futex(&helper_generation, FUTEX_WAIT_PRIVATE, seen); /* returns if it moved */
            __atomic_store_n(&helper_sleeping, 0, __ATOMIC_SEQ_CST);
            spins = 0;
        }
        seen = generation;
        matmul_range(&helper_job);
        __atomic_store_n(&helper_done, generation, __ATOMIC_RELEASE);
    }
    return NULL;
}

static void helper_forget(void) { /* in a forked child: the thread is not there */
    helper_state = 0;
    helper_generation = helper_done = 0;
    helper_sleeping = 0;
    pthread_mutex_init(&helper_lock, NULL);
}

static int helper_start(void) {
    int state = __atomic_load_n(&helper_state, __ATOMIC_ACQUIRE);
    if (state) return state > 0;
    static int fork_handler;
    if (!fork_handler) fork_handler = pthread_atfork(NULL, NULL, helper_forget) == 0 ? 1 : -1;
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    state = fork_handler > 0 && pthread_create(&thread, &attr, helper_main, NULL) == 0 ? 1 : -1;
    pthread_attr_destroy(&attr);
    __atomic_store_n(&helper_state, state, __ATOMIC_RELEASE);
    return state > 0;
}

/* y = x W^T (+ bias). x: [m, k] bfloat16 (row stride ldx); W: n x k in oneDNN's packed
 * bf16 layout ([n/B][k/2 input pairs][B outputs][2], B = rowmatmul_block()); bias:
 * [n] or NULL; y: [m, n] (row stride ldy). k a multiple of 32, n as the header says.
 * threads: 1, or 2 to give the upper half of the outputs to the helper thread. */
int rowmatmul_bf16(const bf16 *x, int64_t m, int64_t ldx, int64_t k, int64_t n,
                   const bf16 *packed, const bf16 *bias, bf16 *y, int64_t ldy, int64_t threads) {
    matmul_job job = {x, packed, bias, y, m, ldx, k, ldy, 0, n};
    if (threads < 2 || n < 256) {
        matmul_range(&job);
        return 0;
    }
    const int64_t split = n / 2 / 64 * 64; /* whole 64-output blocks (pairs on AMX) per side */
    if (omp_found()) {
        matmul_job halves[2] = {job, job};
        halves[0].n_end = halves[1].n_begin = split;
        omp_parallel(omp_halves, halves, 2, 0);
        return 0;
    }
    /* the lock: one caller at a time hands work to the helper; others run alone */
    if (pthread_mutex_trylock(&helper_lock) != 0) {
        matmul_range(&job);
        return 0;
    }
    if (!helper_start()) {
        pthread_mutex_unlock(&helper_lock);
        matmul_range(&job);
        return 0;
    }
    helper_job = job;
    helper_job.n_begin = split;
    job.n_end = split;
    unsigned generation = __atomic_add_fetch(&helper_generation, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&helper_sleeping, __ATOMIC_SEQ_CST))
        futex(&helper_generation, FUTEX_WAKE_PRIVATE, 1);
    matmul_range(&job);
    while (__atomic_load_n(&helper_done, __ATOMIC_ACQUIRE) != generation) _mm_pause();
    pthread_mutex_unlock(&helper_lock);
    return 0;
}

/* One decoder layer's tensors for decode_stack_bf16 (rowmatmul.py fills an array). */
typedef struct {
    const bf16 *inorm, *postnorm, *q_norm, *k_norm; /* q/k norms NULL where absent */
    const bf16 *qkv, *qkv_bias, *o, *o_bias;       /* packed weights (oneDNN's layout) */
    const bf16 *gate_up, *gate_up_bias, *down, *down_bias;
    bf16 *keys, *values; /* this layer's cache slabs */
    int64_t window;      /* 0: none */
} stack_layer;

/* A whole decode step's decoder layers for `rows` decode rows (no prompt rows), as
 * fastpath.LeanStack._run_fused computes them, operation for operation, with no Python
 * between: x += every layer's residual updates, in place. Scratch, all [rows, width]:
 * normed (hidden), qkv ((heads + 2 kv_heads) d), attended (heads d), delta (hidden),
 * up (2 intermediate), gated (intermediate); scratch_f: float32 for the attention. */
int decode_stack_bf16(bf16 *x, int64_t rows, int64_t hidden, int64_t layers,
                      const stack_layer *stack, int64_t heads, int64_t kv_heads, int64_t d,
                      int64_t intermediate, int64_t length, float eps, float qk_eps,
                      const bf16 *cos_, const bf16 *sin_, const int64_t *cache_rows,
                      const int64_t *positions, bf16 *normed, bf16 *qkv, bf16 *attended,
                      bf16 *delta, bf16 *up, bf16 *gated, float *scratch_f, int64_t threads) {
    const int64_t q_width = heads * d, kv_width = kv_heads * d;
    const int64_t qkv_width = q_width + 2 * kv_width, up_width = 2 * intermediate;
    const bf16 *residual = NULL;
    for (int64_t l = 0; l < layers; l++) {
        const stack_layer *L = stack + l;
        add_norm_bf16(x, hidden, residual, hidden, L->inorm, normed, hidden, rows, rows, hidden,
                      eps);
        rowmatmul_bf16(normed, rows, hidden, hidden, qkv_width, L->qkv, L->qkv_bias, qkv,
                       qkv_width, threads);
        rope_attend_bf16(qkv, qkv_width, qkv + q_width, qkv_width, qkv + q_width + kv_width,
                         qkv_width, cos_, sin_, d, L->q_norm, L->k_norm, qk_eps, L->keys,
                         L->values, cache_rows, positions, rows, heads, kv_heads, d, length,
                         rows, attended, q_width, rows, L->window, scratch_f);
        rowmatmul_bf16(attended, rows, q_width, q_width, hidden, L->o, L->o_bias, delta, hidden,
                       threads);
        add_norm_bf16(x, hidden, delta, hidden, L->postnorm, normed, hidden, rows, rows, hidden,
                      eps);
        rowmatmul_bf16(normed, rows, hidden, hidden, up_width, L->gate_up, L->gate_up_bias, up,
                       up_width, threads);
        silu_mul_bf16(up, up_width, up + intermediate, up_width, gated, intermediate, rows, rows,
                      intermediate);
        rowmatmul_bf16(gated, rows, intermediate, intermediate, hidden, L->down, L->down_bias,
                       delta, hidden, threads);
        residual = delta;
    }
    if (residual) add_rows_bf16(x, hidden, residual, hidden, rows, hidden);
    return 0;
}

#else /* neither AMX nor AVX-512 bf16 in this build: the Python side keeps oneDNN's */

int rowmatmul_ready(void) { return 0; }

int rowmatmul_block(void) { return 0; }

int rowmatmul_second_thread(int use) {
    (void)use;
    return 0;
}

int rowmatmul_bf16(const bf16 *x, int64_t m, int64_t ldx, int64_t k, int64_t n,
                   const bf16 *packed, const bf16 *bias, bf16 *y, int64_t ldy, int64_t threads) {
    (void)x; (void)m; (void)ldx; (void)k; (void)n; (void)packed; (void)bias; (void)y; (void)ldy;
    (void)threads;
    return -1;
}

int rowmatmul_plain_bf16(void) { return -1; }

int decode_stack_bf16(void) { return -1; } /* never called: rowmatmul_ready() said 0 */

#endif
