/* The row operators over one element type T (included by rowops.c, once per type).
 *
 * Expects: T; SUFFIX(name); LOAD/STORE/CUT (scalar: T -> float, float -> T, a float
 * rounded to T); VLOAD/VSTORE/VCUT (the same over W-lane vectors). Loops run whole
 * vectors first, then a scalar tail, in the same order for every row.
 */

/* sum of x[i]^2: vector lanes, their fixed tree, then the tail */
static inline float SUFFIX(sumsq)(const T *x, int64_t n) {
    vf acc = vsplat(0.0f);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        vf v = VLOAD(x + i);
        acc += v * v;
    }
    float s = hsum(acc);
    for (; i < n; i++) s += LOAD(x[i]) * LOAD(x[i]);
    return s;
}

/* out = w * cut(x * rsqrt(mean(x^2) + eps)), rounded to T; out may be x */
static inline void SUFFIX(norm_row)(const T *x, const T *w, T *out, int64_t n, float eps) {
    float scale = 1.0f / sqrtf(SUFFIX(sumsq)(x, n) / (float)n + eps);
    int64_t i = 0;
    for (; i + W <= n; i += W) VSTORE(out + i, VLOAD(w + i) * VCUT(VLOAD(x + i) * scale));
    for (; i < n; i++) out[i] = STORE(LOAD(w[i]) * CUT(LOAD(x[i]) * scale));
}

static inline void SUFFIX(add_row)(T *x, const T *delta, int64_t n) {
    int64_t i = 0;
    for (; i + W <= n; i += W) VSTORE(x + i, VLOAD(x + i) + VLOAD(delta + i));
    for (; i < n; i++) x[i] = STORE(LOAD(x[i]) + LOAD(delta[i]));
}

static inline void SUFFIX(repeat_row0)(T *out, int64_t stride, int64_t rows, int64_t out_rows,
                                       int64_t n) {
    for (int64_t r = rows; r < out_rows; r++) memcpy(out + r * stride, out, (size_t)n * sizeof(T));
}

/* Rows 0..rows-1 of x: with delta, x += delta first (rounded, in place: the residual
 * stream); then out = norm(x) * w. Rows rows..out_rows-1 of out repeat row 0 (small
 * batches run their matmuls padded). */
void SUFFIX(add_norm)(T *x, int64_t x_stride, const T *delta, int64_t delta_stride,
                      const T *w, T *out, int64_t out_stride, int64_t rows, int64_t out_rows,
                      int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        T *xr = x + r * x_stride;
        if (delta) SUFFIX(add_row)(xr, delta + r * delta_stride, n);
        SUFFIX(norm_row)(xr, w, out + r * out_stride, n, eps);
    }
    SUFFIX(repeat_row0)(out, out_stride, rows, out_rows, n);
}

/* x[r] += delta[r] for rows 0..rows-1, rounded (the last residual add of a pass). */
void SUFFIX(add_rows)(T *x, int64_t x_stride, const T *delta, int64_t delta_stride,
                      int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) SUFFIX(add_row)(x + r * x_stride, delta + r * delta_stride, n);
}

/* out[r] = cut(silu(gate[r])) * up[r] for rows of n values, rows..out_rows-1 repeating
 * row 0; silu(g) = g / (1 + exp(-g)) in float32, as torch computes it. */
void SUFFIX(silu_mul)(const T *gate, int64_t gate_stride, const T *up, int64_t up_stride,
                      T *out, int64_t out_stride, int64_t rows, int64_t out_rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gate + r * gate_stride, *u = up + r * up_stride;
        T *o = out + r * out_stride;
        int64_t i = 0;
        for (; i + W <= n; i += W) {
            vf v = VLOAD(g + i);
            VSTORE(o + i, VCUT(v / (1.0f + vexp(-v))) * VLOAD(u + i));
        }
        for (; i < n; i++) {
            float v = LOAD(g[i]);
            o[i] = STORE(CUT(v / (1.0f + sexp(-v))) * LOAD(u[i]));
        }
    }
    SUFFIX(repeat_row0)(out, out_stride, rows, out_rows, n);
}

/* One head of d values rotated in place by its row's cos/sin (rotate_half form):
 * x[i] = cut(x[i] * cos[i]) + cut(rot[i] * sin[i]), rot = (-x[d/2:], x[:d/2]). */
static inline void SUFFIX(rotate_head)(T *x, const T *cs, const T *sn, int64_t d) {
    int64_t half = d / 2;
    if (half % W == 0) {
        for (int64_t c = 0; c < half; c += W) {
            vf a = VLOAD(x + c), b = VLOAD(x + c + half);
            VSTORE(x + c, VCUT(a * VLOAD(cs + c)) + VCUT(-b * VLOAD(sn + c)));
            VSTORE(x + c + half, VCUT(b * VLOAD(cs + c + half)) + VCUT(a * VLOAD(sn + c + half)));
        }
        return;
    }
    for (int64_t c = 0; c < half; c++) {
        float a = LOAD(x[c]), b = LOAD(x[c + half]);
        x[c] = STORE(CUT(a * LOAD(cs[c])) + CUT(-b * LOAD(sn[c])));
        x[c + half] = STORE(CUT(b * LOAD(cs[c + half])) + CUT(a * LOAD(sn[c + half])));
    }
}

