/* specd's native CPU forward: the layers of a Llama-family decoder over its KV caches, in
 * float32, each row computed by one fixed sequence of instructions whatever else the call
 * holds (batch invariant by construction), reading quantized weights (Q4_0, Q4_1, Q8_0,
 * F16, BF16) as the GGUF file stores them.
 *
 * Built at first use by `target_worker.native` with the machine's C compiler (-O3
 * -march=native -ffp-contract=off) and loaded with ctypes; no Python or torch headers.
 *
 * Why each row's bits cannot depend on the batch, the thread split or the call's size:
 *  - a matmul output (row r, column c) is one vector accumulator over K, taken in
 *    ascending VL-element steps (acc = fma(x[r, k:k+VL], w[c, k:k+VL], acc)), then summed
 *    across its lanes by one fixed tree (`hsum`); threads split the columns, never K, and
 *    every register tile (MR rows x NR columns, or a one-row tail) performs exactly that
 *    sequence per (r, c);
 *  - weights are dequantized as gguf-py does (d * q, or d * q + m: one rounding per
 *    operation), so the values multiplied are the float32 weights a dequantized copy holds;
 *  - attention of a query row at position p reads keys [0, p] in ascending order, scores,
 *    max, exp, sums and the weighted sum of values all in that fixed order;
 *  - norms, RoPE, SiLU are per row, in vector steps aligned at element 0; exp is this
 *    file's own vector polynomial (`vexp`), never a scalar tail;
 *  - contraction is off (-ffp-contract=off): only the explicit fma calls fuse, so inlining
 *    cannot change a rounding; each thread runs with MXCSR set to the IEEE default (no
 *    flush-to-zero), whatever the caller's.
 */

#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define SPECD_ABI 1

/* ggml tensor type ids (gguf.GGMLQuantizationType). */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_BF16 = 30 };

/* ------------------------------------------------------------------------------------ */
/* Vectors: VL float lanes.
 *
 * vexp: Cephes' expf (n = round(x log2 e), r = x - n ln 2 in two parts, a degree-6
 * polynomial, times 2^n applied as 2^(n-1) * 2 so that n = 128 stays finite), on every lane
 * alike; below EXP_LO it is 0 (e^-86 ~ 4e-38: nothing a softmax or SiLU can see), above
 * EXP_HI (ln FLT_MAX) infinity, NaN stays NaN. */

#define EXP_HI 88.7228317f
#define EXP_LO (-86.0f)

#if defined(__AVX512F__)
#define ISA "avx512"
#define VL 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline float hsum(vf v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
    return _mm_cvtss_f32(d);
}
static inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
/* exp of every lane (see vexp_generic for the algorithm). */
static inline vf vexp(vf x) {
    const vf hi = vset1(EXP_HI), lo = vset1(EXP_LO);
    __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    vf xc = vmin(vmax(x, lo), hi);
    vf n = _mm512_roundscale_ps(vmul(xc, vset1(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = vfma(n, vset1(-0.693359375f), xc);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf p = vset1(1.9875691500E-4f);
    p = vfma(p, r, vset1(1.3981999507E-3f));
    p = vfma(p, r, vset1(8.3334519073E-3f));
    p = vfma(p, r, vset1(4.1665795894E-2f));
    p = vfma(p, r, vset1(1.6666665459E-1f));
    p = vfma(p, r, vset1(5.0000001201E-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23);
    vf y = vmul(vmul(p, _mm512_castsi512_ps(e)), vset1(2.0f));
    y = _mm512_mask_mov_ps(y, under, vzero());
    y = _mm512_mask_mov_ps(y, over, vset1(INFINITY));
    y = _mm512_mask_mov_ps(y, nan, x);
    return y;
}
/* Loads n < VL floats (the rest zero) / stores n lanes. */
static inline vf vload_n(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline void vstore_n(float *p, vf v, int n) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "avx2"
#define VL 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline float hsum(vf v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
    return _mm_cvtss_f32(d);
}
static inline float hmax(vf v) {
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
    __m128 d = _mm_max_ss(c, _mm_movehdup_ps(c));
    return _mm_cvtss_f32(d);
}
static inline vf vexp(vf x) {
    const vf hi = vset1(EXP_HI), lo = vset1(EXP_LO);
    vf over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    vf under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    vf nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    vf xc = vmin(vmax(x, lo), hi);
    vf n = _mm256_round_ps(vmul(xc, vset1(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf r = vfma(n, vset1(-0.693359375f), xc);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf p = vset1(1.9875691500E-4f);
    p = vfma(p, r, vset1(1.3981999507E-3f));
    p = vfma(p, r, vset1(8.3334519073E-3f));
    p = vfma(p, r, vset1(4.1665795894E-2f));
    p = vfma(p, r, vset1(1.6666665459E-1f));
    p = vfma(p, r, vset1(5.0000001201E-1f));
    p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    vf y = vmul(vmul(p, _mm256_castsi256_ps(e)), vset1(2.0f));
    y = _mm256_blendv_ps(y, vzero(), under);
    y = _mm256_blendv_ps(y, vset1(INFINITY), over);
    y = _mm256_blendv_ps(y, x, nan);
    return y;
}
static inline __m256i lane_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vload_n(const float *p, int n) { return _mm256_maskload_ps(p, lane_mask(n)); }
static inline void vstore_n(float *p, vf v, int n) { _mm256_maskstore_ps(p, lane_mask(n), v); }
#else
#define ISA "generic"
#define VL 8
typedef struct { float v[VL]; } vf;
static inline vf vzero(void) { vf r; for (int i = 0; i < VL; i++) r.v[i] = 0.0f; return r; }
static inline vf vload(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
static inline void vstore(float *p, vf v) { memcpy(p, v.v, sizeof v.v); }
static inline vf vset1(float x) { vf r; for (int i = 0; i < VL; i++) r.v[i] = x; return r; }
#define LANEWISE(name, expr) \
    static inline vf name(vf a, vf b) { vf r; for (int i = 0; i < VL; i++) { float x = a.v[i], y = b.v[i]; r.v[i] = (expr); } return r; }
LANEWISE(vmul, x * y)
LANEWISE(vadd, x + y)
LANEWISE(vsub, x - y)
LANEWISE(vdiv, x / y)
LANEWISE(vmax, x > y ? x : y)
LANEWISE(vmin, x < y ? x : y)
static inline vf vfma(vf a, vf b, vf c) {
    vf r; for (int i = 0; i < VL; i++) r.v[i] = fmaf(a.v[i], b.v[i], c.v[i]); return r;
}
static inline float hsum(vf v) {
    float a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = v.v[i] + v.v[i + 4];
    for (int i = 0; i < 2; i++) b[i] = a[i] + a[i + 2];
    return b[0] + b[1];
}
static inline float hmax(vf v) {
    float m = v.v[0];
    for (int i = 1; i < VL; i++) m = v.v[i] > m ? v.v[i] : m;
    return m;
}
static inline vf vexp(vf x) {
    vf y;
    for (int i = 0; i < VL; i++) {
        float xi = x.v[i];
        if (xi > EXP_HI) { y.v[i] = INFINITY; continue; }
        if (xi < EXP_LO) { y.v[i] = 0.0f; continue; }
        if (xi != xi) { y.v[i] = xi; continue; }
        float n = nearbyintf(xi * 1.44269504088896341f);
        float r = fmaf(n, -0.693359375f, xi);
        r = fmaf(n, 2.12194440e-4f, r);
        float p = 1.9875691500E-4f;
        p = fmaf(p, r, 1.3981999507E-3f);
        p = fmaf(p, r, 8.3334519073E-3f);
        p = fmaf(p, r, 4.1665795894E-2f);
        p = fmaf(p, r, 1.6666665459E-1f);
        p = fmaf(p, r, 5.0000001201E-1f);
        p = fmaf(p, r * r, r + 1.0f);
        y.v[i] = (p * ldexpf(1.0f, (int)n - 1)) * 2.0f;
    }
    return y;
}
static inline vf vload_n(const float *p, int n) { vf r = vzero(); memcpy(r.v, p, n * sizeof(float)); return r; }
static inline void vstore_n(float *p, vf v, int n) { memcpy(p, v.v, n * sizeof(float)); }
#endif

#if defined(__AVX512BF16__)
#define HAS_BF16_DOT 1
#else
#define HAS_BF16_DOT 0
#endif

static inline int round_up(int n, int m) { return (n + m - 1) / m * m; }

/* ------------------------------------------------------------------------------------ */
/* Scalars: half and bfloat16 to float (exact conversions). */

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float -> half, round to nearest even (overflow to infinity, NaN kept NaN). */
static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    uint32_t a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504 */
    if (a < 0x38800000u) { /* below the smallest normal half: a denormal or zero */
        if (a < 0x33000000u) return (uint16_t)sign;
        /* m * 2^(e - 150) in units of 2^-24 (the least half denormal): m >> (126 - e). */
        const uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a - 0x38000000u) >> 13);
    const uint32_t rem = a & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}

/* float -> bfloat16, round to nearest even (as torch's .to(torch.bfloat16); NaN kept NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* ------------------------------------------------------------------------------------ */
/* Weights. */

typedef struct {
    int32_t type;      /* T_* */
    int32_t n;         /* output rows */
    int32_t k;         /* input columns */
    int32_t pad;
    int64_t row_bytes; /* bytes per output row */
    const uint8_t *data;
} wmat;

static inline int block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q8_0: return 34;
    default: return 0;
    }
}

/* Dequantizes elements [0, k) of a row to float, exactly as gguf-py's dequantize does:
 * Q4_0 d * (q - 8), Q4_1 (d * q) + m, Q8_0 q * d (one rounding each). out has room for
 * round_up(k, VL) floats; the tail is zeroed. */
static void dequant_row(int type, const uint8_t *row, int k, float *out) {
    int kp = round_up(k, VL);
    switch (type) {
    case T_F32:
        memcpy(out, row, (size_t)k * 4);
        break;
    case T_F16: {
        const uint16_t *h = (const uint16_t *)row;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= k; i += 16)
            _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
        for (; i + 8 <= k; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < k; i++) out[i] = f16_to_f32(h[i]);
        break;
    }
    case T_BF16: {
        const uint16_t *h = (const uint16_t *)row;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= k; i += 16)
            _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + i))), 16)));
