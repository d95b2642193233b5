// Attention over the paged KV cache, every query row in one loop: decode, prefill, chunk, verify.
//
// Read `attention.py` first: it states the arithmetic this file implements, and its `reference`
// computes the same bits with plain PyTorch ops. For every query row (a query position i of
// sequence b, a query head h; its KV head g = h / G) that sees the keys j < limit:
//
//   1. s_j = dot(q, k_j) * scale        the dot as 8 lanes, lane l = sum over c = l, l+8, ... of
//                                       q_c k_c (fused multiply-adds, c in order), then the
//                                       lanes added as ((0+4)+(2+6))+((1+5)+(3+7))
//   2. m = max_j s_j                    (exact in any order)
//   3. p_j = exp(s_j - m)               by `exp8` below (a polynomial, 8 at a time)
//      den = the 8 lanes' tree of lane l = sum of p_j over j = l, l+8, ... in order
//      for j = 0, 1, 2, ...:  num[:] = fma(p_j, v_j[:], num[:])
//   4. out = num / den
//
// Every row runs that loop, whoever shares the call: a decode row alone, beside 31 others, as row
// 300 of a prefill chunk or as one of k + 1 verified rows. So a row's bits never depend on the
// batch (DESIGN.md, "Batch invariance"), with no padding of rows or keys at all. The speed comes
// from what changes no order: a tile of query rows that share a KV head reads each key and value
// once for all of them, and the tiles run on OpenMP's threads, each tile on one thread.
//
// The keys are read where they lie in the cache, through the block table: no copy of K/V is made.
// The multiply-adds are fused (one rounding): with FMA instructions where the CPU has them, else
// `fmaf`, which gives the same bits in software.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SW_ATT_FMA 1
#else
#define SW_ATT_FMA 0
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int LANES = 8;
constexpr int TILE_ROWS = 16;  // query rows per tile (positions x the G heads of one KV head)

