/* LowPrecisionAdamW's step of the CPU parameters of one `step()` call (`lowbit_adamw_steps`:
 * one task a parameter, their blocks spread over threads): the per-op PyTorch step of
 * torchoffload/optim/_adamw.py (`_step_chunk`), fused, each value read and written once.
 * Built and loaded by _native.py; see its Note: [The native host step].
 *
 * Bits: every fp32 operation below is one IEEE operation in the order the per-op step does
 * it, so the two agree bit for bit (NaN payloads aside). That needs: no contraction into
 * fused multiply-adds (-ffp-contract=off), a correctly rounded sqrtf (IEEE; -fno-math-errno
 * only lets it vectorize), no -ffast-math, and unsigned 32-bit integer arithmetic for the
 * hash (it wraps, as the per-op step's int32 arithmetic does). Each block of 256 elements is
 * done whole by one thread, so the bits depend on no thread count or split. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256
#define TOP 16 /* a code is looked up by the top 32 - TOP bits of a value, */
#define LOW ((127 - 24) << 7) /* its magnitude clamped to [2**-24, 2) (see _lowbit.py) */
#define HIGH ((127 << 7) | 127)

enum {
    PARAM_BF16 = 1,   /* the parameter and its gradient are bfloat16 (else float32) */
    QUANTIZED = 2,    /* the moments are 8-bit codes and per-block scales (else float32) */
    STOCHASTIC = 4,   /* a bf16 parameter is written by stochastic rounding */
    KAHAN = 8,        /* ... with a compensation term, kept in `comp` */
    ADD_COMP = 16,    /* `comp` is added to the parameter before the step */
};

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float from_bf16(uint16_t b) { return float_of((uint32_t)b << 16); }