#elif defined(__AVX2__)
        for (; i + 8 <= k; i += 8)
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i))), 16)));
#endif
        for (; i < k; i++) out[i] = bf16_to_f32(h[i]);
        break;
    }
    case T_Q4_0:
    case T_Q4_1: {
        const int bb = block_bytes(type), has_m = type == T_Q4_1;
        for (int b = 0; b < k / 32; b++) {
            const uint8_t *blk = row + (size_t)b * bb;
            uint16_t dh, mh = 0;
            memcpy(&dh, blk, 2);
            if (has_m) memcpy(&mh, blk + 2, 2);
            const float d = f16_to_f32(dh), m = f16_to_f32(mh);
            const uint8_t *qs = blk + (has_m ? 4 : 2);
            float *o = out + b * 32;
#if defined(__AVX512F__)
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
            __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
            __m512i hi = _mm512_srli_epi32(q, 4);
            if (!has_m) {
                lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
                hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
            }
            __m512 vd = _mm512_set1_ps(d);
            __m512 flo = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(lo));
            __m512 fhi = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(hi));
            if (has_m) {
                flo = _mm512_add_ps(flo, _mm512_set1_ps(m));
                fhi = _mm512_add_ps(fhi, _mm512_set1_ps(m));
            }
            _mm512_storeu_ps(o, flo);
            _mm512_storeu_ps(o + 16, fhi);
#elif defined(__AVX2__)
            for (int half = 0; half < 2; half++) {
                __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * half)));
                __m256i lo = _mm256_and_si256(q, _mm256_set1_epi32(15));
                __m256i hi = _mm256_srli_epi32(q, 4);
                if (!has_m) {
                    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(8));
                    hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(8));
                }
                __m256 vd = _mm256_set1_ps(d);
                __m256 flo = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(lo));
                __m256 fhi = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(hi));
                if (has_m) {
                    flo = _mm256_add_ps(flo, _mm256_set1_ps(m));
                    fhi = _mm256_add_ps(fhi, _mm256_set1_ps(m));
                }
                _mm256_storeu_ps(o + 8 * half, flo);
                _mm256_storeu_ps(o + 16 + 8 * half, fhi);
            }
#else
            for (int j = 0; j < 16; j++) {
                int lo = qs[j] & 15, hi = qs[j] >> 4;
                if (!has_m) { lo -= 8; hi -= 8; }
                o[j] = d * (float)lo;
                o[j + 16] = d * (float)hi;
                if (has_m) { o[j] = o[j] + m; o[j + 16] = o[j + 16] + m; }
            }
#endif
        }
        break;
    }
    case T_Q8_0: {
        for (int b = 0; b < k / 32; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = f16_to_f32(dh);
            const int8_t *qs = (const int8_t *)(blk + 2);
            float *o = out + b * 32;
#if defined(__AVX512F__)
            __m512 vd = _mm512_set1_ps(d);
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)qs))), vd));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(qs + 16)))), vd));
#elif defined(__AVX2__)
            __m256 vd = _mm256_set1_ps(d);
            for (int j = 0; j < 32; j += 8)
                _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(qs + j)))), vd));
#else
            for (int j = 0; j < 32; j++) o[j] = (float)qs[j] * d;
#endif
        }
        break;
    }
    default:
        memset(out, 0, (size_t)kp * 4);
        return;
    }
    for (int i = k; i < kp; i++) out[i] = 0.0f;
}

/* ------------------------------------------------------------------------------------ */
/* The thread pool: the caller and up to MAX_THREADS - 1 workers share a job's chunks
 * through an atomic counter. A worker joins a job only while it is open; the caller closes
 * it when the chunks run out and waits only for the workers that joined (never for one
 * that is asleep or descheduled before joining). */

#define MAX_THREADS 64
/* Query vectors per attention task, at most. */
#define QC_MAX 8
#define CTL_CLOSED (1ull << 31)
#define CTL_COUNT 0x7fffffffull

typedef void (*job_fn)(void *ctx, int chunk, int slot);

typedef struct {
    pthread_t tid[MAX_THREADS];
    int n_workers;
    pid_t pid;
    _Atomic uint64_t ctl; /* epoch << 32 | CLOSED | joined workers */
    _Atomic int next;
    int n_chunks;
    int max_workers; /* of this job */
    job_fn fn;
    void *ctx;
    _Atomic int sleepers;
    _Atomic uint32_t wake;
    _Atomic int stop;
    long spin_ns;
} pool_t;

static pool_t g_pool;
static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

static inline long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
#else
    (void)addr; (void)val;
    usleep(50);
#endif
}