// Eight float lanes: AVX registers where the CPU has AVX2 and FMA, else an array and `fmaf`
// (the same roundings, so the same bits).
#if SW_ATT_FMA
using V8 = __m256;
inline V8 zero8() { return _mm256_setzero_ps(); }
inline V8 load8(const float *a) { return _mm256_loadu_ps(a); }
inline void store8(float *a, V8 x) { _mm256_storeu_ps(a, x); }
inline V8 splat8(float x) { return _mm256_set1_ps(x); }
inline V8 fma8(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline V8 add8(V8 a, V8 b) { return _mm256_add_ps(a, b); }
inline V8 mul8(V8 a, V8 b) { return _mm256_mul_ps(a, b); }
inline V8 max8(V8 a, V8 b) { return _mm256_max_ps(a, b); }
inline V8 min8(V8 a, V8 b) { return _mm256_min_ps(a, b); }
inline V8 round8(V8 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for integral n in [-126, 127]: the exponent field built directly
inline V8 pow2_8(V8 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
// lanes l < count kept, the others 0
inline V8 first8(V8 a, int count) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane)));
}
// lanes l < count kept, the others `fill`
inline V8 keep8(V8 a, int count, float fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), a, keep);
}
// [lanes_sum(a[0]), ..., lanes_sum(a[7])] with the registers transposed: the same tree per key,
// ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)), for eight keys at once
inline V8 sums8(const V8 *a) {
    __m256 h[4];  // h[k]: key k in the low half, key k + 4 in the high: lanes 0+4, 1+5, 2+6, 3+7
    for (int k = 0; k < 4; ++k)
        h[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[k], a[k + 4], 0x20),
                             _mm256_permute2f128_ps(a[k], a[k + 4], 0x31));
    // [(0+4)+(2+6) of keys k, k+1; (1+5)+(3+7) of keys k, k+1], per half
    __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(h[0], h[1]), _mm256_unpackhi_ps(h[0], h[1]));
    __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(h[2], h[3]), _mm256_unpackhi_ps(h[2], h[3]));
    __m256 first = _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0));   // keys 0-3 | 4-7
    __m256 second = _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2));
    return _mm256_add_ps(first, second);
}
#else
struct V8 {
    float l[LANES];
};
inline V8 zero8() { return V8{}; }
inline V8 load8(const float *a) {
    V8 x;
    memcpy(x.l, a, sizeof(x.l));
    return x;
}
inline void store8(float *a, V8 x) { memcpy(a, x.l, sizeof(x.l)); }
inline V8 splat8(float x) {
    V8 v;
    for (int l = 0; l < LANES; ++l) v.l[l] = x;
    return v;
}
inline V8 fma8(V8 a, V8 b, V8 c) {
    for (int l = 0; l < LANES; ++l) c.l[l] = fmaf(a.l[l], b.l[l], c.l[l]);
    return c;
}
inline V8 add8(V8 a, V8 b) {
    for (int l = 0; l < LANES; ++l) a.l[l] = a.l[l] + b.l[l];
    return a;
}
inline V8 mul8(V8 a, V8 b) {
    for (int l = 0; l < LANES; ++l) a.l[l] = a.l[l] * b.l[l];
    return a;
}
inline V8 max8(V8 a, V8 b) {  // as vmaxps: b where either is NaN or both are equal
    for (int l = 0; l < LANES; ++l) a.l[l] = a.l[l] > b.l[l] ? a.l[l] : b.l[l];
    return a;
}
inline V8 min8(V8 a, V8 b) {  // as vminps: b where either is NaN or both are equal
    for (int l = 0; l < LANES; ++l) a.l[l] = a.l[l] < b.l[l] ? a.l[l] : b.l[l];
    return a;
}
inline V8 round8(V8 a) {  // to nearest, ties to even (the default rounding mode)
    for (int l = 0; l < LANES; ++l) a.l[l] = nearbyintf(a.l[l]);
    return a;
}
inline V8 pow2_8(V8 n) {
    V8 r;
    for (int l = 0; l < LANES; ++l) {
        uint32_t bits = (uint32_t)((int32_t)n.l[l] + 127) << 23;
        memcpy(&r.l[l], &bits, sizeof(bits));
    }
    return r;
}
inline V8 first8(V8 a, int count) {
    for (int l = count; l < LANES; ++l) a.l[l] = 0.0f;
    return a;
}
inline V8 keep8(V8 a, int count, float fill) {
    for (int l = count; l < LANES; ++l) a.l[l] = fill;
    return a;
}
inline float tree8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}
inline V8 sums8(const V8 *a) {
    V8 s;
    for (int k = 0; k < LANES; ++k) s.l[k] = tree8(a[k].l);
    return s;
}
#endif

// exp(x) for x <= 0, 8 at a time, in float operations that every build performs alike: x clamped
// to [-87, 0] (exp(-87) is ~1.6e-38; a NaN becomes -87), split as n ln2 + r with n = round(x / ln 2) and |r| <= ln2 / 2,
// exp(r) by a degree-6 polynomial (Horner, fused multiply-adds), then scaled by 2^n. Within 2 ulp
// of exp; its own bits, the same in the AVX2 and the plain-C build.
inline V8 exp8(V8 x) {
    x = min8(max8(x, splat8(-87.0f)), zero8());
    V8 n = round8(mul8(x, splat8(1.44269504088896341f)));
    V8 r = fma8(n, splat8(-0.693359375f), x);  // ln 2 in two parts: the first exact in float
    r = fma8(n, splat8(2.12194440e-4f), r);
    V8 y = splat8(1.9875691500e-4f);
    y = fma8(y, r, splat8(1.3981999507e-3f));
    y = fma8(y, r, splat8(8.3334519073e-3f));
    y = fma8(y, r, splat8(4.1665795894e-2f));
    y = fma8(y, r, splat8(1.6666665459e-1f));
    y = fma8(y, r, splat8(5.0000001201e-1f));
    y = fma8(y, mul8(r, r), r);
    y = add8(y, splat8(1.0f));
    return mul8(y, pow2_8(n));
}