/* c10::BFloat16's round to nearest even (a NaN becomes the canonical quiet NaN) */
static inline uint16_t to_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u = bits_of(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp32 `x` to bf16 rounded up with the probability of the fraction dropped: 16 random bits
 * from a hash (MurmurHash3's finalizer) of the key, the element's index and x's bits */
static inline uint16_t to_bf16_stochastic(float f, uint32_t key, uint32_t index) {
    if (f != f) return 0x7FC0;
    uint32_t u = bits_of(f);
    uint32_t h = index * 0x9E3779B9u + key;
    h ^= u;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return (uint16_t)(((u + (h & 0xFFFFu)) & 0xFFFF0000u) >> 16);
}

/* The block's scale (its largest magnitude; NaN if any value is) and each value's code: the
 * map's nearest value to value / scale, found from the value's top bits: the number of
 * midpoints below the pattern's values, plus one if y is above the next one (looked up by the
 * same index, so that the two loads do not wait on each other). The largest magnitude is the
 * largest of the bit patterns without their sign (a NaN's exceed infinity's), an integer
 * maximum that vectorizes. */
static inline void quantize(const float *x, uint8_t *codes, float *scale, const int32_t *below,
                            const float *next) {
    uint32_t largest = 0;
    for (int i = 0; i < BLOCK; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
        largest = a > largest ? a : largest;
    }
    const float s = float_of(largest);
    *scale = s;
    const float tiny = 1.17549435e-38f; /* torch.finfo(torch.float32).tiny */
    const float d = s < tiny ? tiny : s; /* a NaN stays NaN, as torch.clamp keeps it */
    int32_t c[BLOCK];
    for (int i = 0; i < BLOCK; i++) {
        float y = x[i] / d;
        uint32_t u = bits_of(y);
        int32_t top = (int32_t)((u >> TOP) & 0x7FFFu);
        top = top < LOW ? LOW : (top > HIGH ? HIGH : top);
        int32_t k = top - LOW + (int32_t)(u >> 31) * (HIGH - LOW + 1);
        c[i] = below[k] + (next[k] < y);
    }
    for (int i = 0; i < BLOCK; i++) codes[i] = (uint8_t)c[i];
}

/* the values of a block's codes */
static inline void dequantize(const uint8_t *codes, float scale, const float *map, float *out) {
    int32_t c[BLOCK];
    for (int i = 0; i < BLOCK; i++) c[i] = codes[i];
    for (int i = 0; i < BLOCK; i++) out[i] = map[c[i]] * scale;
}

/* One parameter's step. hs: the step's fp32 scalars, rounded from float64 as PyTorch rounds
 * a Python scalar: decay (1 - lr * weight_decay), w1 (1 - beta1), beta2, w2 (1 - beta2), the
 * reciprocal of sqrt(1 - beta2 ** step), eps and -lr / (1 - beta1 ** step). */
typedef struct {
    int64_t n;
    int64_t flags;
    void *param;
    const void *grad;
    uint8_t *m_codes;
    float *m_scales;
    uint8_t *v_codes;
    float *v_scales;
    float *m32;
    float *v32;
    uint16_t *comp;
    float hs[8]; /* 7 used */
    int64_t key;
} task_t;

typedef struct {
    const float *m_map;
    const int32_t *m_below;
    const float *m_next;
    const float *v_map;
    const int32_t *v_below;
    const float *v_next;
} tables_t;

/* blocks [b0, b1) of one task */
static void step_blocks(const task_t *t, int64_t b0, int64_t b1, const tables_t *tb) {
    const int64_t n = t->n;
    const int flags = (int)t->flags;
    void *param = t->param;
    const void *grad = t->grad;
    uint8_t *m_codes = t->m_codes, *v_codes = t->v_codes;
    float *m_scales = t->m_scales, *v_scales = t->v_scales, *m32 = t->m32, *v32 = t->v32;
    uint16_t *comp = t->comp;
    const float *hs = t->hs;
    const uint32_t key = (uint32_t)t->key;
    const float *m_map = tb->m_map, *m_next = tb->m_next, *v_map = tb->v_map,
                *v_next = tb->v_next;
    const int32_t *m_below = tb->m_below, *v_below = tb->v_below;
    const float decay = hs[0], w1 = hs[1], beta2 = hs[2], w2 = hs[3], inv_bc2 = hs[4],
                eps = hs[5], neg_step = hs[6];
    const int bf16 = flags & PARAM_BF16, quantized = flags & QUANTIZED;
    float x[BLOCK], g[BLOCK], m[BLOCK], v[BLOCK];
    for (int64_t b = b0; b < b1; b++) {
        const int64_t lo = b * BLOCK;
        const int k = n - lo < BLOCK ? (int)(n - lo) : BLOCK;
        if (bf16) {
            const uint16_t *p = (const uint16_t *)param + lo, *gp = (const uint16_t *)grad + lo;
            for (int i = 0; i < k; i++) x[i] = from_bf16(p[i]);
            for (int i = 0; i < k; i++) g[i] = from_bf16(gp[i]);
            if (flags & (KAHAN | ADD_COMP))
                for (int i = 0; i < k; i++) x[i] = x[i] + from_bf16(comp[lo + i]);
        } else {
            memcpy(x, (const float *)param + lo, k * sizeof(float));
            memcpy(g, (const float *)grad + lo, k * sizeof(float));
        }
        if (quantized) {
            dequantize(m_codes + lo, m_scales[b], m_map, m);
            dequantize(v_codes + lo, v_scales[b], v_map, v);
        } else {
            memcpy(m, m32 + lo, k * sizeof(float));
            memcpy(v, v32 + lo, k * sizeof(float));
        }
        for (int i = 0; i < k; i++) {
            float xi = x[i] * decay;
            float mi = m[i] + w1 * (g[i] - m[i]);
            float vi = v[i] * beta2 + (w2 * g[i]) * g[i];
            float denom = sqrtf(vi) * inv_bc2 + eps;
            x[i] = xi + neg_step * (mi / denom);
            m[i] = mi;
            v[i] = vi;
        }
        if (quantized) {
            for (int i = k; i < BLOCK; i++) m[i] = v[i] = 0.0f; /* a last short block's padding */
            quantize(m, m_codes + lo, m_scales + b, m_below, m_next);
            quantize(v, v_codes + lo, v_scales + b, v_below, v_next);
        } else {
            memcpy(m32 + lo, m, k * sizeof(float));
            memcpy(v32 + lo, v, k * sizeof(float));
        }
        if (!bf16) {
            memcpy((float *)param + lo, x, k * sizeof(float));
        } else if (flags & STOCHASTIC) {
            uint16_t *p = (uint16_t *)param + lo;
            for (int i = 0; i < k; i++) p[i] = to_bf16_stochastic(x[i], key, (uint32_t)(lo + i));
        } else {
            uint16_t *p = (uint16_t *)param + lo;
            for (int i = 0; i < k; i++) p[i] = to_bf16(x[i]);
            if (flags & KAHAN)
                for (int i = 0; i < k; i++) comp[lo + i] = to_bf16(x[i] - from_bf16(p[i]));
        }
    }
}

/* The work of the threads of one call: the tasks' blocks laid end to end, cut in pieces of
 * PIECE blocks (64 KiB of fp32 values), each taken by the next thread free, so that a thread
 * the host descheduled (the main thread's backward, the copies' work) leaves its share to the
 * others instead of holding up the call. */
#define PIECE 64
#define MAX_THREADS 256

typedef struct {
    const task_t *tasks;
    int64_t count, total;
    const tables_t *tables;
    int64_t next; /* the next piece, taken with an atomic add */
} work_t;

static void steps_between(const work_t *w, int64_t first, int64_t last) {
    int64_t start = 0; /* the first block of task k, counted end to end */
    for (int64_t k = 0; k < w->count && start < last; k++) {
        const int64_t blocks = (w->tasks[k].n + BLOCK - 1) / BLOCK;
        const int64_t b0 = first > start ? first - start : 0;
        const int64_t b1 = last - start < blocks ? last - start : blocks;
        if (b0 < b1) step_blocks(&w->tasks[k], b0, b1, w->tables);
        start += blocks;
    }
}

static void *run_pieces(void *arg) {
    work_t *w = (work_t *)arg;
    for (;;) {
        const int64_t first = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED) * PIECE;
        if (first >= w->total) return NULL;
        steps_between(w, first, first + PIECE < w->total ? first + PIECE : w->total);
    }
}

/* Step `count` tasks on up to `threads` threads: the caller's and threads - 1 started for the
 * call, at most one a piece. Returns 0, or the error of pthread_create (the threads it could
 * not start leave their pieces to the others). */
int lowbit_adamw_steps(const task_t *tasks, int64_t count, int64_t threads, const tables_t *tb) {
    int64_t total = 0;
    for (int64_t k = 0; k < count; k++) total += (tasks[k].n + BLOCK - 1) / BLOCK;
    int64_t t = (total + PIECE - 1) / PIECE;
    t = t < threads ? t : threads;
    t = t < MAX_THREADS ? t : MAX_THREADS;
    t = t < 1 ? 1 : t;
    work_t w = {tasks, count, total, tb, 0};
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS], error = 0;
    for (int64_t i = 1; i < t; i++) {
        int e = pthread_create(&ids[i], NULL, run_pieces, &w);
        started[i] = e == 0;
        if (e) error = e;
    }
    run_pieces(&w);
    for (int64_t i = 1; i < t; i++)
        if (started[i]) pthread_join(ids[i], NULL);
    return error;
}