/* For token rows 0..rows-1 of q/k/v ([rows, heads * d], each with its row stride): the
 * q/k norms per head (when q_norm/k_norm are given), the rotation (q and k in place),
 * and keys/values written into the cache slabs ([cache rows, kv_heads, length, d]) at
 * (cache_rows[r], positions[r]). */
void SUFFIX(rope_store)(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v,
                        int64_t v_stride, const T *cos_, const T *sin_, int64_t cs_stride,
                        const T *q_norm, const T *k_norm, float eps, T *keys, T *values,
                        const int64_t *cache_rows, const int64_t *positions, int64_t rows,
                        int64_t heads, int64_t kv_heads, int64_t d, int64_t length) {
    for (int64_t r = 0; r < rows; r++) {
        const T *cs = cos_ + r * cs_stride, *sn = sin_ + r * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            T *x = q + r * q_stride + h * d;
            if (q_norm) SUFFIX(norm_row)(x, q_norm, x, d, eps);
            SUFFIX(rotate_head)(x, cs, sn, d);
        }
        for (int64_t h = 0; h < kv_heads; h++) {
            T *x = k + r * k_stride + h * d;
            if (k_norm) SUFFIX(norm_row)(x, k_norm, x, d, eps);
            SUFFIX(rotate_head)(x, cs, sn, d);
            int64_t slot = ((cache_rows[r] * kv_heads + h) * length + positions[r]) * d;
            memcpy(keys + slot, x, (size_t)d * sizeof(T));
            memcpy(values + slot, v + r * v_stride + h * d, (size_t)d * sizeof(T));
        }
    }
}

/* One kv head of one decode row: the group's queries (q, groups * d) scored against keys
 * 0..n-1 (kh), softmax, values (vh) weighted into out. Inlined with d constant for the
 * common head sizes, so a key's vectors and a query's stay in registers. */
static inline __attribute__((always_inline)) void SUFFIX(attend_kv_head)(
    const T *q, const T *kh, const T *vh, T *out, int64_t n, int64_t groups, int64_t d,
    float scale, float *scratch) {
    const int64_t P = 2 * W, whole = d - d % P, wn = n - n % W;
    for (int64_t g = 0; g < groups; g++) {
        const T *qg = q + g * d;
        float *s = scratch + g * n;
        vf qa[MAX_HEAD_VECTORS / 2], qb[MAX_HEAD_VECTORS / 2];
        for (int64_t c = 0; c < whole; c += P) VLOAD2(qg + c, &qa[c / P], &qb[c / P]);
        for (int64_t j = 0; j < n; j++) {
            const T *kj = kh + j * d;
            vf part = vsplat(0.0f);
            for (int64_t c = 0; c < whole; c += P) {
                vf ka, kb;
                VLOAD2(kj + c, &ka, &kb);
                part += qa[c / P] * ka + qb[c / P] * kb;
            }
            float dot = hsum(part);
            for (int64_t c = whole; c < d; c++) dot += LOAD(qg[c]) * LOAD(kj[c]);
            s[j] = dot * scale;
        }
        vf top = vsplat(-INFINITY);
        for (int64_t j = 0; j < wn; j += W) {
            vf v = vload_f32(s + j);
            vi more = v > top;
            top = (vf)(((vi)v & more) | ((vi)top & ~more));
        }
        float m = hmax(top);
        for (int64_t j = wn; j < n; j++) m = s[j] > m ? s[j] : m;
        vf sum = vsplat(0.0f);
        for (int64_t j = 0; j < wn; j += W) {
            vf e = vexp(vload_f32(s + j) - m);
            vstore_f32(s + j, e);
            sum += e;
        }
        if (wn < n) { /* the tail as one vector: exp(-inf) = 0 in the unused lanes */
            vf e = vexp(vload_part(s + wn, n - wn, -INFINITY) - m);
            for (int64_t j = wn; j < n; j++) s[j] = e[j - wn];
            sum += e;
        }
        float inv = 1.0f / hsum(sum);
        vf aa[MAX_HEAD_VECTORS / 2], ab[MAX_HEAD_VECTORS / 2];
        for (int64_t c = 0; c < whole; c += P) aa[c / P] = ab[c / P] = vsplat(0.0f);
        float tail[P];
        for (int64_t c = whole; c < d; c++) tail[c - whole] = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const T *vj = vh + j * d;
            float wj = s[j] * inv;
            for (int64_t c = 0; c < whole; c += P) {
                vf va, vb;
                VLOAD2(vj + c, &va, &vb);
                aa[c / P] += wj * va;
                ab[c / P] += wj * vb;
            }
            for (int64_t c = whole; c < d; c++) tail[c - whole] += wj * LOAD(vj[c]);
        }
        T *o = out + g * d;
        for (int64_t c = 0; c < whole; c += P) VSTORE2(o + c, aa[c / P], ab[c / P]);
        for (int64_t c = whole; c < d; c++) o[c] = STORE(tail[c - whole]);
    }
}

