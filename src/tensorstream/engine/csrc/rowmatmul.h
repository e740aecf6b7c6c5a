/* Small-batch matmuls on AMX tiles: y = x W^T (+ bias) for a few bfloat16 rows.
 *
 * Included by rowops.c; called through engine/models/rowmatmul.py. A decode step
 * multiplies a few rows by every weight of the model once, so it is bound by streaming
 * the weights from memory. On one core of an AMX Xeon, oneDNN's packed matmul streamed
 * SmolLM2's weights at 8.3-9.7 GB/s and paid ~17 us of set-up per call; this kernel reads
 * the very same packed bytes (oneDNN's AB16b32a2b layout, no copy of its own) at
 * 10-12.6 GB/s, against 14.5 GB/s for a bare read loop.
 *
 * x rows are tile A straight from memory (up to 16 rows x 32 inputs); the packed weights
 * are tile B (16 input pairs x 16 outputs), read as one sequential stream per 32 outputs;
 * the accumulators hold 16 rows x 16 outputs in float32. Every output is the same sum in
 * the same order whatever the number of rows (a row gets the same bits alone or in a
 * batch), and for 3-32 rows the same as oneDNN's (measured; rowmatmul.py says where).
 *
 * With two threads a helper thread takes the upper half of each call's outputs.
 *
 * Shapes: inputs and outputs multiples of 32.
 */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

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

/* acc: rows x 16 float32 (64-byte rows); y[m][0..15] = bf16(acc[m] + bias), rounded as
 * every bf16 store of rowops.c (vstore_bf16). bias: 16 values or NULL. */
static inline void store_rows(const float *acc, int64_t rows, const bf16 *bias, bf16 *y,
                              int64_t ldy) {
    const vf add = bias ? vload_bf16(bias) : (vf){0};
    for (int64_t m = 0; m < rows; m++) vstore_bf16(y + m * ldy, vload_f32(acc + 16 * m) + add);
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
        store_rows(acc[j], rows, bias ? bias + 16 * j : NULL, y + 16 * j, ldy);
}

/* One call's operands, and the outputs [n_begin, n_end) one thread computes. */
typedef struct {
    const bf16 *x, *packed, *bias;
    bf16 *y;
    int64_t m, ldx, k, ldy, n_begin, n_end;
} matmul_job;

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

/* --- a second thread for two-thread processes ----------------------------------- *
 * One helper thread takes the upper half of each call's outputs (the same sums: the
 * bits do not depend on the split). Between calls it spins briefly (a decode step's
 * matmuls come tens of microseconds apart), then sleeps on a futex until woken. */

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
 * bf16 layout for AMX (AB16b32a2b: [n/32][k/32][16 input pairs][32 outputs][2]); bias:
 * [n] or NULL; y: [m, n] (row stride ldy). n and k multiples of 32. threads: 1, or 2 to
 * give the upper half of the outputs to the helper thread. */
int rowmatmul_bf16(const bf16 *x, int64_t m, int64_t ldx, int64_t k, int64_t n,
                   const bf16 *packed, const bf16 *bias, bf16 *y, int64_t ldy, int64_t threads) {
    matmul_job job = {x, packed, bias, y, m, ldx, k, ldy, 0, n};
    /* the lock: one caller at a time hands work to the helper; others run alone */
    if (threads < 2 || n < 256 || pthread_mutex_trylock(&helper_lock) != 0) {
        matmul_range(&job);
        return 0;
    }
    if (!helper_start()) {
        pthread_mutex_unlock(&helper_lock);
        matmul_range(&job);
        return 0;
    }
    const int64_t split = n / 2 / 64 * 64; /* whole pairs of blocks on each side */
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

#else /* no AMX in this build: the Python side keeps oneDNN's matmuls */

int rowmatmul_ready(void) { return 0; }

int rowmatmul_bf16(const bf16 *x, int64_t m, int64_t ldx, int64_t k, int64_t n,
                   const bf16 *packed, const bf16 *bias, bf16 *y, int64_t ldy, int64_t threads) {
    (void)x; (void)m; (void)ldx; (void)k; (void)n; (void)packed; (void)bias; (void)y; (void)ldy;
    (void)threads;
    return -1;
}

int decode_stack_bf16(void) { return -1; } /* never called: rowmatmul_ready() said 0 */

#endif
