// The packed-weight GEMM by integer dot products: out [M, N] = x [M, K] @ w [K, N], w kept packed.
//
// Read `int8_dot.py` first: it states the arithmetic this file implements, and its `reference`
// computes the same bits with plain PyTorch ops. In short, for every output (m, n):
//
//   1. each block of 32 activations x[m, 32b : 32b + 32] becomes int8 codes xq and one float dx
//      (dx = amax / 127, xq = round-half-even(x * (127 / amax))) and s = sum xq, as llama.cpp does;
//   2. the block's dot product with the weight's codes is an exact int32, isum[b];
//   3. the float part, one chain over the blocks in order, whatever M, threads or instructions:
//          t = float(isum[b]) * (d_w[b] * dx[b])          (+ m_w[b] * (dx[b] * s[b]) with minimums)
//          acc = acc + t                                    b = 0, 1, 2, ...;  out = acc
//
// Step 2 is exact, so it may be computed any way at all (AVX-512 VNNI, AVX2, plain C, any tiling):
// that is where the speed is. Step 3 is the same IEEE operations in every path, compiled with
// -ffp-contract=off so that no multiply and add are fused in one path and not in another.
//
// The weight is read in its "rows8" form (quant/rows8.py): rows in octets of 8, and for every
// octet and block one chunk [codes | 8 scales | 8 minimums], the codes interleaved by 4 bytes:
//   4-bit kinds: 128 bytes, [t = 0..3][row j = 0..7][4 bytes: the block's bytes 4t..4t+3]
//                (low nibbles: values 4t..4t+3, high nibbles: values 16+4t..16+4t+3)
//   8-bit kinds: 256 bytes, [t = 0..7][row j][4 bytes: values 4t..4t+3]
// so one 32-byte load gives 4 codes of each of 8 rows, and `vpdpbusd` against the activation's
// 4 codes broadcast to every lane adds to 8 outputs at once: no horizontal sums anywhere.
//
// Kinds (quant/packed_weight.py): q4_0 w = d (q - 8); q4_1 w = d q + m (float16 d, m); q4_k the
// same with float32 d, m; q8_0 w = d q (q int8, float16 d); q5_k w = d q + m (q 0..31, float32).
//
// Threads: OpenMP (PyTorch's own runtime), each thread a contiguous range of octets, so every
// output is computed by one thread from start to end.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define SW_SIMD 1
#else
#define SW_SIMD 0
#endif
#if SW_SIMD && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define SW_VNNI 1
#else
#define SW_VNNI 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int QK = 32;  // values per block
constexpr int ROWS = 8;  // weight rows per octet

enum Kind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q5_K = 4 };

constexpr bool four_bit(int kind) { return kind == Q4_0 || kind == Q4_1 || kind == Q4_K; }
constexpr bool has_mins(int kind) { return kind == Q4_1 || kind == Q4_K || kind == Q5_K; }
constexpr bool half_scales(int kind) { return kind == Q4_0 || kind == Q4_1 || kind == Q8_0; }
constexpr int code_bytes(int kind) { return four_bit(kind) ? 128 : 256; }  // per octet and block
constexpr int scale_bytes(int kind) { return half_scales(kind) ? 16 : 32; }  // 8 scales
constexpr int chunk_bytes(int kind) {
    return code_bytes(kind) + scale_bytes(kind) * (has_mins(kind) ? 2 : 1);
}

// float16 -> float32, exact (the plain-C path; the SIMD path uses F16C, also exact)
float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            bits = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp - 15 + 127) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// ---- step 1: the quantized activations of M rows ----

struct Act {
    const int8_t *q;  // [M, K] codes, block b at 32 b
    const float *d;   // [M, K/32] dx
    const int32_t *s; // [M, K/32] sum of the block's codes
    const float *sd;  // [M, K/32] dx * s (the minimum term's factor)
    int64_t k;        // K
    int blocks;       // K / 32
};