/* Decode attention: token row r (rotated queries in q) at position p = positions[r] of
 * cache row cache_rows[r] attends that row's keys max(0, p - window + 1)..p (window <= 0:
 * from 0); out is [rows, heads * d]. Scores, softmax and the weighted sum of values in
 * float32, the output rounded to T. scratch: groups * length floats. */
void SUFFIX(decode_attention)(const T *q, int64_t q_stride, const T *keys, const T *values,
                              const int64_t *cache_rows, const int64_t *positions, T *out,
                              int64_t out_stride, int64_t rows, int64_t heads, int64_t kv_heads,
                              int64_t d, int64_t length, int64_t window, float *scratch) {
    unsigned mode = ftz_on();
    int64_t groups = heads / kv_heads;
    float scale = 1.0f / sqrtf((float)d);
    for (int64_t r = 0; r < rows; r++) {
        int64_t p = positions[r];
        int64_t lo = window > 0 && p + 1 > window ? p + 1 - window : 0, n = p + 1 - lo;
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t base = ((cache_rows[r] * kv_heads + h) * length + lo) * d;
            const T *qh = q + r * q_stride + h * groups * d;
            T *o = out + r * out_stride + h * groups * d;
            if (d == 64)
                SUFFIX(attend_kv_head)(qh, keys + base, values + base, o, n, groups, 64, scale, scratch);
            else if (d == 128)
                SUFFIX(attend_kv_head)(qh, keys + base, values + base, o, n, groups, 128, scale, scratch);
            else
                SUFFIX(attend_kv_head)(qh, keys + base, values + base, o, n, groups, d, scale, scratch);
        }
    }
    ftz_restore(mode);
}

/* Greedy picks of rows of logits: tokens[r] = the first maximal entry (the first NaN,
 * if any: torch's argmax), logprobs[r] = its log-softmax value, -log(sum(exp(x - max)))
 * (NaN where torch's chosen - logsumexp is NaN: a NaN or an infinite maximum). */
void SUFFIX(greedy_rows)(const T *logits, int64_t stride, int64_t rows, int64_t vocab,
                         int64_t *tokens, float *logprobs) {
    int64_t whole = vocab - vocab % W;
    for (int64_t r = 0; r < rows; r++) {
        const T *x = logits + r * stride;
        vf top = vsplat(-INFINITY);
        vi nan = (vi)vsplat(0.0f);
        int64_t i = 0;
        for (; i < whole; i += W) {
            vf v = VLOAD(x + i);
            vi more = v > top;
            nan |= v != v;
            top = (vf)(((vi)v & more) | ((vi)top & ~more));
        }
        float m = hmax(top);
        int any_nan = 0;
        for (int l = 0; l < W; l++) any_nan |= nan[l] != 0;
        for (; i < vocab; i++) {
            float v = LOAD(x[i]);
            any_nan |= v != v;
            m = v > m ? v : m;
        }
        int64_t pick = 0;
        if (any_nan) {
            while (LOAD(x[pick]) == LOAD(x[pick])) pick++;
        } else {
            while (pick < vocab - 1 && LOAD(x[pick]) != m) pick++;
        }
        if (any_nan || isinf(m)) {
            tokens[r] = pick;
            logprobs[r] = NAN;
            continue;
        }
        vf sum = vsplat(0.0f);
        for (i = 0; i < whole; i += W) sum += vexp(VLOAD(x + i) - m);
        float total = hsum(sum);
        for (; i < vocab; i++) total += sexp(LOAD(x[i]) - m);
        tokens[r] = pick;
        logprobs[r] = -logf(total);
    }
}

/* rope_store for every token row, then decode attention for the first decode_rows rows
 * (their slots are the first entries of cache_rows/positions) into out; rows
 * rows..out_rows-1 of out repeat row 0 (a padded o-projection). One call per layer. */
void SUFFIX(rope_attend)(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v,
                         int64_t v_stride, const T *cos_, const T *sin_, int64_t cs_stride,
                         const T *q_norm, const T *k_norm, float eps, T *keys, T *values,
                         const int64_t *cache_rows, const int64_t *positions, int64_t rows,
                         int64_t heads, int64_t kv_heads, int64_t d, int64_t length,
                         int64_t decode_rows, T *out, int64_t out_stride, int64_t out_rows,
                         int64_t window, float *scratch) {
    SUFFIX(rope_store)(q, q_stride, k, k_stride, v, v_stride, cos_, sin_, cs_stride, q_norm,
                       k_norm, eps, keys, values, cache_rows, positions, rows, heads, kv_heads,
                       d, length);
    if (decode_rows > 0)
        SUFFIX(decode_attention)(q, q_stride, keys, values, cache_rows, positions, out,
                                 out_stride, decode_rows, heads, kv_heads, d, length, window,
                                 scratch);
    SUFFIX(repeat_row0)(out, out_stride, rows, out_rows, heads * d);
}
