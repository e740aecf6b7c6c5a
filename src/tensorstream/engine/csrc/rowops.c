/* Row-wise operators of the native decoder layers, fused between the matmuls.
 *
 * Everything a decoder layer computes outside its four matmuls, for token rows of
 * bfloat16 or float32 activations: the residual add with the RMS norm that follows
 * it, q/k norms, the rotary rotation, the KV-cache write, decode attention over the
 * cache, and the SiLU gate. Loaded with ctypes (engine/models/rowops.py); no Python
 * or torch headers, so it builds in about a second.
 *
 * Why: at 16 rows a SmolLM2 decode step spent about as long in the ~25 torch
 * operators per layer around its matmuls as in the matmuls themselves, most of it
 * per-call overhead on tensors of a few KiB.
 *
 * Every result of a row depends on that row's inputs alone, computed in a fixed order
 * whatever the number of rows: a request gets the same bits alone or in any batch.
 * Roundings follow the reference models (transformers): norms in float32, scaled in
 * the activation dtype, each element-wise step rounded to it; attention scores,
 * softmax and the weighted sum of values in float32.
 *
 * The kernels are written once in rowops_impl.h over an element type and included
 * here for bfloat16 and float32. Vectors are GCC/Clang vector extensions, which the
 * compiler lowers to whatever this CPU has (AVX-512, AVX2, NEON...).
 */

#define _GNU_SOURCE /* RTLD_DEFAULT (rowmatmul.h) */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#define W 16 /* lanes of a vector */
/* head_dim at most W * MAX_HEAD_VECTORS (rowops.MAX_HEAD_DIM): the attention keeps one
 * query head's vectors, and its weighted sum's, in arrays of this size. */
#define MAX_HEAD_VECTORS 32 /* of W lanes; pairs of them: MAX_HEAD_VECTORS / 2 */
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));
typedef uint16_t bf16;

/* --- scalar and vector conversions ---------------------------------------------- */

static inline float bf16_to_f32(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u); /* quiet NaN */
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* to nearest, ties to even */
}

static inline vf vload_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf vload_bf16(const bf16 *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    return (vf)u;
}

static inline vu vround_bf16(vf f) {
    vu u = (vu)f;
    vu nan = (vu)((vi)((u & 0x7fffffffu) > 0x7f800000u));
    vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (((u >> 16) | 0x40u) & nan) | (rounded & ~nan);
}

static inline void vstore_bf16(bf16 *p, vf f) {
    vh h = __builtin_convertvector(vround_bf16(f), vh);
    memcpy(p, &h, sizeof h);
}

/* 2W consecutive values as two vectors, in a layout of the type's choosing (bf16: even
 * and odd elements, each one bit operation away from its 32-bit word; float: the two
 * halves). Dot products and weighted sums only need the same split for both operands,
 * and vstore2_* undoes it. */
static inline void vload2_bf16(const bf16 *p, vf *a, vf *b) {
    vu u;
    memcpy(&u, p, sizeof u);
    *a = (vf)(u << 16);
    *b = (vf)(u & 0xffff0000u);
}

static inline void vstore2_bf16(bf16 *p, vf a, vf b) {
    vu u = vround_bf16(a) | (vround_bf16(b) << 16);
    memcpy(p, &u, sizeof u);
}

static inline void vload2_f32(const float *p, vf *a, vf *b) {
    *a = vload_f32(p);
    *b = vload_f32(p + W);
}

static inline void vstore2_f32(float *p, vf a, vf b) {
    vstore_f32(p, a);
    vstore_f32(p + W, b);
}

/* f rounded to bf16 and back: an element-wise step of a bf16 model. */
static inline vf vcut_bf16(vf f) { return (vf)(vround_bf16(f) << 16); }
static inline float cut_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float hsum(vf v) {
    /* a fixed tree, the same order for every row: halves, quarters, then pairs */
#if defined(__clang__) || __GNUC__ >= 12
    typedef float v8f __attribute__((vector_size(32)));
    typedef float v4f __attribute__((vector_size(16)));
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
#else
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = v[i] + v[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < W; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline vf vsplat(float x) { return (vf){0} + x; }

/* exp, accurate to ~2 ulp over the normal range; 0 below e^-87 (no denormals). */
static inline vf vexp(vf x) {
    vi tiny = x < vsplat(-87.0f), huge = x > vsplat(88.0f);
    x = (vf)(((vi)x & ~(tiny | huge)) | ((vi)vsplat(88.0f) & huge));
    const vf magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & ~tiny);
}

static inline float sexp(float x) { return vexp(vsplat(x))[0]; }

/* The first n < W values of p as a vector, the rest filled with `fill`. */
static inline vf vload_part(const float *p, int64_t n, float fill) {
    vf v = vsplat(fill);
    for (int64_t i = 0; i < n; i++) v[i] = p[i];
    return v;
}

/* Denormal results only cost time in attention (tiny weights of far-away keys): flush
 * them there, and restore the caller's mode after. */
static inline unsigned ftz_on(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned mode = _mm_getcsr();
    _mm_setcsr(mode | 0x8040u); /* FTZ | DAZ */
    return mode;
#else
    return 0;
#endif
}

static inline void ftz_restore(unsigned mode) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(mode);
#else
    (void)mode;
#endif
}

/* --- the kernels, once per element type ----------------------------------------- */

#define T bf16
#define SUFFIX(name) name##_bf16
#define LOAD bf16_to_f32
#define STORE f32_to_bf16
#define CUT cut_bf16
#define VLOAD vload_bf16
#define VSTORE vstore_bf16
#define VCUT vcut_bf16
#define VLOAD2 vload2_bf16
#define VSTORE2 vstore2_bf16
#include "rowops_impl.h"
#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef CUT
#undef VLOAD
#undef VSTORE
#undef VCUT
#undef VLOAD2
#undef VSTORE2

static inline float id_f32(float f) { return f; }
static inline vf vid_f32(vf f) { return f; }

#define T float
#define SUFFIX(name) name##_float
#define LOAD id_f32
#define STORE id_f32
#define CUT id_f32
#define VLOAD vload_f32
#define VSTORE vstore_f32
#define VCUT vid_f32
#define VLOAD2 vload2_f32
#define VSTORE2 vstore2_f32
#include "rowops_impl.h"

#include "rowmatmul.h"

/* The version the Python side checks before binding (bump with any signature change). */
int rowops_abi(void) { return 7; }