void quantize_row(const float *x, int blocks, int8_t *q, float *d, int32_t *s, float *sd) {
    for (int b = 0; b < blocks; b++) {
        const float *xb = x + (size_t)b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float dx = amax / 127.0f;
        float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK; j++) {
            int8_t v = (int8_t)nearbyintf(xb[j] * id);  // half to even: the default rounding mode
            q[(size_t)b * QK + j] = v;
            sum += v;
        }
        d[b] = dx;
        s[b] = sum;
        sd[b] = dx * (float)sum;
    }
}

// ---- the weight's rows8 form ----

struct Form {
    const uint8_t *base;  // [octets, blocks, chunk bytes]
    int64_t octets;       // ceil(N / 8)
    int blocks;           // K / 32
};

template <int KIND>
inline const uint8_t *chunk(const Form &f, int64_t octet, int b) {
    return f.base + ((size_t)octet * f.blocks + b) * chunk_bytes(KIND);
}

template <int KIND>
inline float scale_at(const uint8_t *c, int j, bool mins) {
    const uint8_t *p = c + code_bytes(KIND) + (mins ? scale_bytes(KIND) : 0);
    if (half_scales(KIND)) return half_to_float(((const uint16_t *)p)[j]);
    return ((const float *)p)[j];
}

// ---- steps 2 and 3 for a tile of MR activation rows x NO octets (8 NO weight rows) ----

#if SW_SIMD
template <int KIND>
inline __m256 scales8(const uint8_t *c, bool mins) {
    const uint8_t *p = c + code_bytes(KIND) + (mins ? scale_bytes(KIND) : 0);
    if (half_scales(KIND)) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_loadu_ps((const float *)p);
}

// 8 int32 lanes += sums of 4 products u8 x s8. VNNI: one instruction. AVX2: pairs to int16 and
// then to int32, exact while |u s + u s| < 32768 (codes up to 31 here, and |s| <= 127).
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