static void futex_wake_all(_Atomic uint32_t *addr) {
#if defined(__linux__)
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

/* The IEEE default: no flush-to-zero, no denormals-are-zero, round to nearest. */
static inline void set_fp_mode(void) {
#if defined(__SSE__)
    _mm_setcsr(0x1f80);
#endif
}

static void *worker_main(void *arg) {
    const int slot = (int)(intptr_t)arg;
    set_fp_mode();
    uint32_t last = 0;
    for (;;) {
        uint64_t c = atomic_load(&g_pool.ctl);
        if ((uint32_t)(c >> 32) == last) {
            long until = now_ns() + g_pool.spin_ns;
            int spins = 0;
            while ((uint32_t)((c = atomic_load(&g_pool.ctl)) >> 32) == last) {
                if (atomic_load(&g_pool.stop)) return NULL;
                cpu_relax();
                if (spins > 4096 && spins % 256 == 0) sched_yield(); /* leave a busy core */
                if (++spins % 64 == 0 && now_ns() > until) {
                    uint32_t w = atomic_load(&g_pool.wake);
                    atomic_fetch_add(&g_pool.sleepers, 1);
                    c = atomic_load(&g_pool.ctl);
                    if ((uint32_t)(c >> 32) == last && !atomic_load(&g_pool.stop))
                        futex_wait(&g_pool.wake, w);
                    atomic_fetch_sub(&g_pool.sleepers, 1);
                    until = now_ns() + g_pool.spin_ns;
                }
            }
        }
        last = (uint32_t)(c >> 32);
        /* Join while the job is open and wants more workers. */
        for (;;) {
            if ((uint32_t)(c >> 32) != last || (c & CTL_CLOSED) ||
                (int)(c & CTL_COUNT) >= g_pool.max_workers) {
                c = 0;
                break;
            }
            if (atomic_compare_exchange_weak(&g_pool.ctl, &c, c + 1)) {
                c = 1;
                break;
            }
        }
        if (!c) continue;
        const int n = g_pool.n_chunks;
        job_fn fn = g_pool.fn;
        void *ctx = g_pool.ctx;
        int i;
        while ((i = atomic_fetch_add(&g_pool.next, 1)) < n) fn(ctx, i, slot);
        atomic_fetch_sub(&g_pool.ctl, 1);
    }
}

static void pool_stop(void) {
    if (g_pool.n_workers == 0) return;
    atomic_store(&g_pool.stop, 1);
    atomic_fetch_add(&g_pool.wake, 1);
    futex_wake_all(&g_pool.wake);
    for (int i = 0; i < g_pool.n_workers; i++) pthread_join(g_pool.tid[i], NULL);
    g_pool.n_workers = 0;
    atomic_store(&g_pool.stop, 0);
}

/* Makes sure `workers` worker threads exist in this process (a forked child starts its
 * own: threads do not survive fork). */
static int pool_ensure(int workers) {
    if (workers > MAX_THREADS - 1) workers = MAX_THREADS - 1;
    pid_t pid = getpid();
    if (g_pool.pid != pid) {
        memset(g_pool.tid, 0, sizeof g_pool.tid);
        g_pool.n_workers = 0;
        g_pool.pid = pid;
        /* A forward's parallel regions follow each other within microseconds; between
         * forwards a spinning worker would only take a core from the coordinator or the
         * drafter (measured: 5 to 100 us of spin left the forward's time unchanged). */
        if (!g_pool.spin_ns) g_pool.spin_ns = 10000;
    }
    while (g_pool.n_workers < workers) {
        int slot = g_pool.n_workers + 1;
        if (pthread_create(&g_pool.tid[g_pool.n_workers], NULL, worker_main, (void *)(intptr_t)slot))
            break;
        g_pool.n_workers++;
    }
    return g_pool.n_workers;
}

/* The threads a call may use: itself and min(threads - 1, the workers there are). */
static int pool_threads(int threads) {
    if (threads <= 1) return 1;
    int workers = pool_ensure(threads - 1);
    return 1 + (workers < threads - 1 ? workers : threads - 1);
}

/* Runs fn(ctx, i, slot) for every i in [0, n_chunks) on up to `threads` threads (the caller
 * is slot 0, workers 1..). Chunks must be independent; which thread runs one never changes
 * its result. */
static void parallel(job_fn fn, void *ctx, int n_chunks, int threads) {
    if (n_chunks <= 0) return;
    if (threads <= 1 || n_chunks == 1) {
        for (int i = 0; i < n_chunks; i++) fn(ctx, i, 0);
        return;
    }
    int workers = threads - 1;
    if (workers > n_chunks - 1) workers = n_chunks - 1;
    g_pool.fn = fn;
    g_pool.ctx = ctx;
    g_pool.n_chunks = n_chunks;
    g_pool.max_workers = workers;
    atomic_store(&g_pool.next, 0);
    uint64_t epoch = (atomic_load(&g_pool.ctl) >> 32) + 1;
    atomic_store(&g_pool.ctl, epoch << 32);
    if (atomic_load(&g_pool.sleepers) > 0) {
        atomic_fetch_add(&g_pool.wake, 1);
        futex_wake_all(&g_pool.wake);
    }
    int i;
    while ((i = atomic_fetch_add(&g_pool.next, 1)) < n_chunks) fn(ctx, i, 0);
    atomic_fetch_or(&g_pool.ctl, CTL_CLOSED);
    /* A worker still in its last chunk: spin briefly, then yield (on a busy machine it may
     * wait for this very core). */
    for (int spins = 0; atomic_load(&g_pool.ctl) & CTL_COUNT; spins++) {
        if (spins < 2000) cpu_relax();
        else sched_yield();
    }
}

/* ------------------------------------------------------------------------------------ */
/* Matmul: y[r, col(p, j)] (+)= x[r, :] . w_p[j, :] for the parts p of one call. */

#if defined(__AVX512F__)
#define MR 4
#else
#define MR 2
#endif
#define NR 4

typedef struct {
    const wmat *parts;
    int n_parts;
    int tiles[8];   /* first tile of each part, and the total after the last */
    int col0[8];    /* first output column of each part */
    const float *x; /* [n, ldx], zero beyond k up to round_up(k, VL) */
    int n, ldx;
    float *y;
    int ldy;
    const float *bias;  /* [sum of n_p] or NULL */
    int accumulate;     /* y = y + x.w (the residual) instead of y = x.w */
    int tiles_per_chunk;
    float **panels;     /* per thread slot: NR * round_up(k, VL) floats */
} mm_job;

/* Tuning knobs (`specd_tune`): each picks among kernels of identical results. */
enum { TUNE_PREFETCH, TUNE_N };
/* TUNE_PREFETCH: how many blocks ahead the int8 kernels prefetch their weights (0: none;
 * 8 measured best here: a 47 MB Q4_1 matrix at 4 rows 1.33 -> 0.65 ms). */
static int g_tune[TUNE_N] = {8};

/* NR columns of one output tile over every row of x: one accumulator per (row, column),
 * the same k-ascending fma sequence whether the row is in an MR-row tile or the tail. */
static void mm_tile(const mm_job *job, int part, int j0, float *panel) {
    const wmat *w = &job->parts[part];
    const int k = w->k, kp = round_up(k, VL);
    const int cols = w->n - j0 < NR ? w->n - j0 : NR;
    const float *pw[NR];
    for (int c = 0; c < NR; c++) {
        if (c < cols && w->type == T_F32 && k % VL == 0) {
            pw[c] = (const float *)(w->data + (size_t)(j0 + c) * w->row_bytes);
        } else {
            float *dst = panel + (size_t)c * kp;
            if (c < cols) dequant_row(w->type, w->data + (size_t)(j0 + c) * w->row_bytes, k, dst);
            else memset(dst, 0, (size_t)kp * 4);
            pw[c] = dst;
        }
    }
    const int col = job->col0[part] + j0;
    const float *bias = job->bias ? job->bias + col : NULL;
    const int n = job->n, ldx = job->ldx;
    int r = 0;
    for (; r + MR <= n; r += MR) {
        vf acc[MR][NR];
        for (int i = 0; i < MR; i++)
            for (int c = 0; c < NR; c++) acc[i][c] = vzero();
        const float *xr = job->x + (size_t)r * ldx;
        for (int kk = 0; kk < kp; kk += VL) {
            vf wv[NR];
            for (int c = 0; c < NR; c++) wv[c] = vload(pw[c] + kk);
            for (int i = 0; i < MR; i++) {
                vf xv = vload(xr + (size_t)i * ldx + kk);
                for (int c = 0; c < NR; c++) acc[i][c] = vfma(xv, wv[c], acc[i][c]);
            }
        }
        for (int i = 0; i < MR; i++) {
            float *yr = job->y + (size_t)(r + i) * job->ldy + col;
            for (int c = 0; c < cols; c++) {
                float s = hsum(acc[i][c]);
                if (bias) s = s + bias[c];
                yr[c] = job->accumulate ? yr[c] + s : s;
            }
        }
    }
    for (; r < n; r++) {
        vf acc[NR];
        for (int c = 0; c < NR; c++) acc[c] = vzero();
        const float *xr = job->x + (size_t)r * ldx;
        for (int kk = 0; kk < kp; kk += VL) {
            vf xv = vload(xr + kk);
            for (int c = 0; c < NR; c++) acc[c] = vfma(xv, vload(pw[c] + kk), acc[c]);
        }
        float *yr = job->y + (size_t)r * job->ldy + col;
        for (int c = 0; c < cols; c++) {
            float s = hsum(acc[c]);
            if (bias) s = s + bias[c];
            yr[c] = job->accumulate ? yr[c] + s : s;
        }
    }
}

static void mm_chunk(void *ctx, int chunk, int slot) {
    const mm_job *job = ctx;
    const int total = job->tiles[job->n_parts];
    int t0 = chunk * job->tiles_per_chunk, t1 = t0 + job->tiles_per_chunk;
    if (t1 > total) t1 = total;
    int part = 0;
    for (int t = t0; t < t1; t++) {
        while (t >= job->tiles[part + 1]) part++;
        mm_tile(job, part, (t - job->tiles[part]) * NR, job->panels[slot]);
    }
}

/* ------------------------------------------------------------------------------------ */
/* Int8 activations ("q8"): llama.cpp's arithmetic for quantized weights, with weights
 * repacked so that a vector's lanes are GW output columns (no horizontal sums).
 *
 * A row of x is cut into blocks of 32; each block is rounded to int8 with its own scale
 * (dx = amax / 127, q = round-to-nearest-even(x * 127 / amax)), and its float32 sum sx is
 * kept (exact x, for Q4_1's offset term). For a weight block (d, m, q) and an x block:
 *   isum = sum q_w * q_x                       (integers: exact in any order)
 *   acc  = fma(float(isum), d * dx, acc)        Q4_0 (q_w - 8), Q8_0 (q_w), Q4_1 (q_w)
 *   acc  = fma(m, sx, acc)                      Q4_1 only
 * over the blocks in ascending order, one float accumulator per (row, column): every
 * row's result is one fixed sequence whatever the tiling, the rows or the threads. */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define GW 16
typedef __m512i vi;
static inline vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi vi_lo4(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline vi vi_hi4(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vf vi_float(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf load_f16_gw(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#if defined(__AVX512VNNI__)
#define Q8_BIAS 128
/* acc + sum over each 4 bytes of u8 w times s8 x (exact: no saturation). */
static inline vi vi_dot(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
#define Q8_BIAS 0
static inline vi vi_dot(vi acc, vi w, vi x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
#endif
/* acc + s8 w times s8 x (Q8_0 where there is no u8 bias: |w| times x with w's sign). */
static inline vi vi_dot_s8(vi acc, vi w, vi x) {
    __mmask64 neg = _mm512_movepi8_mask(w);
    vi sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return vi_dot(acc, _mm512_abs_epi8(w), sx);
}
static inline void vstore_cols(float *p, vf v, int n) {
    if (n == GW) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}
static inline vf vload_cols(const float *p, int n) {
    return n == GW ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GW 8
#define Q8_BIAS 0
typedef __m256i vi;
static inline vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline vi vi_lo4(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline vi vi_hi4(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
static inline vf vi_float(vi a) { return _mm256_cvtepi32_ps(a); }
static inline vf load_f16_gw(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vi_dot(vi acc, vi w, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
static inline vi vi_dot_s8(vi acc, vi w, vi x) {
    return vi_dot(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
static inline void vstore_cols(float *p, vf v, int n) {
    if (n == GW) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, lane_mask(n), v);
}
static inline vf vload_cols(const float *p, int n) {
    return n == GW ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(n));
}
#else
#define GW 8
#define Q8_BIAS 0
#define GENERIC_INT 1
#endif

/* Repacked types: the GGUF type plus this. */
#define T_PACKED 100

/* Bytes of one (group of GW columns, block of 32) record: GW half scales (and GW half
 * offsets for Q4_1), then the quants: Q4 in 4 chunks of 4 * GW bytes (chunk j, byte
 * 4c + t: column c's q[4j + t] in the low nibble, q[16 + 4j + t] in the high one), Q8 in 8
 * chunks of 4 * GW bytes (chunk j, byte 4c + t: column c's q[4j + t] + Q8_BIAS). */
static inline int packed_record(int type) {
    switch (type) {
    case T_Q4_0: return GW * 2 + GW * 16;
    case T_Q4_1: return GW * 4 + GW * 16;
    case T_Q8_0: return GW * 2 + GW * 32;
    default: return 0;
    }
}

size_t specd_packed_bytes(const wmat *w) {
    int rec = packed_record(w->type);
    if (!rec || w->k % 32) return 0;
    return (size_t)((w->n + GW - 1) / GW) * (w->k / 32) * rec;
}

/* Repacks a Q4_0 / Q4_1 / Q8_0 weight into dst (specd_packed_bytes of it); missing columns
 * of the last group are zero (scale 0). Returns 0, or 1 for a type it does not pack. */
int specd_repack(const wmat *w, uint8_t *dst) {
    const int rec = packed_record(w->type), nb = w->k / 32, bb = block_bytes(w->type);
    if (!rec || w->k % 32) return 1;
    const int groups = (w->n + GW - 1) / GW;
    memset(dst, 0, specd_packed_bytes(w));
    for (int g = 0; g < groups; g++) {
        for (int b = 0; b < nb; b++) {
            uint8_t *r = dst + ((size_t)g * nb + b) * rec;
            uint16_t *d = (uint16_t *)r, *m = (uint16_t *)(r + 2 * GW);
            uint8_t *q = r + (w->type == T_Q4_1 ? 4 : 2) * GW;
            for (int c = 0; c < GW; c++) {
                const int col = g * GW + c;
                if (col >= w->n) continue;
                const uint8_t *blk = w->data + (size_t)col * w->row_bytes + (size_t)b * bb;
                memcpy(&d[c], blk, 2);
                if (w->type == T_Q4_1) memcpy(&m[c], blk + 2, 2);
                if (w->type == T_Q8_0) {
                    const int8_t *qs = (const int8_t *)(blk + 2);
                    for (int j = 0; j < 8; j++)
                        for (int t = 0; t < 4; t++)
                            q[j * 4 * GW + 4 * c + t] = (uint8_t)(qs[4 * j + t] + Q8_BIAS);
                } else {
                    const uint8_t *qs = blk + (w->type == T_Q4_1 ? 4 : 2);
                    uint8_t v[32];
                    for (int j = 0; j < 16; j++) { v[j] = qs[j] & 15; v[j + 16] = qs[j] >> 4; }
                    for (int j = 0; j < 4; j++)
                        for (int t = 0; t < 4; t++)
                            q[j * 4 * GW + 4 * c + t] = (uint8_t)(v[4 * j + t] | (v[16 + 4 * j + t] << 4));
                }
            }
        }
    }
    return 0;
}

/* One row of x (k floats, k % 32 == 0) as int8 blocks: qx[k], dx[k / 32], sx[k / 32] (the
 * float sum of the block's x, ascending VL steps then hsum), sq[k / 32] (sum of qx). Per
 * block: amax = max |x|, dx = amax / 127, q = x * (1 / dx) rounded to nearest even (the
 * default rounding mode, which every thread runs with) and clamped to [-127, 127]. */
static void quantize_row(const float *x, int k, int8_t *qx, float *dx, float *sx, int32_t *sq) {
    for (int b = 0; b < k / 32; b++) {
        const float *xb = x + b * 32;
        vf mx = vzero(), acc = vzero();
        for (int i = 0; i < 32; i += VL) {
            const vf v = vload(xb + i);
            mx = vmax(mx, vmax(v, vsub(vzero(), v)));
            acc = vadd(acc, v);
        }
        const float amax = hmax(mx);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
#if defined(__AVX512F__)
        const __m512 vid = _mm512_set1_ps(id);
        for (int i = 0; i < 32; i += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vid));
            q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
            _mm_storeu_si128((__m128i *)(qx + b * 32 + i), _mm512_cvtepi32_epi8(q));
            sum += _mm512_reduce_add_epi32(q);
        }
#elif defined(__AVX2__)
        const __m256 vid = _mm256_set1_ps(id);
        for (int i = 0; i < 32; i += 8) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
            q = _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, q);
            for (int t = 0; t < 8; t++) {
                qx[b * 32 + i + t] = (int8_t)lanes[t];
                sum += lanes[t];
            }
        }
#else
        for (int i = 0; i < 32; i++) {
            float v = nearbyintf(xb[i] * id);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v == v ? v : 0.0f;
            qx[b * 32 + i] = (int8_t)v;
            sum += (int8_t)v;
        }
#endif
        dx[b] = d;
        sx[b] = hsum(acc);
        sq[b] = sum;
    }
}

typedef struct {
    const wmat *w;   /* packed (T_PACKED + type) */
    int col0;        /* first output column */
    int groups;
    const int8_t *qx; /* [n, ldq] */
    const float *dx, *sx;
    const int32_t *sq; /* [n, ldb] */
    int ldq, ldb, n;
    float *y;
    int ldy;
    const float *bias;
    int accumulate;
    int groups_per_tile, tiles_per_chunk, tiles;
} q8_job;

#if !defined(GENERIC_INT)
#define QR 5 /* rows per register tile, at most */
#define QG 2 /* column groups per register tile */

static inline __attribute__((always_inline)) void q8_tile(const q8_job *j, int g0, int r0,
                                                         const int R, const int G, const int TYPE) {
    const int nb = j->w->k / 32, rec = packed_record(TYPE);
    const int qoff = (TYPE == T_Q4_1 ? 4 : 2) * GW;
    vf acc[QR][QG];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) acc[r][g] = vzero();
    const uint8_t *base[QG];
    for (int g = 0; g < G; g++) base[g] = j->w->data + (size_t)(g0 + g) * nb * rec;
    for (int b = 0; b < nb; b++) {
        vi isum[QR][QG];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < G; g++) isum[r][g] = vi_zero();
        if (g_tune[TUNE_PREFETCH] && r0 == 0) /* the first row tile streams the weights in */
            for (int g = 0; g < G; g++)
                for (int o = 0; o < rec; o += 64)
                    __builtin_prefetch(base[g] + (size_t)(b + g_tune[TUNE_PREFETCH]) * rec + o);
        if (TYPE == T_Q8_0) {
            for (int c = 0; c < 8; c++) {
                vi wq[QG];
                for (int g = 0; g < G; g++) wq[g] = vi_load(base[g] + (size_t)b * rec + qoff + c * 4 * GW);
                for (int r = 0; r < R; r++) {
                    int32_t xw;
                    memcpy(&xw, j->qx + (size_t)(r0 + r) * j->ldq + b * 32 + 4 * c, 4);
                    const vi xv = vi_set1(xw);
                    for (int g = 0; g < G; g++)
                        isum[r][g] = Q8_BIAS ? vi_dot(isum[r][g], wq[g], xv) : vi_dot_s8(isum[r][g], wq[g], xv);
                }
            }
        } else {
            for (int c = 0; c < 4; c++) {
                vi lo[QG], hi[QG];
                for (int g = 0; g < G; g++) {
                    const vi v = vi_load(base[g] + (size_t)b * rec + qoff + c * 4 * GW);
                    lo[g] = vi_lo4(v);
                    hi[g] = vi_hi4(v);
                }
                for (int r = 0; r < R; r++) {
                    int32_t xl, xh;
                    const int8_t *xq = j->qx + (size_t)(r0 + r) * j->ldq + b * 32;
                    memcpy(&xl, xq + 4 * c, 4);
                    memcpy(&xh, xq + 16 + 4 * c, 4);
                    const vi vl = vi_set1(xl), vh = vi_set1(xh);
                    for (int g = 0; g < G; g++)
                        isum[r][g] = vi_dot(vi_dot(isum[r][g], lo[g], vl), hi[g], vh);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            const uint8_t *rp = base[g] + (size_t)b * rec;
            const vf dw = load_f16_gw((const uint16_t *)rp);
            vf mw = vzero();
            if (TYPE == T_Q4_1) mw = load_f16_gw((const uint16_t *)(rp + 2 * GW));
            for (int r = 0; r < R; r++) {
                const size_t at = (size_t)(r0 + r) * j->ldb + b;
                vi is = isum[r][g];
                if (TYPE == T_Q4_0) is = vi_sub(is, vi_set1(8 * j->sq[at]));
                if (TYPE == T_Q8_0 && Q8_BIAS) is = vi_sub(is, vi_set1(Q8_BIAS * j->sq[at]));
                acc[r][g] = vfma(vi_float(is), vmul(dw, vset1(j->dx[at])), acc[r][g]);
                if (TYPE == T_Q4_1) acc[r][g] = vfma(mw, vset1(j->sx[at]), acc[r][g]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const int c0 = (g0 + g) * GW;
        int cols = j->w->n - c0;
        if (cols > GW) cols = GW;
        const int col = j->col0 + c0;
        const vf bias = j->bias ? vload_cols(j->bias + col, cols) : vzero();
        for (int r = 0; r < R; r++) {
            float *yr = j->y + (size_t)(r0 + r) * j->ldy + col;
            vf v = acc[r][g];
            if (j->bias) v = vadd(v, bias);
            if (j->accumulate) v = vadd(vload_cols(yr, cols), v);
            vstore_cols(yr, v, cols);
        }
    }
}

/* Rows in tiles of at most QR, as even as can be (9 rows: 5 + 4): each tile reads and
 * unpacks the weights again, so fewer tiles cost less; the tiling never changes a row's
 * result. */
#define Q8_ROWS(G, TYPE)                                                     \
    for (r = 0; r < n;) {                                                    \
        const int left = n - r, tiles = (left + QR - 1) / QR;                \
        const int rows = (left + tiles - 1) / tiles;                         \
        switch (rows) {                                                      \
        case 1: q8_tile(j, g0, r, 1, G, TYPE); break;                        \
        case 2: q8_tile(j, g0, r, 2, G, TYPE); break;                        \
        case 3: q8_tile(j, g0, r, 3, G, TYPE); break;                        \
        case 4: q8_tile(j, g0, r, 4, G, TYPE); break;                        \
        default: q8_tile(j, g0, r, QR, G, TYPE); break;                      \
        }                                                                    \
        r += rows;                                                           \
    }

static void q8_groups(const q8_job *j, int g0, int ng) {
    const int n = j->n, type = j->w->type - T_PACKED;
    int r;
    if (ng == QG) {
        if (type == T_Q4_0) { Q8_ROWS(QG, T_Q4_0) }
        else if (type == T_Q4_1) { Q8_ROWS(QG, T_Q4_1) }
        else { Q8_ROWS(QG, T_Q8_0) }
    } else {
        for (int g = 0; g < ng; g++, g0++) {
            if (type == T_Q4_0) { Q8_ROWS(1, T_Q4_0) }
            else if (type == T_Q4_1) { Q8_ROWS(1, T_Q4_1) }
            else { Q8_ROWS(1, T_Q8_0) }
        }
    }
}
#else
#define QG 1
/* Plain C: the same integer sums and the same float sequence per (row, column). */
static void q8_groups(const q8_job *j, int g0, int ng) {
    const int type = j->w->type - T_PACKED, nb = j->w->k / 32, rec = packed_record(type);
    const int qoff = (type == T_Q4_1 ? 4 : 2) * GW;
    for (int g = g0; g < g0 + ng; g++) {
        for (int r = 0; r < j->n; r++) {
            float acc[GW] = {0};
            for (int b = 0; b < nb; b++) {
                const uint8_t *rp = j->w->data + ((size_t)g * nb + b) * rec;
                const int8_t *xq = j->qx + (size_t)r * j->ldq + b * 32;
                const size_t at = (size_t)r * j->ldb + b;
                for (int c = 0; c < GW; c++) {
                    int32_t is = 0;
                    for (int t = 0; t < 32; t++) {
                        int qw;
                        if (type == T_Q8_0) {
                            qw = (int8_t)rp[qoff + (t / 4) * 4 * GW + 4 * c + t % 4];
                        } else {
                            int jj = (t % 16) / 4, byte = rp[qoff + jj * 4 * GW + 4 * c + t % 4];
                            qw = t < 16 ? (byte & 15) : (byte >> 4);
                            if (type == T_Q4_0) qw -= 8;
                        }
                        is += qw * xq[t];
                    }
                    uint16_t dh, mh;
                    memcpy(&dh, rp + 2 * c, 2);
                    acc[c] = fmaf((float)is, f16_to_f32(dh) * j->dx[at], acc[c]);
                    if (type == T_Q4_1) {
                        memcpy(&mh, rp + 2 * GW + 2 * c, 2);
                        acc[c] = fmaf(f16_to_f32(mh), j->sx[at], acc[c]);
                    }
                }
            }
            for (int c = 0; c < GW; c++) {
                const int c0 = g * GW + c;
                if (c0 >= j->w->n) break;
                float v = acc[c];
                float *y = j->y + (size_t)r * j->ldy + j->col0 + c0;
                if (j->bias) v = v + j->bias[j->col0 + c0];
                *y = j->accumulate ? *y + v : v;
            }
        }
    }
}
#endif

static void q8_chunk(void *ctx, int chunk, int slot) {
    (void)slot;
    const q8_job *j = ctx;
    int t0 = chunk * j->tiles_per_chunk, t1 = t0 + j->tiles_per_chunk;
    if (t1 > j->tiles) t1 = j->tiles;
    for (int t = t0; t < t1; t++) {
        int g0 = t * QG, ng = j->groups - g0 < QG ? j->groups - g0 : QG;
        q8_groups(j, g0, ng);
    }
}

/* ------------------------------------------------------------------------------------ */
/* Model and per-call descriptions (mirrored by ctypes in target_worker/native.py). */

typedef struct {
    wmat qkv[3];
    int32_t n_qkv;
    int32_t n_gate_up;
    wmat gate_up[2];
    wmat o;
    wmat down;
    const float *qkv_bias; /* [(h + 2 kvh) * d] or NULL */
    const float *attn_norm;
    const float *ffn_norm;
} layer_t;

typedef struct {
    int32_t n_layers, hidden, n_heads, n_kv_heads, head_dim, ffn, vocab, key_block;
    float eps;
    int32_t kv_type; /* T_F32, T_F16 or T_BF16 */
    int32_t mode;    /* 0: float32 activations; 1: int8 activation blocks for Q4_0/Q4_1/Q8_0 */
    int32_t pad;
    wmat embed;      /* [vocab, hidden] */
    wmat head;       /* [vocab, hidden] */
    const float *norm;
    const layer_t *layers;
} model_t;

typedef struct {
    int32_t n_rows;
    int32_t n_segs;
    const int32_t *tokens;    /* [n_rows] */
    const int32_t *seg_lo;    /* [n_segs]: first row */
    const int32_t *seg_hi;    /* [n_segs]: one past the last row */
    const int32_t *seg_start; /* [n_segs]: absolute position of the first row */
    const int32_t *seg_blocks;/* [n_segs]: key blocks the cache tensors hold */
    void *const *seg_k;       /* [n_segs]: [n_layers, blocks, kvh, key_block, d] */
    void *const *seg_v;
    const float *cos;         /* [rope_len, d] */
    const float *sin;         /* [rope_len, d], rotate_half's sign folded in */
    int32_t rope_len;
    int32_t n_capture;
    const int32_t *capture;   /* ascending layer ids in [0, n_layers] */
    float *hidden;            /* [n_rows, max(1, n_capture) * hidden] */
    int32_t n_logit_rows;
    const int32_t *logit_rows;/* rows whose logits are computed */
    float *logits;            /* [n_logit_rows, vocab] */
    int32_t threads;
} batch_t;

/* Scratch of one model, grown on demand (a model runs one call at a time). */
typedef struct {
    size_t bytes;
    float *base;
    int rows;
    float *x, *xn, *qkv, *att, *gu, *hb, *fin;
    float *panels[MAX_THREADS];
    float *scores[MAX_THREADS];
    int score_len; /* floats per query vector in scores[slot] */
    int8_t *qx;       /* [rows, max_k] int8 activations */
    float *dx, *sx;   /* [rows, max_k / 32] */
    int32_t *sq;
    int max_k;
} work_t;

typedef struct {
    model_t m;
    layer_t *layers;
    work_t w;
    uint8_t **packed; /* repacked copies (mode 1), freed with the handle */
    int n_packed;
} handle_t;

static float *alloc_floats(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, (n ? n : 1) * sizeof(float))) return NULL;
    return p;
}

size_t specd_packed_bytes(const wmat *w);
int specd_repack(const wmat *w, uint8_t *dst);
void specd_model_free(void *hp);

/* Mode 1: replaces a Q4_0 / Q4_1 / Q8_0 weight by its repacked copy (owned by h). */
static int pack_weight(handle_t *h, wmat *w) {
    size_t bytes = specd_packed_bytes(w);
    if (!bytes) return 0;
    uint8_t *dst = NULL;
    if (posix_memalign((void **)&dst, 64, bytes)) return -1;
    specd_repack(w, dst);
    h->packed[h->n_packed++] = dst;
    w->type += T_PACKED;
    w->data = dst;
    return 0;
}

void *specd_model_new(const model_t *m) {
    handle_t *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->m = *m;
    h->layers = malloc(sizeof(layer_t) * (size_t)(m->n_layers ? m->n_layers : 1));
    if (!h->layers) { free(h); return NULL; }
    memcpy(h->layers, m->layers, sizeof(layer_t) * (size_t)m->n_layers);
    h->m.layers = h->layers;
    if (m->mode == 1) {
        h->packed = calloc((size_t)m->n_layers * 7 + 1, sizeof(uint8_t *));
        if (!h->packed) { specd_model_free(h); return NULL; }
        int bad = pack_weight(h, &h->m.head);
        for (int l = 0; l < m->n_layers && !bad; l++) {
            layer_t *L = &h->layers[l];
            for (int i = 0; i < L->n_qkv; i++) bad |= pack_weight(h, &L->qkv[i]);
            for (int i = 0; i < L->n_gate_up; i++) bad |= pack_weight(h, &L->gate_up[i]);
            bad |= pack_weight(h, &L->o);
            bad |= pack_weight(h, &L->down);
        }
        if (bad) { specd_model_free(h); return NULL; }
    }
    return h;
}

static void work_free(work_t *w) {
    free(w->base);
    free(w->qx);
    free(w->dx);
    free(w->sx);
    free(w->sq);
    for (int i = 0; i < MAX_THREADS; i++) {
        free(w->panels[i]);
        free(w->scores[i]);
    }
    memset(w, 0, sizeof *w);
}

void specd_model_free(void *hp) {
    handle_t *h = hp;
    if (!h) return;
    work_free(&h->w);
    for (int i = 0; i < h->n_packed; i++) free(h->packed[i]);
    free(h->packed);
    free(h->layers);
    free(h);
}

/* Padded row strides (floats) of the activations. */
static int max_k_of(const work_t *w);
typedef struct { int x, qkv, att, gu, hb; } strides_t;

static strides_t strides_of(const model_t *m) {
    strides_t s;
    const int q = m->n_heads * m->head_dim, kv = m->n_kv_heads * m->head_dim;
    s.x = round_up(m->hidden, VL);
    s.qkv = round_up(q + 2 * kv, VL);
    s.att = round_up(q, VL);
    s.gu = round_up(2 * m->ffn, VL);
    s.hb = round_up(m->ffn, VL);
    return s;
}

static int max_k(const model_t *m) {
    int k = m->hidden;
    if (m->ffn > k) k = m->ffn;
    if (m->n_heads * m->head_dim > k) k = m->n_heads * m->head_dim;
    return k;
}

/* Room for `rows` rows and `positions` + 1 scores, and per-thread scratch for every slot
 * of the pool (any worker may join a job, whichever it is). */
static int max_k_of(const work_t *w) { return w->max_k; }

static int work_reserve(handle_t *h, int rows, int positions) {
    const int slots = g_pool.n_workers + 1;
    h->w.max_k = max_k(&h->m);
    work_t *w = &h->w;
    const model_t *m = &h->m;
    if (rows > w->rows) {
        strides_t s = strides_of(m);
        size_t per_row = (size_t)2 * s.x + s.qkv + s.att + s.gu + s.hb + s.x;
        int want = rows > 2 * w->rows ? rows : 2 * w->rows;
        float *base = alloc_floats(per_row * (size_t)want);
        if (!base) return -1;
        memset(base, 0, per_row * (size_t)want * sizeof(float));
        free(w->base);
        w->base = base;
        w->rows = want;
        float *p = base;
        w->x = p; p += (size_t)s.x * want;
        w->xn = p; p += (size_t)s.x * want;
        w->qkv = p; p += (size_t)s.qkv * want;
        w->att = p; p += (size_t)s.att * want;
        w->gu = p; p += (size_t)s.gu * want;
        w->hb = p; p += (size_t)s.hb * want;
        w->fin = p;
        const int mk = round_up(max_k(m), 32);
        free(w->qx); free(w->dx); free(w->sx); free(w->sq);
        w->qx = malloc((size_t)want * mk);
        w->dx = malloc(sizeof(float) * (size_t)want * (mk / 32));
        w->sx = malloc(sizeof(float) * (size_t)want * (mk / 32));
        w->sq = malloc(sizeof(int32_t) * (size_t)want * (mk / 32));
        if (!w->qx || !w->dx || !w->sx || !w->sq) { w->rows = 0; return -1; }
    }
    const int kp = round_up(max_k(m), VL);
    const int need_scores = round_up(positions + 1, VL);
    if (need_scores > w->score_len) {
        int len = need_scores > 2 * w->score_len ? need_scores : 2 * w->score_len;
        for (int i = 0; i < MAX_THREADS; i++) {
            free(w->scores[i]);
            w->scores[i] = NULL;
        }
        w->score_len = round_up(len, VL);
    }
    for (int i = 0; i < slots && i < MAX_THREADS; i++) {
        if (!w->panels[i]) {
            w->panels[i] = alloc_floats((size_t)NR * kp);
            if (!w->panels[i]) return -1;
        }
        if (!w->scores[i]) {
            w->scores[i] = alloc_floats((size_t)QC_MAX * w->score_len);
            if (!w->scores[i]) return -1;
        }
    }
    return 0;
}

/* Columns a tile of NR covers per chunk: enough work per atomic, enough chunks to balance. */
static int tiles_per_chunk(int total_tiles, int threads, int rows) {
    int per = total_tiles / (threads * 8);
    if (rows >= 8) per = total_tiles / (threads * 16);
    if (per < 1) per = 1;
    if (per > 64) per = 64;
    return per;
}

typedef struct {
    const float *x;
    int ldx, k;
    work_t *w;
    int rows_per_chunk, n;
} quant_job;

static void quant_chunk(void *ctx, int chunk, int slot) {
    (void)slot;
    const quant_job *q = ctx;
    const int ldq = round_up(max_k_of(q->w), 32), ldb = ldq / 32;
    int r1 = (chunk + 1) * q->rows_per_chunk;
    if (r1 > q->n) r1 = q->n;
    for (int r = chunk * q->rows_per_chunk; r < r1; r++)
        quantize_row(q->x + (size_t)r * q->ldx, q->k, q->w->qx + (size_t)r * ldq,
                     q->w->dx + (size_t)r * ldb, q->w->sx + (size_t)r * ldb,
                     q->w->sq + (size_t)r * ldb);
}

static void matmul_f32(handle_t *h, const wmat *parts, int n_parts, const float *x, int n,
                       int ldx, float *y, int ldy, const float *bias, int accumulate,
                       int threads);

/* y (+)= x . parts^T, the parts' outputs side by side: packed parts (mode 1) by the int8
 * kernels on x rounded to int8 blocks once per call, the others in float32. */
static void matmul(handle_t *h, const wmat *parts, int n_parts, const float *x, int n, int ldx,
                   float *y, int ldy, const float *bias, int accumulate, int threads) {
    int packed = 0;
    for (int p = 0; p < n_parts; p++) packed += parts[p].type >= T_PACKED;
    if (!packed) {
        matmul_f32(h, parts, n_parts, x, n, ldx, y, ldy, bias, accumulate, threads);
        return;
    }
    const int ldq = round_up(max_k_of(&h->w), 32), ldb = ldq / 32;
    quant_job qj = {x, ldx, parts[0].k, &h->w, 4, n};
    parallel(quant_chunk, &qj, (n + 3) / 4, n >= 8 ? threads : 1);
    int col = 0;
    for (int p = 0; p < n_parts; p++) {
        const wmat *w = &parts[p];
        if (w->type < T_PACKED) {
            matmul_f32(h, w, 1, x, n, ldx, y + col, ldy, bias ? bias + col : NULL, accumulate,
                       threads);
        } else {
            q8_job j;
            memset(&j, 0, sizeof j);
            j.w = w;
            j.col0 = col;
            j.groups = (w->n + GW - 1) / GW;
            j.qx = h->w.qx;
            j.dx = h->w.dx;
            j.sx = h->w.sx;
            j.sq = h->w.sq;
            j.ldq = ldq;
            j.ldb = ldb;
            j.n = n;
            j.y = y;
            j.ldy = ldy;
            j.bias = bias;
            j.accumulate = accumulate;
            j.tiles = (j.groups + QG - 1) / QG;
            j.tiles_per_chunk = tiles_per_chunk(j.tiles, threads, n);
            parallel(q8_chunk, &j, (j.tiles + j.tiles_per_chunk - 1) / j.tiles_per_chunk, threads);
        }
        col += w->n;
    }
}

static void matmul_f32(handle_t *h, const wmat *parts, int n_parts, const float *x, int n,
                       int ldx, float *y, int ldy, const float *bias, int accumulate,
                       int threads) {
    mm_job job;
    memset(&job, 0, sizeof job);
    job.parts = parts;
    job.n_parts = n_parts;
    int t = 0, col = 0;
    for (int p = 0; p < n_parts; p++) {
        job.tiles[p] = t;
        job.col0[p] = col;
        t += (parts[p].n + NR - 1) / NR;
        col += parts[p].n;
    }
    job.tiles[n_parts] = t;
    job.x = x;
    job.n = n;
    job.ldx = ldx;
    job.y = y;
    job.ldy = ldy;
    job.bias = bias;
    job.accumulate = accumulate;
    job.tiles_per_chunk = tiles_per_chunk(t, threads, n);
    job.panels = h->w.panels;
    parallel(mm_chunk, &job, (t + job.tiles_per_chunk - 1) / job.tiles_per_chunk, threads);
}

/* ------------------------------------------------------------------------------------ */
/* Per-row operations. */

/* y = x / sqrt(mean(x^2) + eps) * w over k elements (y's tail up to round_up(k, VL) zero). */
static void rmsnorm_row(const float *x, const float *w, int k, float eps, float *y) {
    vf acc = vzero();
    int i = 0;
    for (; i + VL <= k; i += VL) {
        vf v = vload(x + i);
        acc = vfma(v, v, acc);
    }
    if (i < k) {
        vf v = vload_n(x + i, k - i);
        acc = vfma(v, v, acc);
    }
    const float r = 1.0f / sqrtf(hsum(acc) / (float)k + eps);
    const vf vr = vset1(r);
    for (i = 0; i + VL <= k; i += VL) vstore(y + i, vmul(vmul(vload(x + i), vr), vload(w + i)));
    if (i < k) vstore_n(y + i, vmul(vmul(vload_n(x + i, k - i), vr), vload_n(w + i, k - i)), k - i);
}

typedef struct {
    const float *x;
    int ldx;
    const float *w;
    int k;
    float eps;
    float *y;
    int ldy;
    int rows_per_chunk;
    int n;
} norm_job;

static void norm_chunk(void *ctx, int chunk, int slot) {
    (void)slot;
    const norm_job *j = ctx;
    int r1 = (chunk + 1) * j->rows_per_chunk;
    if (r1 > j->n) r1 = j->n;
    for (int r = chunk * j->rows_per_chunk; r < r1; r++)
        rmsnorm_row(j->x + (size_t)r * j->ldx, j->w, j->k, j->eps, j->y + (size_t)r * j->ldy);
}

static void rmsnorm_rows(const float *x, int ldx, const float *w, int k, float eps, float *y,
                         int ldy, int n, int threads) {
    norm_job j = {x, ldx, w, k, eps, y, ldy, 16, n};
    parallel(norm_chunk, &j, (n + 15) / 16, n >= 32 ? threads : 1);
}

/* h = silu(g) * u = g / (1 + exp(-g)) * u over f elements of each row. */
typedef struct {
    const float *gu;
    int ldgu, f;
    float *hb;
    int ldhb, n, rows_per_chunk;
} silu_job;

static void silu_chunk(void *ctx, int chunk, int slot) {
    (void)slot;
    const silu_job *j = ctx;
    int r1 = (chunk + 1) * j->rows_per_chunk;
    if (r1 > j->n) r1 = j->n;
    const vf one = vset1(1.0f), zero = vzero();
    for (int r = chunk * j->rows_per_chunk; r < r1; r++) {
        const float *g = j->gu + (size_t)r * j->ldgu, *u = g + j->f;
        float *o = j->hb + (size_t)r * j->ldhb;
        int i = 0;
        for (; i + VL <= j->f; i += VL) {
            vf gv = vload(g + i);
            vf s = vdiv(gv, vadd(one, vexp(vsub(zero, gv))));
            vstore(o + i, vmul(s, vload(u + i)));
        }
        if (i < j->f) {
            int t = j->f - i;
            vf gv = vload_n(g + i, t);
            vf s = vdiv(gv, vadd(one, vexp(vsub(zero, gv))));
            vstore_n(o + i, vmul(s, vload_n(u + i, t)), t);
        }
    }
}

/* RoPE ("rotate_half" layout) of one head's d values at one position: x*cos + rot(x)*sin. */
static void rope_head(float *x, const float *cos, const float *sin, int d) {
    float tmp[512];
    const int half = d / 2;
    for (int i = 0; i < d; i++) tmp[i] = x[i];
    for (int i = 0; i < d; i++) {
        float rot = i < half ? tmp[i + half] : tmp[i - half];
        float a = tmp[i] * cos[i];
        float b = rot * sin[i];
        x[i] = a + b;
    }
}

/* Element offset of (layer, KV head, position) in a cache of `blocks` key blocks
 * (key_block is a power of two: specd_forward checks). */
static inline size_t kv_offset(const model_t *m, int layer, int blocks, int head, int pos) {
    const int B = m->key_block, shift = __builtin_ctz((unsigned)B);
    return ((((size_t)layer * blocks + (pos >> shift)) * m->n_kv_heads + head) * B +
            (pos & (B - 1))) * (size_t)m->head_dim;
}

static void kv_store(const model_t *m, void *base, size_t off, const float *src) {
    if (m->kv_type == T_BF16) {
        uint16_t *dst = (uint16_t *)base + off;
        for (int i = 0; i < m->head_dim; i++) dst[i] = f32_to_bf16(src[i]);
    } else if (m->kv_type == T_F16) {
        uint16_t *dst = (uint16_t *)base + off;
        for (int i = 0; i < m->head_dim; i++) dst[i] = f32_to_f16(src[i]);
    } else {
        memcpy((float *)base + off, src, (size_t)m->head_dim * 4);
    }
}

/* A key or value row of the cache as floats (a pointer into a float32 cache, else converted
 * into buf). */
static inline const float *kv_row(const model_t *m, const void *base, size_t off, float *buf) {
    if (m->kv_type == T_BF16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < m->head_dim; i++) buf[i] = bf16_to_f32(src[i]);
        return buf;
    }
    if (m->kv_type == T_F16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int i = 0; i < m->head_dim; i++) buf[i] = f16_to_f32(src[i]);
        return buf;
    }
    return (const float *)base + off;
}

/* VL cache elements at base + off (elements) as floats: float32 or half caches. */
static inline __attribute__((always_inline)) vf kv_load(const void *base, size_t off, const int KVT) {
    if (KVT == T_F32) return vload((const float *)base + off);
    if (KVT == T_BF16) {
        const uint16_t *p = (const uint16_t *)base + off;
#if defined(__AVX512F__)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif defined(__AVX2__)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
        vf r;
        for (int i = 0; i < VL; i++) r.v[i] = bf16_to_f32(p[i]);
        return r;
#endif
    }
#if defined(__AVX512F__)
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
#elif defined(__F16C__) && defined(__AVX2__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off)));
#else
    vf r;
    for (int i = 0; i < VL; i++) r.v[i] = f16_to_f32(((const uint16_t *)base)[off + i]);
    return r;
#endif
}

/* dot over d of q (padded) and a key row, in VL steps from element 0. */
static inline float dot_d(const float *q, const float *k, int d) {
    vf acc = vzero();
    int i = 0;
    for (; i + VL <= d; i += VL) acc = vfma(vload(q + i), vload(k + i), acc);
    if (i < d) acc = vfma(vload_n(q + i, d - i), vload_n(k + i, d - i), acc);
    return hsum(acc);
}

/* Sums of 16 (VL) accumulators at once, lane j the sum of acc[j]'s lanes by exactly
 * hsum's tree (pairs j, j + VL/2, then j, j + VL/4, ...; adds commute): a key's score is
 * the same whether it is reduced here or alone. */
static inline vf reduce_lanes(vf a[VL]) {
#if defined(__AVX512F__)
    static const int32_t s1a[16] = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const int32_t s1b[16] = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const int32_t s2a[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    static const int32_t s2b[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    static const int32_t s3a[16] = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    static const int32_t s3b[16] = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    static const int32_t s4a[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    static const int32_t s4b[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    const __m512i i1a = _mm512_loadu_si512(s1a), i1b = _mm512_loadu_si512(s1b);
    const __m512i i2a = _mm512_loadu_si512(s2a), i2b = _mm512_loadu_si512(s2b);
    const __m512i i3a = _mm512_loadu_si512(s3a), i3b = _mm512_loadu_si512(s3b);
    const __m512i i4a = _mm512_loadu_si512(s4a), i4b = _mm512_loadu_si512(s4b);
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], i1a, a[2 * i + 1]),
                             _mm512_permutex2var_ps(a[2 * i], i1b, a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * i], i2a, b[2 * i + 1]),
                             _mm512_permutex2var_ps(b[2 * i], i2b, b[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_permutex2var_ps(c[2 * i], i3a, c[2 * i + 1]),
                             _mm512_permutex2var_ps(c[2 * i], i3b, c[2 * i + 1]));
    return _mm512_add_ps(_mm512_permutex2var_ps(d[0], i4a, d[1]),
                         _mm512_permutex2var_ps(d[0], i4b, d[1]));
#elif defined(__AVX2__) && defined(__FMA__)
    vf t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* u[0]: acc 0, 2 | 1, 3 (two partials each); u[1]: acc 4, 6 | 5, 7. */
    vf e = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* e: acc 0, 2, 4, 6 | 1, 3, 5, 7. */
    return _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
    vf r;
    for (int j = 0; j < VL; j++) r.v[j] = hsum(a[j]);
    return r;
#endif
}

typedef struct {
    const model_t *m;
    const batch_t *b;
    int layer;
    const float *qkv;
    int ldqkv;
    float *att;
    int ldatt;
    float **scores;  /* per slot: QC_MAX * score_len floats */
    int score_len;
    float scale;
    const int32_t *tasks; /* [n_tasks, 4]: segment, KV head, first query vector, count */
} att_job;

static inline const float *key_row(const model_t *m, const void *base, int layer, int blocks,
                                   int g, int t, float *buf) {
    return kv_row(m, base, kv_offset(m, layer, blocks, g, t), buf);
}

/* The scores of `count` queries q[i] (padded, scaled) against keys [0, n[i]) into sc[i]:
 * keys in groups of VL from position 0, each full group's keys read (and converted) once for
 * every query and reduced by reduce_lanes (hsum's tree); a query's last, partial group by
 * dot_d. A query's scores depend on its keys and n only. */
static void scores_of(const att_job *j, int s, int g, float (*q)[512], const int *n,
                      float *const *sc, int count) {
    const model_t *m = j->m;
    const int d = m->head_dim, blocks = j->b->seg_blocks[s];
    const void *kb = j->b->seg_k[s];
    int top = 0;
    for (int i = 0; i < count; i++) top = n[i] > top ? n[i] : top;
    float buf[512];
    const int fast = d % VL == 0;
    float keys[VL * 512];
    for (int t0 = 0; t0 < top; t0 += VL) {
        const float *k[VL];
        int full = 0;
        for (int i = 0; i < count; i++) full |= t0 + VL <= n[i];
        if (full && fast) {
            /* A group of VL keys from a multiple of VL never crosses a key block. */
            const size_t k0 = kv_offset(m, j->layer, blocks, g, t0);
            if (m->kv_type == T_F32) {
                for (int t = 0; t < VL; t++) k[t] = (const float *)kb + k0 + (size_t)t * d;
            } else {
                const int kvt = m->kv_type == T_F16 ? T_F16 : T_BF16;
                for (int t = 0; t < VL; t++) {
                    for (int e = 0; e < d; e += VL)
                        vstore(keys + t * d + e, kvt == T_F16
                               ? kv_load(kb, k0 + (size_t)t * d + e, T_F16)
                               : kv_load(kb, k0 + (size_t)t * d + e, T_BF16));
                    k[t] = keys + t * d;
                }
            }
        }
        for (int i = 0; i < count; i++) {
            if (t0 >= n[i]) continue;
            if (t0 + VL > n[i] || !fast) {
                for (int t = t0; t < n[i]; t++)
                    sc[i][t] = dot_d(q[i], key_row(m, kb, j->layer, blocks, g, t, buf), d);
                continue;
            }
            vf acc[VL];
            for (int t = 0; t < VL; t++) acc[t] = vzero();
            for (int e = 0; e < d; e += VL) {
                const vf qv = vload(q[i] + e);
                for (int t = 0; t < VL; t++) acc[t] = vfma(qv, vload(k[t] + e), acc[t]);
            }
            vstore(sc[i] + t0, reduce_lanes(acc));
        }
    }
}

/* softmax weights of sc[0, n) in place (exp(s - max), VL steps from 0; past n: 0) and
 * their sum. */
static float softmax_of(float *sc, int n) {
    const int np = round_up(n, VL);
    for (int t = n; t < np; t++) sc[t] = -INFINITY;
    vf mx = vset1(-INFINITY);
    for (int t = 0; t < np; t += VL) mx = vmax(mx, vload(sc + t));
    const vf top = vset1(hmax(mx));
    vf sum = vzero();
    for (int t = 0; t < np; t += VL) {
        vf e = vexp(vsub(vload(sc + t), top));
        vstore(sc + t, e);
        sum = vadd(sum, e);
    }
    return hsum(sum);
}

/* out_i = sum_t w_i[t] v_t / total_i for QN queries of one KV head, keys in ascending order,
 * ND vectors of d each (d == ND * VL); a query stops at its own n. */
static inline __attribute__((always_inline)) void values_of(
        const att_job *j, int s, int g, float *const *w, const int *n, const float *total,
        float *const *out, const int QN, const int ND, const int KVT) {
    const model_t *m = j->m;
    const int blocks = j->b->seg_blocks[s];
    const void *vb = j->b->seg_v[s];
    vf acc[4][8];
    for (int i = 0; i < QN; i++)
        for (int c = 0; c < ND; c++) acc[i][c] = vzero();
    int lo = n[0];
    for (int i = 1; i < QN; i++) lo = n[i] < lo ? n[i] : lo;
    int t = 0;
    const int B = m->key_block, d = ND * VL;
    size_t v = 0;
    for (; t < lo; t++, v += d) {
        if ((t & (B - 1)) == 0) v = kv_offset(m, j->layer, blocks, g, t);
        vf vv[8];
        for (int c = 0; c < ND; c++) vv[c] = kv_load(vb, v + c * VL, KVT);
        for (int i = 0; i < QN; i++) {
            const vf e = vset1(w[i][t]);
            for (int c = 0; c < ND; c++) acc[i][c] = vfma(e, vv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < QN; i++) {
        for (int u = t; u < n[i]; u++) {
            const size_t v = kv_offset(m, j->layer, blocks, g, u);
            const vf e = vset1(w[i][u]);
            for (int c = 0; c < ND; c++) acc[i][c] = vfma(e, kv_load(vb, v + c * VL, KVT), acc[i][c]);
        }
        const vf vt = vset1(total[i]);
        for (int c = 0; c < ND; c++) vstore(out[i] + c * VL, vdiv(acc[i][c], vt));
    }
}

/* The same for any d and cache type, one query at a time. */
static void values_generic(const att_job *j, int s, int g, const float *w, int n, float total,
                           float *out) {
    const model_t *m = j->m;
    const int d = m->head_dim, blocks = j->b->seg_blocks[s];
    const int nd = (d + VL - 1) / VL, full = d / VL;
    const void *vb = j->b->seg_v[s];
    float buf[512];
    vf acc[512 / VL];
    for (int c = 0; c < nd; c++) acc[c] = vzero();
    for (int t = 0; t < n; t++) {
        const float *v = kv_row(m, vb, kv_offset(m, j->layer, blocks, g, t), buf);
        const vf e = vset1(w[t]);
        for (int c = 0; c < full; c++) acc[c] = vfma(e, vload(v + c * VL), acc[c]);
        if (full < nd) acc[full] = vfma(e, vload_n(v + full * VL, d - full * VL), acc[full]);
    }
    const vf vt = vset1(total);
    for (int c = 0; c < full; c++) vstore(out + c * VL, vdiv(acc[c], vt));
    if (full < nd) vstore_n(out + full * VL, vdiv(acc[full], vt), d - full * VL);
}

/* One task: query vectors [q0, q0 + count) of KV head g in segment s (vector i is row
 * lo + i / G, query head g * G + i % G). Every query's softmax(q . k_t * scale) . v_t over
 * t in [0, its position], each sum in ascending t from 0, whatever the task holds. */
static void att_task(void *ctx, int task, int slot) {
    const att_job *j = ctx;
    const model_t *m = j->m;
    const batch_t *b = j->b;
    const int32_t *tk = j->tasks + 4 * task;
    const int s = tk[0], g = tk[1], q0 = tk[2], count = tk[3];
    const int d = m->head_dim, G = m->n_heads / m->n_kv_heads;
    float qbuf[QC_MAX][512];
    float *w[QC_MAX] = {0}, *out[QC_MAX] = {0};
    int n[QC_MAX] = {0};
    float total[QC_MAX];
    for (int i = 0; i < count; i++) {
        const int qi = q0 + i, r = b->seg_lo[s] + qi / G, head = g * G + qi % G;
        n[i] = b->seg_start[s] + (r - b->seg_lo[s]) + 1;
        const float *qs = j->qkv + (size_t)r * j->ldqkv + (size_t)head * d;
        for (int e = 0; e < d; e++) qbuf[i][e] = qs[e] * j->scale;
        w[i] = j->scores[slot] + (size_t)i * j->score_len;
        out[i] = j->att + (size_t)r * j->ldatt + (size_t)head * d;
    }
    scores_of(j, s, g, qbuf, n, w, count);
    for (int i = 0; i < count; i++) total[i] = softmax_of(w[i], n[i]);
    if (d % VL == 0 && d / VL <= 8) {
        const int kvt = m->kv_type;
        for (int i = 0; i < count; i += 4) {
            const int qn = count - i < 4 ? count - i : 4;
#define VALUES_T(QN, ND)                                                                     \
    if (kvt == T_F16) values_of(j, s, g, w + i, n + i, total + i, out + i, QN, ND, T_F16);   \
    else if (kvt == T_BF16) values_of(j, s, g, w + i, n + i, total + i, out + i, QN, ND, T_BF16); \
    else values_of(j, s, g, w + i, n + i, total + i, out + i, QN, ND, T_F32);
#define VALUES(ND)                                                                           \
    switch (qn) {                                                                            \
    case 1: VALUES_T(1, ND) break;                                                           \
    case 2: VALUES_T(2, ND) break;                                                           \
    case 3: VALUES_T(3, ND) break;                                                           \
    default: VALUES_T(4, ND) break;                                                          \
    }
            switch (d / VL) {
            case 1: VALUES(1) break;
            case 2: VALUES(2) break;
            case 4: VALUES(4) break;
            case 8: VALUES(8) break;
            default:
                for (int e = i; e < i + qn; e++) values_generic(j, s, g, w[e], n[e], total[e], out[e]);
            }
#undef VALUES
#undef VALUES_T
        }
    } else {
        for (int i = 0; i < count; i++) values_generic(j, s, g, w[i], n[i], total[i], out[i]);
    }
}

/* ------------------------------------------------------------------------------------ */
/* The forward. */

typedef struct {
    handle_t *h;
    const batch_t *b;
    const int32_t *row_seg;
    int layer;
    float *qkv;
    int ldqkv;
} rope_job;

/* RoPE on a row's query and key heads, then its key and value heads into the cache. */
static void rope_row(void *ctx, int r, int slot) {
    (void)slot;
    const rope_job *j = ctx;
    const model_t *m = &j->h->m;
    const batch_t *b = j->b;
    const int d = m->head_dim, H = m->n_heads, KV = m->n_kv_heads;
    const int s = j->row_seg[r];
    const int pos = b->seg_start[s] + (r - b->seg_lo[s]);
    float *row = j->qkv + (size_t)r * j->ldqkv;
    const float *cs = b->cos + (size_t)pos * d, *sn = b->sin + (size_t)pos * d;
    for (int hh = 0; hh < H + KV; hh++) rope_head(row + (size_t)hh * d, cs, sn, d);
    for (int g = 0; g < KV; g++) {
        size_t off = kv_offset(m, j->layer, b->seg_blocks[s], g, pos);
        kv_store(m, b->seg_k[s], off, row + (size_t)(H + g) * d);
        kv_store(m, b->seg_v[s], off, row + (size_t)(H + KV + g) * d);
    }
}

/* Seconds spent per phase of the forward since the last reset (`specd_profile`), summed
 * over calls: norms, qkv, rope, attention, o, gate_up, silu, down, head, other. */
enum { P_NORM, P_QKV, P_ROPE, P_ATT, P_O, P_GU, P_SILU, P_DOWN, P_HEAD, P_OTHER, P_N };
static double g_prof[P_N];
static int g_prof_on;
static long g_prof_t;

static inline void prof(int phase) {
    if (!g_prof_on) return;
    long t = now_ns();
    g_prof[phase] += (t - g_prof_t) * 1e-9;
    g_prof_t = t;
}

/* Error codes (see target_worker/native.py). */
enum { E_OK = 0, E_ARGS = 1, E_MEMORY = 2, E_ROPE = 3 };

int specd_forward(void *hp, const batch_t *b) {
    handle_t *h = hp;
    const model_t *m = &h->m;
    const int n = b->n_rows, H = m->n_heads, d = m->head_dim, KV = m->n_kv_heads;
    if (n <= 0 || b->n_segs <= 0 || d > 512 || d % 2 || m->key_block < VL ||
        (m->key_block & (m->key_block - 1)))
        return E_ARGS;
    int threads = b->threads < 1 ? 1 : b->threads > MAX_THREADS ? MAX_THREADS : b->threads;
    int max_pos = 0;
    int32_t *row_seg = malloc(sizeof(int32_t) * (size_t)n);
    if (!row_seg) return E_MEMORY;
    for (int s = 0; s < b->n_segs; s++) {
        for (int r = b->seg_lo[s]; r < b->seg_hi[s]; r++) row_seg[r] = s;
        int last = b->seg_start[s] + b->seg_hi[s] - b->seg_lo[s] - 1;
        if (last > max_pos) max_pos = last;
    }
    if (max_pos >= b->rope_len) { free(row_seg); return E_ROPE; }
    /* Attention tasks: (segment, KV head, first query vector, count), a few query vectors
     * each, so keys are read once for several and the threads get enough tasks. */
    const int G = H / KV;
    int n_tasks = 0;
    for (int s = 0; s < b->n_segs; s++) {
        const int nq = (b->seg_hi[s] - b->seg_lo[s]) * G;
        const int qc = nq >= 32 ? 8 : nq >= 8 ? 4 : 1;
        n_tasks += KV * ((nq + qc - 1) / qc);
    }
    int32_t *tasks = malloc(sizeof(int32_t) * 4 * (size_t)n_tasks);
    if (!tasks) { free(row_seg); return E_MEMORY; }
    n_tasks = 0;
    for (int s = 0; s < b->n_segs; s++) {
        const int nq = (b->seg_hi[s] - b->seg_lo[s]) * G;
        const int qc = nq >= 32 ? 8 : nq >= 8 ? 4 : 1;
        for (int g = 0; g < KV; g++)
            for (int q0 = 0; q0 < nq; q0 += qc) {
                int32_t *t = tasks + 4 * n_tasks++;
                t[0] = s; t[1] = g; t[2] = q0; t[3] = nq - q0 < qc ? nq - q0 : qc;
            }
    }
    pthread_mutex_lock(&g_pool_lock);
    threads = pool_threads(threads);
    if (work_reserve(h, n, max_pos) != 0) {
        pthread_mutex_unlock(&g_pool_lock);
        free(row_seg);
        free(tasks);
        return E_MEMORY;
    }
#if defined(__SSE__)
    const unsigned int mxcsr = _mm_getcsr();
    set_fp_mode();
#endif
    work_t *w = &h->w;
    const strides_t S = strides_of(m);
    if (g_prof_on) g_prof_t = now_ns();
    const int hid = m->hidden;
    /* Embeddings. */
    for (int r = 0; r < n; r++) {
        float *dst = w->x + (size_t)r * S.x;
        dequant_row(m->embed.type, m->embed.data + (size_t)b->tokens[r] * m->embed.row_bytes, hid, dst);
    }
    const int n_cap = b->n_capture;
    const int ldh = (n_cap ? n_cap : 1) * hid;
    int cap = 0;
    for (int l = 0; l < m->n_layers; l++) {
        const layer_t *L = &m->layers[l];
        if (cap < n_cap && b->capture[cap] == l) {
            for (int r = 0; r < n; r++)
                memcpy(b->hidden + (size_t)r * ldh + (size_t)cap * hid, w->x + (size_t)r * S.x, (size_t)hid * 4);
            cap++;
        }
        prof(P_OTHER);
        rmsnorm_rows(w->x, S.x, L->attn_norm, hid, m->eps, w->xn, S.x, n, threads);
        prof(P_NORM);
        matmul(h, L->qkv, L->n_qkv, w->xn, n, S.x, w->qkv, S.qkv, L->qkv_bias, 0, threads);
        prof(P_QKV);
        rope_job rj = {h, b, row_seg, l, w->qkv, S.qkv};
        parallel(rope_row, &rj, n, n >= 16 ? threads : 1);
        prof(P_ROPE);
        att_job aj = {m, b, l, w->qkv, S.qkv, w->att, S.att, w->scores, w->score_len,
                      1.0f / sqrtf((float)d), tasks};
        parallel(att_task, &aj, n_tasks, threads);
        prof(P_ATT);
        matmul(h, &L->o, 1, w->att, n, S.att, w->x, S.x, NULL, 1, threads);
        prof(P_O);
        rmsnorm_rows(w->x, S.x, L->ffn_norm, hid, m->eps, w->xn, S.x, n, threads);
        prof(P_NORM);
        matmul(h, L->gate_up, L->n_gate_up, w->xn, n, S.x, w->gu, S.gu, NULL, 0, threads);
        prof(P_GU);
        silu_job sj = {w->gu, S.gu, m->ffn, w->hb, S.hb, n, 8};
        parallel(silu_chunk, &sj, (n + 7) / 8, n >= 16 ? threads : 1);
        prof(P_SILU);
        matmul(h, &L->down, 1, w->hb, n, S.hb, w->x, S.x, NULL, 1, threads);
        prof(P_DOWN);
    }
    if (cap < n_cap && b->capture[cap] == m->n_layers) {
        for (int r = 0; r < n; r++)
            memcpy(b->hidden + (size_t)r * ldh + (size_t)cap * hid, w->x + (size_t)r * S.x, (size_t)hid * 4);
        cap++;
    }
    rmsnorm_rows(w->x, S.x, m->norm, hid, m->eps, w->fin, S.x, n, threads);
    if (!n_cap)
        for (int r = 0; r < n; r++)
            memcpy(b->hidden + (size_t)r * hid, w->fin + (size_t)r * S.x, (size_t)hid * 4);
    if (b->n_logit_rows > 0) {
        /* Gather the rows whose logits are asked for (xn is free now). */
        for (int i = 0; i < b->n_logit_rows; i++)
            memcpy(w->xn + (size_t)i * S.x, w->fin + (size_t)b->logit_rows[i] * S.x, (size_t)S.x * 4);
        prof(P_OTHER);
        matmul(h, &m->head, 1, w->xn, b->n_logit_rows, S.x, b->logits, m->vocab, NULL, 0, threads);
        prof(P_HEAD);
    }
    prof(P_OTHER);
#if defined(__SSE__)
    _mm_setcsr(mxcsr);
#endif
    pthread_mutex_unlock(&g_pool_lock);
    free(row_seg);
    free(tasks);
    return E_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Entry points for tests and the start-up check. */

int specd_abi(void) { return SPECD_ABI; }

const char *specd_isa(void) { return ISA; }

int specd_vector_lanes(void) { return VL; }

/* y [n, w->n] = x [n, ldx] . w^T, through the same kernels as the forward (x rows padded
 * with zeros to round_up(k, VL) by the caller); a packed w (T_PACKED + type, from
 * specd_repack) goes through the int8 kernels. */
int specd_matmul(const wmat *w, const float *x, int n, int ldx, float *y, int threads) {
    handle_t h;
    memset(&h, 0, sizeof h);
    h.m.hidden = w->k;
    h.m.n_heads = 1;
    h.m.head_dim = 2;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    pthread_mutex_lock(&g_pool_lock);
    threads = pool_threads(threads);
    if (work_reserve(&h, n, 0) != 0) {
        work_free(&h.w);
        pthread_mutex_unlock(&g_pool_lock);
        return E_MEMORY;
    }
#if defined(__SSE__)
    const unsigned int mxcsr = _mm_getcsr();
    set_fp_mode();
#endif
    matmul(&h, w, 1, x, n, ldx, y, w->n, NULL, 0, threads);
#if defined(__SSE__)
    _mm_setcsr(mxcsr);
#endif
    work_free(&h.w);
    pthread_mutex_unlock(&g_pool_lock);
    return E_OK;
}

/* One row of a weight, dequantized (out: round_up(k, VL) floats). */
void specd_dequant_row(const wmat *w, int row, float *out) {
    dequant_row(w->type, w->data + (size_t)row * w->row_bytes, w->k, out);
}

/* exp of n floats by the forward's vector exp (tests). */
void specd_exp(const float *x, float *y, int n) {
    int i = 0;
    for (; i + VL <= n; i += VL) vstore(y + i, vexp(vload(x + i)));
    if (i < n) vstore_n(y + i, vexp(vload_n(x + i, n - i)), n - i);
}

/* How long (ns) an idle worker spins before it sleeps. */
void specd_set_spin_ns(long ns) { g_pool.spin_ns = ns > 0 ? ns : 1; }

void specd_shutdown(void) {
    pthread_mutex_lock(&g_pool_lock);
    if (g_pool.pid == getpid()) pool_stop();
    pthread_mutex_unlock(&g_pool_lock);
}

/* Turns the per-phase timers on (1) or off (0) and copies the seconds summed so far into
 * out[P_N] (when not NULL), then resets them. */
int specd_profile(int on, double *out) {
    if (out) memcpy(out, g_prof, sizeof g_prof);
    memset(g_prof, 0, sizeof g_prof);
    g_prof_on = on;
    return P_N;
}

/* Sets tuning knob `key` to `value` (a choice between kernels of identical results, for
 * benchmarks); returns its previous value, or -1 for an unknown key. */
int specd_tune(int key, int value) {
    if (key < 0 || key >= TUNE_N) return -1;
    int old = g_tune[key];
    g_tune[key] = value;
    return old;
}