// The lanes added in one fixed order: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
inline float lanes_sum(V8 x) {
    float a[LANES];
    store8(a, x);
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

struct Problem {
    const float *q;         // [T, H, d]
    const float *k;         // [num_blocks, block_size, Hkv, d]
    const float *v;
    const int32_t *table;   // [B, table_stride]
    int64_t table_stride;
    const int32_t *cu_q;    // [B + 1]
    const int32_t *seq_lens;  // [B]
    int heads, kv_heads, dim, block_size;
    float scale;
    float *out;             // [T, H, d]
};

struct Tile {
    int b, g, first, count;  // sequence, KV head, its first query position (0-based) and positions
};

// The cache row of key j of sequence b (kv head g): [d] floats.
inline int64_t key_offset(const Problem &p, int b, int g, int64_t j) {
    int64_t block = p.table[b * p.table_stride + j / p.block_size];
    int64_t slot = block * p.block_size + j % p.block_size;
    return (slot * p.kv_heads + g) * p.dim;
}

// out[c : c + NV * 8] = sum over j < keys, in order, of p[j] * v_j[c : c + NV * 8] (fused).
template <int NV>
inline void weighted_values(const Problem &p, const int64_t *at, const float *pr, int64_t keys, int c,
                            float *out) {
    V8 acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = zero8();
    for (int64_t j = 0; j < keys; ++j) {
        const float *vj = p.v + at[j] + c;
        V8 e = splat8(pr[j]);
        for (int i = 0; i < NV; ++i) acc[i] = fma8(e, load8(vj + i * LANES), acc[i]);
    }
    for (int i = 0; i < NV; ++i) store8(out + c + i * LANES, acc[i]);
}

struct Scratch {
    std::vector<float> scores, num;
    std::vector<int64_t> rows;  // the cache row (offset in floats) of each key
};

void run_tile(const Problem &p, const Tile &t, Scratch &w) {
    const int group = p.heads / p.kv_heads, d = p.dim;
    const int rows = t.count * group;
    const int len_q = p.cu_q[t.b + 1] - p.cu_q[t.b];
    const int64_t seq_len = p.seq_lens[t.b];
    int64_t limit[TILE_ROWS];
    const float *qrow[TILE_ROWS];
    float *orow[TILE_ROWS];
    int64_t keys = 0;  // the most keys any row of the tile sees
    for (int r = 0; r < rows; ++r) {
        int i = t.first + r / group, h = t.g * group + r % group;
        int64_t token = p.cu_q[t.b] + i;
        limit[r] = seq_len - (len_q - 1 - i);  // bottom-right causal alignment
        if (limit[r] < 0) limit[r] = 0;
        qrow[r] = p.q + (token * p.heads + h) * d;
        orow[r] = p.out + (token * p.heads + h) * d;
        keys = limit[r] > keys ? limit[r] : keys;
    }
    const int64_t ld = (keys + LANES - 1) / LANES * LANES;  // a row's scores, padded to whole vectors
    if ((int64_t)w.scores.size() < rows * ld) w.scores.resize(rows * ld);
    if ((int)w.num.size() < rows * d) w.num.resize(rows * d);
    if ((int64_t)w.rows.size() < keys) w.rows.resize(keys);
    float *scores = w.scores.data(), *num = w.num.data();
    int64_t *at = w.rows.data();
    for (int64_t j = 0; j < keys; ++j) at[j] = key_offset(p, t.b, t.g, j);
    float top[TILE_ROWS], den[TILE_ROWS];
    // steps 1-2: the scores of every (row, key), and each row's max
    V8 tops[TILE_ROWS];
    for (int r = 0; r < rows; ++r) tops[r] = splat8(-INFINITY);
    const V8 scale = splat8(p.scale);
    for (int64_t j = 0; j < keys; j += LANES) {  // eight keys at a time: eight independent chains
        const float *kj[LANES];
        for (int u = 0; u < LANES; ++u) kj[u] = p.k + at[j + u < keys ? j + u : j];
        for (int r = 0; r < rows; ++r) {
            if (j >= limit[r]) continue;
            V8 a[LANES];
            for (int u = 0; u < LANES; ++u) a[u] = zero8();
            for (int c = 0; c < d; c += LANES) {
                V8 qc = load8(qrow[r] + c);
                for (int u = 0; u < LANES; ++u) a[u] = fma8(qc, load8(kj[u] + c), a[u]);
            }
            V8 s = mul8(sums8(a), scale);  // the 8 keys' scores; past the row's last key: unused
            store8(scores + r * ld + j, s);
            int count = limit[r] - j < LANES ? (int)(limit[r] - j) : LANES;
            tops[r] = max8(tops[r], keep8(s, count, -INFINITY));
        }
    }
    for (int r = 0; r < rows; ++r) {  // a max is exact in any order
        float t[LANES];
        store8(t, tops[r]);
        top[r] = t[0];
        for (int l = 1; l < LANES; ++l) top[r] = t[l] > top[r] ? t[l] : top[r];
    }
    // step 3: one chain per row over its keys in order
    for (int r = 0; r < rows; ++r) {
        float *pr = scores + r * ld;  // the row's scores become its p
        // p_j = exp(s_j - m), 8 keys at a time; den in 8 lanes (lane l: keys j = l mod 8, in
        // order), the lanes added in the fixed tree at the end
        V8 dsum = zero8(), m = splat8(top[r]);
        for (int64_t j = 0; j < limit[r]; j += LANES) {
            int count = limit[r] - j < LANES ? (int)(limit[r] - j) : LANES;
            V8 s = load8(pr + j);  // (past the row's last key: scratch, zeroed below)
            V8 e = first8(exp8(add8(s, mul8(m, splat8(-1.0f)))), count);  // s + (-m): s - m exactly
            store8(pr + j, e);
            dsum = add8(dsum, e);
        }
        den[r] = lanes_sum(dsum);
        // num: 64 columns at a time held in registers over all the keys (each column's own chain)
        int c = 0;
        for (; c + 8 * LANES <= d; c += 8 * LANES) weighted_values<8>(p, at, pr, limit[r], c, num + r * d);
        for (; c < d; c += LANES) weighted_values<1>(p, at, pr, limit[r], c, num + r * d);
    }
    // step 4
    for (int r = 0; r < rows; ++r) {
        const float *o = num + r * d;
        for (int c = 0; c < d; ++c) orow[r][c] = limit[r] > 0 ? o[c] / den[r] : 0.0f;
    }
}

}  // namespace