template <int KIND, int MR, int NO>
void tile(const Act &a, int64_t m0, const Form &f, int64_t o0, float *out, int64_t ldo, int64_t n) {
    constexpr bool MINS = has_mins(KIND);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[MR][NO];
    for (int i = 0; i < MR; i++)
        for (int o = 0; o < NO; o++) acc[i][o] = _mm256_setzero_ps();
    for (int b = 0; b < f.blocks; b++) {
        const uint8_t *c[NO];
        for (int o = 0; o < NO; o++) c[o] = chunk<KIND>(f, o0 + o, b);
        // the integer sums start at the codes' offset: q4_0's -8 s; q8_0 (VNNI): -128 s, since
        // its signed codes are read as unsigned q + 128 (AVX2 takes signs instead, below)
        __m256i is[MR][NO], is2[MR][NO];  // two chains, added at the end
        for (int i = 0; i < MR; i++) {
            int32_t s = a.s[(m0 + i) * a.blocks + b];
            int32_t start = KIND == Q4_0 ? -8 * s : (KIND == Q8_0 && SW_VNNI) ? -128 * s : 0;
            for (int o = 0; o < NO; o++) {
                is[i][o] = _mm256_set1_epi32(start);
                is2[i][o] = _mm256_setzero_si256();
            }
        }
        const int32_t *x32[MR];
        for (int i = 0; i < MR; i++) x32[i] = (const int32_t *)(a.q + (m0 + i) * a.k + (int64_t)b * QK);
        if (four_bit(KIND)) {
            // AVX2 (no VNNI): a block's pair sums added in int16 (exact: 8 pairs of at most
            // |15 * 127 * 2|, 30480 < 32768), then widened once; no int32 chain through the block
            __m256i h16[MR][NO];
            for (int t = 0; t < 4; t++) {
                __m256i lo[NO], hi[NO];
                for (int o = 0; o < NO; o++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(c[o] + 32 * t));
                    lo[o] = _mm256_and_si256(v, low4);
                    hi[o] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                }
                for (int i = 0; i < MR; i++) {
                    __m256i xl = _mm256_set1_epi32(x32[i][t]), xh = _mm256_set1_epi32(x32[i][4 + t]);
                    for (int o = 0; o < NO; o++) {
#if SW_VNNI
                        is[i][o] = dot_add(is[i][o], lo[o], xl);
                        is2[i][o] = dot_add(is2[i][o], hi[o], xh);
#else
                        __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo[o], xl),
                                                        _mm256_maddubs_epi16(hi[o], xh));
                        h16[i][o] = t ? _mm256_add_epi16(h16[i][o], pair) : pair;
#endif
                    }
                }
            }
            if (!SW_VNNI)
                for (int i = 0; i < MR; i++)
                    for (int o = 0; o < NO; o++)
                        is[i][o] = _mm256_add_epi32(is[i][o], _mm256_madd_epi16(h16[i][o], _mm256_set1_epi16(1)));
            (void)h16;
        } else {
            for (int t = 0; t < 8; t++) {
                __m256i v[NO], u[NO];
                for (int o = 0; o < NO; o++) {
                    v[o] = _mm256_loadu_si256((const __m256i *)(c[o] + 32 * t));
                    if (KIND == Q8_0)
                        u[o] = SW_VNNI ? _mm256_xor_si256(v[o], _mm256_set1_epi8((char)0x80))  // q + 128
                                       : _mm256_sign_epi8(v[o], v[o]);                        // |q|
                    else
                        u[o] = v[o];  // q5_k: 0..31 already
                }
                for (int i = 0; i < MR; i++) {
                    __m256i x = _mm256_set1_epi32(x32[i][t]);
                    for (int o = 0; o < NO; o++) {
                        __m256i xs = (KIND == Q8_0 && !SW_VNNI) ? _mm256_sign_epi8(x, v[o]) : x;
                        if (t % 2)
                            is2[i][o] = dot_add(is2[i][o], u[o], xs);
                        else
                            is[i][o] = dot_add(is[i][o], u[o], xs);
                    }
                }
            }
        }
        for (int i = 0; i < MR; i++)
            for (int o = 0; o < NO; o++) is[i][o] = _mm256_add_epi32(is[i][o], is2[i][o]);
        // step 3: one chain per output, block after block
        __m256 dw[NO], mw[NO];
        for (int o = 0; o < NO; o++) {
            dw[o] = scales8<KIND>(c[o], false);
            mw[o] = MINS ? scales8<KIND>(c[o], true) : _mm256_setzero_ps();
        }
        for (int i = 0; i < MR; i++) {
            __m256 dx = _mm256_set1_ps(a.d[(m0 + i) * a.blocks + b]);
            __m256 sd = _mm256_set1_ps(a.sd[(m0 + i) * a.blocks + b]);
            for (int o = 0; o < NO; o++) {
                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(is[i][o]), _mm256_mul_ps(dw[o], dx));
                if (MINS) t = _mm256_add_ps(t, _mm256_mul_ps(mw[o], sd));
                acc[i][o] = _mm256_add_ps(acc[i][o], t);
            }
        }
    }
    for (int i = 0; i < MR; i++) {
        for (int o = 0; o < NO; o++) {
            int64_t col = (o0 + o) * ROWS;
            float *dst = out + (m0 + i) * ldo + col;
            if (col + ROWS <= n) {
                _mm256_storeu_ps(dst, acc[i][o]);
            } else {  // the last octet of an N that is not a multiple of 8
                alignas(32) float tmp[ROWS];
                _mm256_store_ps(tmp, acc[i][o]);
                for (int j = 0; col + j < n; j++) dst[j] = tmp[j];
            }
        }
    }
}
#else
template <int KIND, int MR, int NO>
void tile(const Act &a, int64_t m0, const Form &f, int64_t o0, float *out, int64_t ldo, int64_t n) {
    constexpr bool MINS = has_mins(KIND);
    for (int i = 0; i < MR; i++) {
        const int8_t *xq = a.q + (m0 + i) * a.k;
        for (int o = 0; o < NO; o++) {
            for (int j = 0; j < ROWS && (o0 + o) * ROWS + j < n; j++) {
                float acc = 0.0f;
                for (int b = 0; b < f.blocks; b++) {
                    const uint8_t *c = chunk<KIND>(f, o0 + o, b);
                    int32_t isum = 0;
                    for (int v = 0; v < QK; v++) {
                        int32_t q;
                        if (four_bit(KIND)) {
                            int byte = v % 16;  // value v sits in byte v % 16: low nibble below 16
                            uint8_t at = c[(byte / 4) * 32 + j * 4 + byte % 4];
                            q = v < 16 ? at & 15 : at >> 4;
                        } else {
                            uint8_t at = c[(v / 4) * 32 + j * 4 + v % 4];
                            q = KIND == Q8_0 ? (int32_t)(int8_t)at : (int32_t)at;
                        }
                        isum += q * xq[b * QK + v];
                    }
                    int64_t at = (m0 + i) * a.blocks + b;
                    if (KIND == Q4_0) isum -= 8 * a.s[at];
                    float t = (float)isum * (scale_at<KIND>(c, j, false) * a.d[at]);
                    if (MINS) t = t + scale_at<KIND>(c, j, true) * a.sd[at];
                    acc = acc + t;
                }
                out[(m0 + i) * ldo + (o0 + o) * ROWS + j] = acc;
            }
        }
    }
}
#endif

template <int KIND, int MR>
void octet_tiles(const Act &a, int64_t m0, const Form &f, int64_t o_begin, int64_t o_end, float *out,
                 int64_t n) {
    int64_t o = o_begin;
    if (MR == 1)  // decode: 32 weight rows per activation load
        for (; o + 4 <= o_end; o += 4) tile<KIND, MR, 4>(a, m0, f, o, out, n, n);
    for (; o + 2 <= o_end; o += 2) tile<KIND, MR, 2>(a, m0, f, o, out, n, n);
    if (o < o_end) tile<KIND, MR, 1>(a, m0, f, o, out, n, n);
}

template <int KIND>
void gemm_kind(const Act &a, int64_t m, const Form &f, int64_t n, float *out, int threads) {
    // every thread a contiguous range of octets, all M rows over it, in blocks of rows whose codes
    // stay in the core's cache while the range's weights stream by (8 octets at a time)
    int64_t per = (f.octets + threads - 1) / threads;
    per = (per + 1) / 2 * 2;
    int64_t rows_per_block = a.k > 0 ? (256 * 1024) / a.k : 64;
    rows_per_block = rows_per_block < 4 ? 4 : rows_per_block / 4 * 4;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        int th = omp_get_thread_num();
#else
        int th = 0;
#endif
        int64_t o_begin = th * per, o_end = o_begin + per < f.octets ? o_begin + per : f.octets;
        for (int64_t r0 = 0; r0 < m && o_begin < o_end; r0 += rows_per_block) {
            int64_t r1 = r0 + rows_per_block < m ? r0 + rows_per_block : m;
            for (int64_t c0 = o_begin; c0 < o_end; c0 += 8) {
                int64_t c1 = c0 + 8 < o_end ? c0 + 8 : o_end;
                int64_t r = r0;
                for (; r + 4 <= r1; r += 4) octet_tiles<KIND, 4>(a, r, f, c0, c1, out, n);
                switch (r1 - r) {
                    case 3: octet_tiles<KIND, 3>(a, r, f, c0, c1, out, n); break;
                    case 2: octet_tiles<KIND, 2>(a, r, f, c0, c1, out, n); break;
                    case 1: octet_tiles<KIND, 1>(a, r, f, c0, c1, out, n); break;
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// The instruction set this build's integer sums use (the float part is the same for all).
const char *sw_int8_dot_isa(void) {
#if SW_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif SW_SIMD && defined(__AVXVNNI__)
    return "avx-vnni";
#elif SW_SIMD
    return "avx2";
#else
    return "plain C";
#endif
}

// Bytes of one (octet, block) chunk of the rows8 form for `kind`, or -1 (quant/rows8.py checks it).
int sw_rows8_chunk_bytes(int kind) {
    switch (kind) {
        case Q4_0: return chunk_bytes(Q4_0);
        case Q4_1: return chunk_bytes(Q4_1);
        case Q8_0: return chunk_bytes(Q8_0);
        case Q4_K: return chunk_bytes(Q4_K);
        case Q5_K: return chunk_bytes(Q5_K);
    }
    return -1;
}

// x [M, K] float32 row-major; form: the weight [K, N] in rows8 form [ceil(N/8), K/32, chunk];
// out [M, N] float32. Returns 0, or -1 on a bad argument, -2 when out of memory.
int sw_int8_gemm(int kind, int64_t m, int64_t n, int64_t k, const float *x, const uint8_t *form,
                 float *out, int threads) {
    if (m <= 0 || n <= 0) return 0;
    if (k <= 0 || k % QK || threads <= 0 || kind < Q4_0 || kind > Q5_K) return -1;
    int blocks = (int)(k / QK);
    size_t lanes = (size_t)m * blocks;
    char *buf = (char *)malloc((size_t)m * k + lanes * 12 + 64);
    if (!buf) return -2;
    int8_t *q = (int8_t *)buf;
    float *d = (float *)(buf + (((size_t)m * k + 15) / 16) * 16);
    int32_t *s = (int32_t *)(d + lanes);
    float *sd = (float *)(s + lanes);
    int qthreads = m >= 16 ? threads : 1;
#pragma omp parallel for num_threads(qthreads) schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * k, blocks, q + r * k, d + r * blocks, s + r * blocks, sd + r * blocks);
    Act a{q, d, s, sd, k, blocks};
    Form f{form, (n + ROWS - 1) / ROWS, blocks};
    int nt = threads;
    if (f.octets < 8 * (int64_t)nt) nt = (int)((f.octets + 7) / 8);  // too few rows to share
    switch (kind) {
        case Q4_0: gemm_kind<Q4_0>(a, m, f, n, out, nt); break;
        case Q4_1: gemm_kind<Q4_1>(a, m, f, n, out, nt); break;
        case Q8_0: gemm_kind<Q8_0>(a, m, f, n, out, nt); break;
        case Q4_K: gemm_kind<Q4_K>(a, m, f, n, out, nt); break;
        case Q5_K: gemm_kind<Q5_K>(a, m, f, n, out, nt); break;
    }
    free(buf);
    return 0;
}

// Read `bytes` bytes from `buf` with `threads` threads, each streaming its contiguous share with
// 32-byte loads (how a decode step reads packed weights); returns a checksum, so that nothing is
// optimised away. Time it from the caller.
uint64_t sw_stream_read(const uint8_t *buf, int64_t bytes, int threads) {
    uint64_t total = 0;
    int64_t per = (bytes / threads) / 64 * 64;
#pragma omp parallel num_threads(threads) reduction(^ : total)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num();
#else
        int t = 0;
#endif
        const uint8_t *p = buf + t * per;
        int64_t len = t == threads - 1 ? bytes - t * per : per;
        uint64_t acc = 0;
        int64_t i = 0;
#if SW_SIMD
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        for (; i + 64 <= len; i += 64) {
            a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
            a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        }
        alignas(32) uint64_t lanes[4];
        _mm256_store_si256((__m256i *)lanes, _mm256_xor_si256(a0, a1));
        acc = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#endif
        for (; i < len; i++) acc ^= p[i];
        total ^= acc;
    }
    return total;
}

}  // extern "C"