extern "C" {

const char *sw_attention_isa() { return SW_ATT_FMA ? "avx2+fma" : "fmaf"; }

// Returns 0; 1 for shapes it does not take (d not a multiple of 8, H not a multiple of Hkv, more
// than 16 query heads per KV head); 2 for lengths that do not fit (the rows are not T, a
// sequence has more keys than its block-table row holds, or a block id the cache does not have). Nothing is written unless it returns 0.
int sw_paged_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                       int64_t table_stride, int64_t num_blocks, const int32_t *cu_q,
                       const int32_t *seq_lens, int num_seqs, int tokens, int heads, int kv_heads, int dim, int block_size, float scale,
                       float *out, int threads) {
    if (dim % LANES || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > TILE_ROWS) return 1;
    if (cu_q[0] != 0 || cu_q[num_seqs] != tokens || block_size <= 0) return 2;
    for (int b = 0; b < num_seqs; ++b) {
        if (cu_q[b + 1] < cu_q[b] || seq_lens[b] < 0 || seq_lens[b] > table_stride * block_size) return 2;
        for (int64_t i = 0; i * block_size < seq_lens[b]; ++i) {
            int32_t block = table[b * table_stride + i];
            if (block < 0 || block >= num_blocks) return 2;  // a block the cache does not have
        }
    }
    Problem p{q, k_cache, v_cache, table, table_stride, cu_q, seq_lens, heads, kv_heads, dim, block_size,
              scale, out};
    const int group = heads / kv_heads;
    const int per_tile = TILE_ROWS / group;  // query positions per tile
    std::vector<Tile> tiles;
    for (int b = 0; b < num_seqs; ++b) {
        int len_q = cu_q[b + 1] - cu_q[b];
        for (int first = 0; first < len_q; first += per_tile) {
            int count = len_q - first < per_tile ? len_q - first : per_tile;
            for (int g = 0; g < kv_heads; ++g) tiles.push_back(Tile{b, g, first, count});
        }
    }
    const int64_t n = (int64_t)tiles.size();
    // the last tiles of a prefill see the most keys: hand them out first
#pragma omp parallel num_threads(threads)
    {
        Scratch w;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = n - 1; i >= 0; --i) run_tile(p, tiles[i], w);
    }
    return 0;
}

}  // extern "C"
