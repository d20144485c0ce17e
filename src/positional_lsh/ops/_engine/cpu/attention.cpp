// The CPU attention kernel of positional_lsh: flash-attention shaped, the bias computed inside the loop.
//
//   out_i = softmax_j(scale * q_i . k_j + bias(i, j)) v_j,   lse_i = log sum_j exp(scale * q_i . k_j + bias(i, j))
//
// Two bias functors over one tiled loop (query tiles of block_m rows, key blocks of block_n keys on one grid):
//   * COUNT, the multiplicity form: bias = log c[i, j], c[i, j] = #{t : start_t(i) <= j < end_t(i)} (end_t(i)
//     replaced by i + 1 when causal), log 0 = -inf. Per query tile every row's block starts (and ends) are kept
//     sorted, built for the first row and carried down the rows (a row changes only the samples whose block begins
//     there): no (n, T) or (n, n) table, work per score entry independent of T. Causal rows keep their starts
//     run-length encoded (distinct starts and running counts: short blocks put many samples on few starts), and
//     their counts c multiply exp(scale s - max) instead of adding log c, computed 16 keys at a time from the
//     starts inside the block; bidirectional rows keep sorted starts and ends, their log c filled segment by
//     segment.
//   * TABLE, the exact biases: bias = table[h, |i - j|] (ALiBi's -m |i - j|, a decay's log k(|i - j|)), -inf
//     beyond reach[h]: per row two contiguous slices of the table (one reversed), no gather.
// Scores and P.V are batch-reduce GEMMs (at::native::cpublas::brgemm, float32), the softmax is online with
// at::vec's exp; work items (batch, head, query tile) are spread over at::parallel_for's threads by their estimated
// work, and taken over at run time from threads that fall behind (WorkQueue). Key blocks are packed as tiles first
// read them, into per-thread buffers kept across calls.
// Block bounds mirror ops/partitions/bounds.py: position i is in block floor((i - shift) / pitch) (float64).
// The backward recomputes the scores from lse (FA2): dq, dk, dv per (batch, query head) (dk, dv summed over each key
// head's query heads at the end) and, when asked, the sum of dS per distance |i - j| (from which the slope and
// decay-parameter gradients follow).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kGrain = 4;  // query tiles a thread takes from the work queue at a time
constexpr int64_t kCount = 0;
constexpr int64_t kTable = 1;

// ---------------------------------------------------------------------------------------------------------------
// Block bounds: the block [lo, hi) holding position i of a partition (pitch b, shift s) of n positions.

inline double label_of(double i, double s, double b) { return std::floor((i - s) / b); }

inline void block_of(double b, double s, int64_t n, int64_t i, int64_t& lo, int64_t& hi) {
  if (std::isinf(b)) {
    lo = 0;
    hi = n;
    return;
  }
  if (b <= 1.0) {
    lo = i;
    hi = i + 1;
    return;
  }
  const double di = static_cast<double>(i);
  const double lab = label_of(di, s, b);
  const double dn = static_cast<double>(n);
  double flo = std::ceil(s + lab * b);
  double fhi = std::ceil(s + (lab + 1.0) * b);
  flo = std::min(std::max(flo, 0.0), di);
  fhi = std::max(std::min(fhi, dn), di + 1.0);
  int64_t l = static_cast<int64_t>(flo), h = static_cast<int64_t>(fhi);
  while (l > 0 && label_of(static_cast<double>(l - 1), s, b) >= lab) --l;
  while (label_of(static_cast<double>(l), s, b) < lab) ++l;
  while (h < n && label_of(static_cast<double>(h), s, b) <= lab) ++h;
  while (label_of(static_cast<double>(h - 1), s, b) > lab) --h;
  lo = l;
  hi = h;
}

// ---------------------------------------------------------------------------------------------------------------
// The bias of a call.

struct Bias {
  int64_t kind;
  bool causal;
  int64_t T = 0;             // COUNT: samples
  int64_t H = 0;             // heads of pitch / shift / table
  const double* pitch = nullptr;  // COUNT: (T, H)
  const double* shift = nullptr;
  const float* logc = nullptr;    // COUNT: (T + 1): log c
  const float* table = nullptr;   // TABLE: (H, L) bias at distance x
  const float* rtable = nullptr;  // TABLE: (H, L) reversed: rtable[h, L - 1 - x] = table[h, x]
  const int64_t* reach = nullptr; // TABLE: (H,) the largest kept distance
  int64_t L = 0;                  // keys (n)
  // COUNT, (T, H): the integer pitch and shift where both are integers (1 <= pitch < 2**53, 0 <= shift < pitch),
  // else pitch 0 (the float64 label formula). Integer blocks are [i - (i - s) mod b, that + b) clipped to [0, L):
  // the same blocks as the label formula (exact below 2**53), without a division per block.
  std::vector<int64_t> ipitch, ishift;
};

// The block [lo, hi) of sample t of head h that holds position i.
inline void block_at(const Bias& bias, int64_t t, int64_t h, int64_t i, int64_t& lo, int64_t& hi) {
  const int64_t th = t * bias.H + h;
  const int64_t b = bias.ipitch[th];
  if (b > 0) {
    int64_t r = (i - bias.ishift[th]) % b;
    if (r < 0) r += b;
    lo = std::max<int64_t>(0, i - r);
    hi = std::min<int64_t>(bias.L, i - r + b);
    return;
  }
  block_of(bias.pitch[th], bias.shift[th], bias.L, i, lo, hi);
}

// The block of sample t of head h that begins at i (the block before it ends at i).
inline void block_from(const Bias& bias, int64_t t, int64_t h, int64_t i, int64_t& lo, int64_t& hi) {
  const int64_t th = t * bias.H + h;
  const int64_t b = bias.ipitch[th];
  if (b > 0) {
    lo = i;
    hi = std::min<int64_t>(bias.L, i + b);
    return;
  }
  block_of(bias.pitch[th], bias.shift[th], bias.L, i, lo, hi);
}

// The rows of one query tile: for COUNT each row's sorted starts (and ends) and its running counts.
struct TileRows {
  int64_t rows = 0;
  int64_t first = 0;  // position of row 0
  std::vector<int32_t> S, E;    // (rows, T)
  std::vector<int32_t> ps, pe;  // running counts: #{S <= key}, #{E <= key} at the last key block visited
  std::vector<int64_t> cs, ce;  // per sample: the current row's block
  std::vector<int32_t> rem, fresh, tmp;
  std::vector<int32_t> bucket, link;  // the samples whose block ends at row x of the tile: a list from bucket[x]
  std::vector<int64_t> lo, hi;  // each row's kept keys [lo, hi)
  // causal COUNT: each row's block starts run-length encoded, (rows, T): the distinct starts pos[0, D) in increasing
  // order and cum, the number of starts up to and including each; the count of key j is cum at the last pos <= j
  std::vector<int32_t> pos, cum, D, mult, at;
  // the last row built (causal COUNT), for the tile of head carry_h that begins at carry_first
  std::vector<int32_t> last_pos, last_cum;
  int32_t last_D = 0;
  int64_t carry_h = -1, carry_first = -1;
};

// [lo, hi) of the keys kept by query tile rows [first, first + rows): one call's span.
inline void tile_span(const Bias& bias, int64_t h, int64_t first, int64_t rows, int64_t& lo, int64_t& hi) {
  const int64_t last = first + rows - 1;
  if (bias.kind == kTable) {
    const int64_t r = bias.reach[h];
    lo = std::max<int64_t>(0, first - r);
    hi = bias.causal ? last + 1 : std::min<int64_t>(bias.L, last + r + 1);
    return;
  }
  lo = first;
  hi = bias.causal ? last + 1 : last + 1;
  for (int64_t t = 0; t < bias.T; ++t) {
    int64_t a, b;
    block_at(bias, t, h, first, a, b);
    lo = std::min(lo, a);
    if (!bias.causal) {
      block_at(bias, t, h, last, a, b);
      hi = std::max(hi, b);
    }
  }
}

// The causal COUNT rows of a tile (TileRows::pos, cum, D): row 0's starts sorted and run-length encoded (or, for a
// thread's next tile of the head, carried from the previous tile's last row); row x from row x - 1 by removing one
// start of each sample whose block ends at row x and adding those samples' new start, the row itself. A few
// removals among many distinct starts: each found by a binary search, the counts after it lowered; many: the
// multiplicities lowered (each start's entry by a table over the row's starts, or a binary search where they spread
// far) and the runs written again.
void build_runs(const Bias& bias, int64_t h, int64_t first, int64_t rows, TileRows& tr) {
  const int64_t T = bias.T;
  tr.pos.resize(rows * T);
  tr.cum.resize(rows * T);
  tr.D.resize(rows);
  tr.ps.assign(rows, 0);
  tr.cs.resize(T);
  tr.ce.resize(T);
  tr.bucket.assign(rows, -1);
  tr.link.resize(T);
  tr.mult.resize(T);
  const int64_t stop = first + rows;
  auto file = [&](int64_t t) {
    if (tr.ce[t] < stop) {
      tr.link[t] = tr.bucket[tr.ce[t] - first];
      tr.bucket[tr.ce[t] - first] = static_cast<int32_t>(t);
    }
  };
  // A thread's next tile of the same head continues from the last row of the one before (its samples' blocks and
  // that row kept): no block bounds to compute and no sort for its first row.
  const bool carry = tr.carry_h == h && tr.carry_first == first;
  int64_t x0 = 0;
  if (carry) {
    for (int64_t t = 0; t < T; ++t) file(t);  // every block of the row before ends at first or later
  } else {
    tr.tmp.resize(T);
    for (int64_t t = 0; t < T; ++t) {
      block_at(bias, t, h, first, tr.cs[t], tr.ce[t]);
      tr.tmp[t] = static_cast<int32_t>(tr.cs[t]);
      file(t);
    }
    std::sort(tr.tmp.begin(), tr.tmp.end());
    int32_t D = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (D == 0 || tr.pos[D - 1] != tr.tmp[t]) tr.pos[++D - 1] = tr.tmp[t];
      tr.cum[D - 1] = static_cast<int32_t>(t + 1);
    }
    tr.D[0] = D;
    x0 = 1;
  }
  for (int64_t x = x0; x < rows; ++x) {
    const int64_t i = first + x;
    const int32_t* pp = x ? tr.pos.data() + (x - 1) * T : tr.last_pos.data();
    const int32_t* cp = x ? tr.cum.data() + (x - 1) * T : tr.last_cum.data();
    int32_t* pn = tr.pos.data() + x * T;
    int32_t* cn = tr.cum.data() + x * T;
    const int32_t Dp = x ? tr.D[x - 1] : tr.last_D;
    tr.rem.clear();
    for (int32_t t = tr.bucket[x]; t >= 0;) {  // the samples whose block of row i - 1 ends at i
      const int32_t next = tr.link[t];
      tr.rem.push_back(static_cast<int32_t>(tr.cs[t]));
      block_from(bias, t, h, i, tr.cs[t], tr.ce[t]);
      file(t);
      t = next;
    }
    const int32_t k = static_cast<int32_t>(tr.rem.size());
    int32_t w = Dp;
    std::copy(pp, pp + Dp, pn);
    std::copy(cp, cp + Dp, cn);
    if (k > 0 && k * 8 < Dp) {  // a few starts among many: each one found, the counts after it lowered
      for (const int32_t a : tr.rem) {
        const int32_t e = static_cast<int32_t>(std::lower_bound(pn, pn + w, a) - pn);
        for (int32_t f = e; f < w; ++f) --cn[f];
        if (cn[e] == (e ? cn[e - 1] : 0)) {  // the last start at a: the entry goes
          std::copy(pn + e + 1, pn + w, pn + e);
          std::copy(cn + e + 1, cn + w, cn + e);
          --w;
        }
      }
    } else if (k > 0) {  // many: multiplicities lowered, the runs written again
      for (int32_t e = 0; e < Dp; ++e) tr.mult[e] = cp[e] - (e ? cp[e - 1] : 0);
      const int64_t range = static_cast<int64_t>(pp[Dp - 1]) - pp[0] + 1;
      if (range <= 4 * static_cast<int64_t>(Dp) + 256) {  // each start's entry by a table: no search
        tr.at.resize(range);
        for (int32_t e = 0; e < Dp; ++e) tr.at[pp[e] - pp[0]] = e;
        for (const int32_t a : tr.rem) --tr.mult[tr.at[a - pp[0]]];
      } else {
        for (const int32_t a : tr.rem) --tr.mult[std::lower_bound(pp, pp + Dp, a) - pp];
      }
      int32_t run = 0;
      w = 0;
      for (int32_t e = 0; e < Dp; ++e) {
        if (tr.mult[e] == 0) continue;
        run += tr.mult[e];
        pn[w] = pp[e];
        cn[w++] = run;
      }
    }
    if (k > 0) {
      pn[w] = static_cast<int32_t>(i);  // every start of row i - 1 is at most i - 1
      cn[w++] = static_cast<int32_t>(T);
    }
    tr.D[x] = w;
  }
  for (int64_t x = 0; x < rows; ++x) {
    tr.lo[x] = tr.pos[x * T];
    tr.hi[x] = first + x + 1;
  }
  tr.last_D = tr.D[rows - 1];
  tr.last_pos.assign(tr.pos.begin() + (rows - 1) * T, tr.pos.begin() + (rows - 1) * T + tr.last_D);
  tr.last_cum.assign(tr.cum.begin() + (rows - 1) * T, tr.cum.begin() + (rows - 1) * T + tr.last_D);
  tr.carry_h = h;
  tr.carry_first = first + rows;
}

void build_rows(const Bias& bias, int64_t h, int64_t first, int64_t rows, TileRows& tr) {
  tr.rows = rows;
  tr.first = first;
  tr.lo.resize(rows);
  tr.hi.resize(rows);
  if (bias.kind == kTable) {
    const int64_t r = bias.reach[h];
    for (int64_t x = 0; x < rows; ++x) {
      const int64_t i = first + x;
      tr.lo[x] = std::max<int64_t>(0, i - r);
      tr.hi[x] = bias.causal ? i + 1 : std::min<int64_t>(bias.L, i + r + 1);
    }
    return;
  }
  if (bias.causal) {
    build_runs(bias, h, first, rows, tr);
    return;
  }
  const int64_t T = bias.T;
  const bool ends = !bias.causal;
  tr.S.resize(rows * T);
  tr.ps.assign(rows, 0);
  tr.cs.resize(T);
  tr.ce.resize(T);
  tr.bucket.assign(rows, -1);
  tr.link.resize(T);
  if (ends) {
    tr.E.resize(rows * T);
    tr.pe.assign(rows, 0);
  }
  const int64_t stop = first + rows;  // blocks ending at or after it change nothing in the tile
  auto file = [&](int64_t t) {
    if (tr.ce[t] < stop) {
      tr.link[t] = tr.bucket[tr.ce[t] - first];
      tr.bucket[tr.ce[t] - first] = static_cast<int32_t>(t);
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    block_at(bias, t, h, first, tr.cs[t], tr.ce[t]);
    tr.S[t] = static_cast<int32_t>(tr.cs[t]);
    if (ends) tr.E[t] = static_cast<int32_t>(tr.ce[t]);
    file(t);
  }
  std::sort(tr.S.begin(), tr.S.begin() + T);
  if (ends) std::sort(tr.E.begin(), tr.E.begin() + T);
  for (int64_t x = 1; x < rows; ++x) {
    const int64_t i = first + x;
    int32_t* S = tr.S.data() + x * T;
    const int32_t* Sp = S - T;
    tr.rem.clear();
    tr.fresh.clear();
    for (int32_t t = tr.bucket[x]; t >= 0;) {  // the samples whose block of row i - 1 ends at i
      const int32_t next = tr.link[t];
      tr.rem.push_back(static_cast<int32_t>(tr.cs[t]));
      block_from(bias, t, h, i, tr.cs[t], tr.ce[t]);
      tr.fresh.push_back(static_cast<int32_t>(tr.ce[t]));
      file(t);
      t = next;
    }
    const int64_t k = static_cast<int64_t>(tr.rem.size());
    if (k == 0) {
      std::copy(Sp, Sp + T, S);
      if (ends) std::copy(tr.E.data() + (x - 1) * T, tr.E.data() + x * T, tr.E.data() + x * T);
      continue;
    }
    std::sort(tr.rem.begin(), tr.rem.end());
    // S = Sp without the k old starts (one occurrence each), then k times i (every other start is at most i - 1).
    int64_t w = 0, from = 0;
    if (k * 16 <= T) {
      for (int64_t y = 0; y < k; ++y) {
        const int64_t at = std::lower_bound(Sp + from, Sp + T, tr.rem[y]) - Sp;
        std::copy(Sp + from, Sp + at, S + w);
        w += at - from;
        from = at + 1;
      }
      std::copy(Sp + from, Sp + T, S + w);
      w += T - from;
    } else {
      int64_t y = 0;
      for (int64_t z = 0; z < T; ++z) {
        if (y < k && Sp[z] == tr.rem[y]) {
          ++y;
          continue;
        }
        S[w++] = Sp[z];
      }
    }
    for (; w < T; ++w) S[w] = static_cast<int32_t>(i);
    if (ends) {
      // The k ends of row i - 1 that equal i are its k smallest: drop them, merge in the new ends.
      const int32_t* Ep = tr.E.data() + (x - 1) * T;
      int32_t* E = tr.E.data() + x * T;
      std::sort(tr.fresh.begin(), tr.fresh.end());
      std::merge(Ep + k, Ep + T, tr.fresh.begin(), tr.fresh.end(), E);
    }
  }
  for (int64_t x = 0; x < rows; ++x) {
    tr.lo[x] = tr.S[x * T];
    tr.hi[x] = ends ? tr.E[x * T + T - 1] : first + x + 1;
  }
}

// The added bias of row x of the tile over its kept keys of [j0, j0 + bn), [a, b) (not empty: bias_view checks),
// into br[a - j0, b - j0); the rest of br is not written (the softmax reads the kept keys only).
inline void bias_row(const Bias& bias, int64_t h, TileRows& tr, int64_t x, int64_t j0, int64_t bn, float* br) {
  const int64_t i = tr.first + x;
  const int64_t a = std::max(j0, tr.lo[x]);
  const int64_t b = std::min(j0 + bn, tr.hi[x]);
  if (bias.kind == kTable) {
    const int64_t L = bias.L;
    const int64_t mid = std::min(b, i + 1);  // keys [a, mid) are at or left of the row: distance i - j
    if (mid > a) {
      const float* src = bias.rtable + h * L + (L - 1 - i + a);
      std::copy(src, src + (mid - a), br + (a - j0));
    }
    const int64_t right = std::max(a, i + 1);
    if (b > right) {
      const float* src = bias.table + h * L + (right - i);
      std::copy(src, src + (b - right), br + (right - j0));
    }
    return;
  }
  // bidirectional COUNT (a causal row's counts: count_row)
  const int64_t T = bias.T;
  const int32_t* S = tr.S.data() + x * T;
  int64_t ps = tr.ps[x];
  const float* logc = bias.logc;
  const int32_t* E = tr.E.data() + x * T;
  int64_t pe = tr.pe[x];
  int64_t j = a;
  while (j < b) {
    while (ps < T && S[ps] <= j) ++ps;
    while (pe < T && E[pe] <= j) ++pe;
    int64_t next = b;
    if (ps < T) next = std::min<int64_t>(next, S[ps]);
    if (pe < T) next = std::min<int64_t>(next, E[pe]);
    std::fill(br + (j - j0), br + (next - j0), logc[ps - pe]);
    j = next;
  }
  tr.ps[x] = static_cast<int32_t>(ps);
  tr.pe[x] = static_cast<int32_t>(pe);
}

// The tile's rows that keep a key of [j0, j0 + bn): [ra, rb), contiguous since every row's kept keys [lo, hi) are
// an interval whose ends do not decrease down the rows.
inline void live_rows(const TileRows& tr, int64_t j0, int64_t bn, int64_t& ra, int64_t& rb) {
  ra = 0;
  while (ra < tr.rows && tr.hi[ra] <= j0) ++ra;
  rb = tr.rows;
  while (rb > ra && tr.lo[rb - 1] >= j0 + bn) --rb;
}

// The GEMMs of one key block: rows [r0, r1) of the tile over the block's columns [c0, c1) (from j0).
struct Strip {
  int64_t r0, r1, c0, c1;
};

// The live rows [ra, rb) of key block [j0, j0 + bn) as one strip over the columns they keep, or as two halves, each
// over its own columns, where that saves a fifth of the entries (the causal diagonal, a steep head's narrow rows):
// every row's kept keys lie in its strip's columns, whole vectors of 16 (within the block; half: its even size).
inline int strips(const TileRows& tr, int64_t j0, int64_t bn, int64_t ra, int64_t rb, bool half, Strip* st) {
  auto cols = [&](int64_t r0, int64_t r1, Strip& z) {
    z.r0 = r0;
    z.r1 = r1;
    z.c0 = std::max<int64_t>(tr.lo[r0], j0) - j0;
    z.c1 = std::min<int64_t>(tr.hi[r1 - 1], j0 + bn) - j0;
    z.c0 -= z.c0 % 16;  // whole vectors of columns
    z.c1 = std::min<int64_t>(z.c1 + (16 - z.c1 % 16) % 16, bn + (half ? bn % 2 : 0));
  };
  cols(ra, rb, st[0]);
  if (rb - ra < 32) return 1;
  const int64_t mid = ra + (rb - ra) / 2;
  Strip a, b;
  cols(ra, mid, a);
  cols(mid, rb, b);
  const int64_t whole = (rb - ra) * (st[0].c1 - st[0].c0);
  if (5 * ((mid - ra) * (a.c1 - a.c0) + (rb - mid) * (b.c1 - b.c0)) > 4 * whole) return 1;
  st[0] = a;
  st[1] = b;
  return 2;
}

// ---------------------------------------------------------------------------------------------------------------
// Vector helpers over n floats.

inline float max_nan(float a, float b) { return (a < b || std::isnan(b)) ? b : a; }  // NaN wins

// The softmax's running maximum, lane by lane, without at::vec::maximum's NaN propagation (three instructions where
// the vector unit has one): a NaN score still makes its row NaN, through exp(NaN - m) in the row's sum and P V, or
// (a block whose other scores are all masked) through row_softmax's check.
inline Vec max_fast(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_max_ps(a, b));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_max_ps(a, b));
#else
  return at::vec::maximum(a, b);
#endif
}

inline float hmax_fast(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(v);
#else
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return max_fast(a, b); }, v);
#endif
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

// s[0, n) = scale s + bias, the bias bp[0, n) or, where bp is null, cst (the backward's recomputed scores).
inline void scale_add(float* s, const float* bp, float cst, float scale, int64_t n) {
  const Vec vs(scale), vc(cst);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    at::vec::fmadd(Vec::loadu(s + j), vs, bp ? Vec::loadu(bp + j) : vc).store(s + j);
  }
  for (; j < n; ++j) s[j] = s[j] * scale + (bp ? bp[j] : cst);
}

inline void scale_row(float* x, float a, int64_t n) {
  Vec va(a);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * va).store(x + j);
  for (; j < n; ++j) x[j] *= a;
}

// A causal COUNT row's counts over keys [j0, j0 + bn) (TileRows::pos, cum): *cst where the block holds no start of
// the row (returns false), else cnt[0, bn) (returns true; keys before the row's first start get 0), 16 keys at a
// time: the count of the starts before the chunk plus, per start inside it, its multiplicity where key >= start.
inline bool count_row(const Bias& bias, TileRows& tr, int64_t x, int64_t j0, int64_t bn, float* cnt, float* cst) {
  const int64_t T = bias.T;
  const int32_t* pos = tr.pos.data() + x * T;
  const int32_t* cum = tr.cum.data() + x * T;
  const int32_t D = tr.D[x];
  int32_t q = tr.ps[x];
  while (q < D && pos[q] <= j0) ++q;
  tr.ps[x] = q;
  float run = q ? static_cast<float>(cum[q - 1]) : 0.f;
  if (q == D || pos[q] >= j0 + bn) {
    *cst = run;
    return false;
  }
  const Vec lane = Vec::arange(0.f, 1.f);
  for (int64_t o = 0; o < bn; o += Vec::size()) {
    Vec c(run);
    const Vec key = lane + Vec(static_cast<float>(o));
    const int64_t end = j0 + o + Vec::size();
    for (; q < D && pos[q] < end; ++q) {
      const float now = static_cast<float>(cum[q]);
      c = c + (Vec(now - run) & (key >= Vec(static_cast<float>(pos[q] - j0))));
      run = now;
    }
    if (o + Vec::size() <= bn) {
      c.store(cnt + o);
    } else {
      c.store(cnt + o, static_cast<int>(bn - o));
    }
  }
  return true;
}

// The bias of row x over keys [j0, j0 + bn), without a copy where it can. A causal COUNT row gives its counts c,
// which multiply exp(scale s - max) (the same softmax as adding log c, without log c's table; *mul set): cnt[0, bn)
// or one count *cst (no start of the row inside the block). Otherwise the added bias as bias_row gives it, except
// that a row keeping every key of the block reads a TABLE bias in place (one side of the row: a slice of the line
// or of its reverse). Returns 0 (no key kept), 1 (*ptr: bn values) or 2 (*cst: every key's); [*ka, *kb) are the
// row's kept keys in the block (from j0): the others' probabilities are 0.
inline int bias_view(const Bias& bias, int64_t h, TileRows& tr, int64_t x, int64_t j0, int64_t bn, float* br,
                     const float** ptr, float* cst, bool* mul, int64_t* ka, int64_t* kb) {
  const int64_t i = tr.first + x;
  *ka = std::max<int64_t>(0, tr.lo[x] - j0);
  *kb = std::min<int64_t>(bn, tr.hi[x] - j0);
  *mul = false;
  if (*ka >= *kb) return 0;
  if (bias.kind == kCount && bias.causal) {
    *mul = true;
    if (!count_row(bias, tr, x, j0, bn, br, cst)) return 2;
    *ptr = br;
    return 1;
  }
  if (bias.kind == kTable && *ka == 0 && *kb == bn) {
    const int64_t L = bias.L;
    if (j0 + bn <= i + 1) {  // every key at or left of the row
      *ptr = bias.rtable + h * L + (L - 1 - i + j0);
      return 1;
    }
    if (j0 > i) {
      *ptr = bias.table + h * L + (j0 - i);
      return 1;
    }
  }
  bias_row(bias, h, tr, x, j0, bn, br);
  *ptr = br;
  return 1;
}

// s[0, n) <- exp(s - m) (times the count, bp[0, n) or cst where bp is null, when mul); returns the sum.
inline float exp_sum(float* s, float m, int64_t n, bool mul, const float* bp, float cst) {
  const Vec vm(m), vc(cst);
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    Vec p = (Vec::loadu(s + j) - vm).exp_u20();
    if (mul) p = p * (bp ? Vec::loadu(bp + j) : vc);
    p.store(s + j);
    acc = acc + p;
  }
  if (j < n) {
    const int r = static_cast<int>(n - j);
    Vec p = (Vec::loadu(s + j, r) - vm).exp_u20();
    if (mul) p = p * (bp ? Vec::loadu(bp + j, r) : vc);
    p = Vec::set(Vec(0.f), p, r);
    p.store(s + j, r);
    acc = acc + p;
  }
  return hsum(acc);
}

// One row of one key block's kept keys: s[0, n) <- exp(scale s + bias - m_new), the bias bp[0, n) or cst where bp is
// null (with mul: exp(scale s - m_new) times the count bp / cst, m the running max of scale s); m, l, acc (d values)
// updated online; a row without a finite score yet is zeroed (s).
inline void row_softmax(float* s, int64_t n, float scale, const float* bp, float cst, bool mul, float& m, float& l,
                        float* acc, int64_t d) {
  const Vec vs(scale), vc(mul ? 0.f : cst);
  const float* add = mul ? nullptr : bp;
  Vec vmax(kNegInf);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec b = add ? Vec::loadu(add + j) : vc;
    const Vec y = at::vec::fmadd(Vec::loadu(s + j), vs, b);
    y.store(s + j);
    vmax = max_fast(vmax, y);
  }
  if (j < n) {
    const int64_t r = n - j;
    const Vec b = add ? Vec::loadu(add + j, r) : vc;
    const Vec y = at::vec::fmadd(Vec::loadu(s + j, r), vs, b);
    y.store(s + j, r);
    const Vec pad(kNegInf);
    vmax = max_fast(vmax, Vec::set(pad, y, r));
  }
  float mn = max_nan(m, hmax_fast(vmax));
  if (mn == kNegInf) {  // no finite score in the block: zeros, unless one is NaN (a NaN row)
    if (std::none_of(s, s + n, [](float x) { return std::isnan(x); })) {
      std::fill(s, s + n, 0.f);
      return;
    }
    mn = std::numeric_limits<float>::quiet_NaN();
  }
  const float sum = exp_sum(s, mn, n, mul, bp, cst);
  const float alpha = m == kNegInf ? 0.f : std::exp(m - mn);
  if (alpha != 1.f) scale_row(acc, alpha, d);
  l = l * alpha + sum;
  m = mn;
}

// Each key block of block_n keys (on the grid 0, block_n, ...) of one head's x (L, d) laid out as a brgemm B
// matrix, zero-padded past L: (nb, d * block_n).
//   * Layout::kTransposed: x^T, the K x N matrix (d, block_n), row-major (float32 keys);
//   * Layout::kKeysVnni / kValuesVnni: x^T (d, block_n) or x (block_n, d) in the VNNI-2 layout of half types,
//     element (r, c) of a K x N matrix at ((r / 2) * N + c) * 2 + r % 2 (K even: zero rows pad it).
enum class Layout { kTransposed, kKeysVnni, kValuesVnni };

// Key blocks [kb_begin, kb_end) of one head's x (L, d) into dst (nb, d * block_n) in `layout`, zero-padded past L.
template <typename T>
void pack_range(const T* src, int64_t L, int64_t d, int64_t block_n, Layout layout, T* dst, int64_t kb_begin,
                int64_t kb_end) {
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    const int64_t j0 = kb * block_n, bn = std::min(block_n, L - j0);
    const T* s = src + j0 * d;
    T* o = dst + kb * d * block_n;
    if (bn < block_n) std::fill(o, o + d * block_n, static_cast<T>(0.f));  // the zero padding of a last block
    if (layout == Layout::kTransposed) {
      if constexpr (std::is_same_v<T, float>) {
        at::vec::transpose_mxn<float>(s, d, o, block_n, static_cast<int>(bn), static_cast<int>(d));
      }
    } else if (layout == Layout::kKeysVnni) {
      // (bn, d) half values as (bn, d / 2) pairs, transposed: (d / 2, block_n) pairs, a 32-bit transpose.
      static_assert(sizeof(T) == 2 || std::is_same_v<T, float>, "half types");
      if constexpr (sizeof(T) == 2) {
        at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(s), d / 2, reinterpret_cast<float*>(o), block_n,
                                      static_cast<int>(bn), static_cast<int>(d / 2));
      }
    } else {
      for (int64_t j = 0; j + 1 < bn; j += 2) {
        const T* a = s + j * d;
        const T* b = a + d;
        T* w = o + j * d;
        for (int64_t c = 0; c < d; ++c) {
          w[2 * c] = a[c];
          w[2 * c + 1] = b[c];
        }
      }
      if (bn % 2) {
        const T* a = s + (bn - 1) * d;
        T* w = o + (bn - 1) * d;
        for (int64_t c = 0; c < d; ++c) {
          w[2 * c] = a[c];
          w[2 * c + 1] = static_cast<T>(0.f);
        }
      }
    }
  }
}

// A thread's packing buffer is kept across calls up to this size (no page faults on the next call); a larger one,
// a long context's key head, is given back after the call rather than held by every thread.
constexpr size_t kKeptBufferBytes = size_t{64} << 20;

template <typename T>
void release_large(std::vector<T>& buf) {
  if (buf.capacity() * sizeof(T) > kKeptBufferBytes) std::vector<T>().swap(buf);
}

// One head's key blocks laid out as brgemm B matrices (pack_range), packed as the tiles first need them: a block is
// packed right before the tile that reads it (in cache when read, no pass over the whole head up front). A thread
// keeps one head, blocks [lo, hi), in a buffer kept across calls up to kKeptBufferBytes.
template <typename T>
struct PackedHead {
  std::vector<T>& buf;
  const T* src = nullptr;  // the head's x (L, d)
  int64_t L = 0, d = 0, block_n = 0, lo = 0, hi = 0;
  Layout layout;
  PackedHead(std::vector<T>& b, Layout l) : buf(b), layout(l) {}
  void reset(const T* x, int64_t length, int64_t dim, int64_t bn) {
    src = x;
    L = length;
    d = dim;
    block_n = bn;
    lo = hi = 0;
    buf.resize(((L + bn - 1) / bn) * d * bn);
  }
  // Blocks [kb0, kb1) packed (and the gap to those already packed).
  const T* ensure(int64_t kb0, int64_t kb1) {
    if (lo >= hi) lo = hi = kb0;
    if (kb0 < lo) pack_range<T>(src, L, d, block_n, layout, buf.data(), kb0, lo), lo = kb0;
    if (kb1 > hi) pack_range<T>(src, L, d, block_n, layout, buf.data(), hi, kb1), hi = kb1;
    return buf.data();
  }
};

// Items 0 .. cost.size() - 1 split into `threads` contiguous ranges of about equal cost: [cut[t], cut[t + 1]).
std::vector<int64_t> contiguous_chunks(const std::vector<double>& cost, int64_t threads) {
  double total = 0.0;
  for (double c : cost) total += c;
  std::vector<int64_t> cut(threads + 1, static_cast<int64_t>(cost.size()));
  cut[0] = 0;
  double run = 0.0;
  int64_t t = 1;
  for (int64_t i = 0; i < static_cast<int64_t>(cost.size()) && t < threads; ++i) {
    // item i goes to the range whose share its middle falls in
    while (t < threads && run + 0.5 * cost[i] >= total * static_cast<double>(t) / static_cast<double>(threads)) {
      cut[t++] = i;
    }
    run += cost[i];
  }
  return cut;
}

// Items 0 .. n - 1 shared by `threads` threads: each thread takes the items of its own contiguous range from the
// front; a thread whose range is empty takes the back half of the range with the most work left (its own from then
// on). A thread thus walks long runs of consecutive items (one key head packed once, the tile rows carried), and no
// thread waits while another has work that was misjudged by the costs.
class WorkQueue {
 public:
  WorkQueue(const std::vector<double>& cost, const std::vector<int64_t>& cut)
      : n_(static_cast<int64_t>(cut.size()) - 1), ranges_(new Range[n_]), prefix_(cost.size() + 1, 0.0) {
    for (size_t i = 0; i < cost.size(); ++i) prefix_[i + 1] = prefix_[i] + cost[i];
    for (int64_t t = 0; t < n_; ++t) {
      ranges_[t].front = cut[t];
      ranges_[t].back = cut[t + 1];
    }
  }
  // The next items of thread t, [*a, *b): at most `grain` of them; false when no work is left anywhere.
  bool next(int64_t t, int64_t grain, int64_t* a, int64_t* b) {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(ranges_[t].mu);
        if (ranges_[t].front < ranges_[t].back) {
          *a = ranges_[t].front;
          *b = ranges_[t].front = std::min(ranges_[t].back, *a + grain);
          return true;
        }
      }
      if (!steal(t)) return false;
    }
  }

 private:
  struct Range {
    std::mutex mu;
    int64_t front = 0, back = 0;
  };
  bool steal(int64_t t) {
    while (true) {
      int64_t victim = -1;
      double most = 0.0;
      for (int64_t u = 0; u < n_; ++u) {
        if (u == t) continue;
        std::lock_guard<std::mutex> lock(ranges_[u].mu);
        const double left = prefix_[ranges_[u].back] - prefix_[ranges_[u].front];
        if (ranges_[u].front < ranges_[u].back && left > most) most = left, victim = u;
      }
      if (victim < 0) return false;
      int64_t a, b;
      {
        std::lock_guard<std::mutex> lock(ranges_[victim].mu);
        const int64_t f = ranges_[victim].front;
        b = ranges_[victim].back;
        if (f >= b) continue;  // emptied meanwhile: look again
        a = f + (b - f) / 2;  // the back half (the last item where one is left)
        ranges_[victim].back = a;
      }
      std::lock_guard<std::mutex> lock(ranges_[t].mu);
      ranges_[t].front = a;
      ranges_[t].back = b;
      return true;
    }
  }
  int64_t n_;
  std::unique_ptr<Range[]> ranges_;
  std::vector<double> prefix_;
};

// Greedy longest-first assignment of items with costs to threads: the items of each thread.
std::vector<std::vector<int64_t>> balance(const std::vector<double>& cost, int64_t threads) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::vector<std::vector<int64_t>> lists(threads);
  std::vector<double> load(threads, 0.0);
  for (int64_t item : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    lists[t].push_back(item);
    load[t] += cost[item] + 1.0;
  }
  return lists;
}

Bias make_bias(int64_t kind, bool causal, const at::Tensor& pitch, const at::Tensor& shift, const at::Tensor& table,
               const at::Tensor& rtable, const at::Tensor& reach, int64_t L) {
  Bias bias;
  bias.kind = kind;
  bias.causal = causal;
  bias.L = L;
  if (kind == kCount) {
    TORCH_CHECK(pitch.dim() == 2 && pitch.sizes() == shift.sizes(), "pitch, shift: (T, H)");
    TORCH_CHECK(pitch.scalar_type() == at::kDouble && shift.scalar_type() == at::kDouble, "pitch, shift: float64");
    TORCH_CHECK(table.numel() == pitch.size(0) + 1, "table: the T + 1 values of log c");
    TORCH_CHECK(L < std::numeric_limits<int32_t>::max(), "keys: fewer than 2**31 - 1");
    bias.T = pitch.size(0);
    bias.H = pitch.size(1);
    bias.pitch = pitch.data_ptr<double>();
    bias.shift = shift.data_ptr<double>();
    bias.logc = table.data_ptr<float>();
    bias.ipitch.assign(bias.T * bias.H, 0);
    bias.ishift.assign(bias.T * bias.H, 0);
    for (int64_t th = 0; th < bias.T * bias.H; ++th) {
      const double b = bias.pitch[th], s = bias.shift[th];
      if (std::isfinite(b) && b >= 1.0 && b < 9007199254740992.0 && b == std::floor(b) && s >= 0.0 && s < b &&
          s == std::floor(s)) {
        bias.ipitch[th] = static_cast<int64_t>(b);
        bias.ishift[th] = static_cast<int64_t>(s);
      }
    }
  } else {
    TORCH_CHECK(kind == kTable, "kind: 0 (counts) or 1 (table)");
    TORCH_CHECK(table.dim() == 2 && table.size(1) == L && rtable.sizes() == table.sizes(), "table: (H, Lk)");
    TORCH_CHECK(reach.scalar_type() == at::kLong && reach.numel() == table.size(0), "reach: (H,) int64");
    bias.H = table.size(0);
    bias.table = table.data_ptr<float>();
    bias.rtable = rtable.data_ptr<float>();
    bias.reach = reach.data_ptr<int64_t>();
  }
  return bias;
}

// The key span [lo, hi) of every (head, query tile), index h * tiles + tile.
struct Spans {
  int64_t tiles;
  std::vector<int64_t> lo, hi;
};

Spans spans(const Bias& bias, int64_t Hq, int64_t Lq, int64_t Lk, int64_t block_m) {
  Spans sp;
  sp.tiles = (Lq + block_m - 1) / block_m;
  sp.lo.resize(Hq * sp.tiles);
  sp.hi.resize(Hq * sp.tiles);
  at::parallel_for(0, Hq * sp.tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t h = idx / sp.tiles, tl = idx % sp.tiles;
      const int64_t rows = std::min(block_m, Lq - tl * block_m);
      tile_span(bias, h, Lk - Lq + tl * block_m, rows, sp.lo[idx], sp.hi[idx]);
    }
  });
  return sp;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool half = false) {
  const auto dt = q.scalar_type();
  const bool ok = dt == at::kFloat || (half && dt == at::kBFloat16);
  for (const auto* x : {&q, &k, &v}) {
    TORCH_CHECK(x->dim() == 4 && x->is_contiguous() && x->scalar_type() == dt && ok && x->device().is_cpu(),
                "q, k, v: contiguous CPU tensors (B, H, L, d) of one dtype: float32 (bfloat16: forward, even head "
                "dim)");
  }
  TORCH_CHECK(dt == at::kFloat || q.size(3) % 2 == 0, "bfloat16: an even head dim");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(3) == k.size(3), "q, k, v: shapes");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "q heads: a multiple of the key heads");
  TORCH_CHECK(q.size(2) <= k.size(2), "Lq <= Lk");
}

// ---------------------------------------------------------------------------------------------------------------
// Forward.

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Bias& bias, float scale,
                  int64_t block_m, int64_t block_n, at::Tensor& out, at::Tensor& lse) {
  constexpr bool kHalf = !std::is_same_v<T, float>;  // bfloat16: VNNI-packed B, P rounded to T
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), d = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), group = Hq / Hkv;
  const int64_t nb = (Lk + block_n - 1) / block_n;
  const Spans sp = spans(bias, Hq, Lq, Lk, block_m);
  const int64_t tiles = sp.tiles, q0 = Lk - Lq;
  const std::vector<int64_t>&span_lo = sp.lo, &span_hi = sp.hi;
  // Items (batch, head, tile) in this order, split into contiguous ranges of about equal estimated work (keys of the
  // span, and the per-tile row bookkeeping), balanced at run time by taking over the back of unfinished ranges.
  std::vector<double> cost(B * Hq * tiles);
  for (int64_t idx = 0; idx < B * Hq * tiles; ++idx) {
    const int64_t ht = idx % (Hq * tiles);
    cost[idx] = static_cast<double>(span_hi[ht] - span_lo[ht]) + static_cast<double>(bias.T) + 16.0;
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B * Hq * tiles));
  WorkQueue queue(cost, contiguous_chunks(cost, threads));
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vsrc = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, threads, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> sc(block_m * block_n), br(block_n), acc(block_m * d), m(block_m), l(block_m);
    std::vector<T> pb(kHalf ? block_m * block_n : 0);
    thread_local std::vector<T> kbuf, vbuf;  // kept across calls: no page faults after the first
    PackedHead<T> kpack(kbuf, kHalf ? Layout::kKeysVnni : Layout::kTransposed), vpack(vbuf, Layout::kValuesVnni);
    int64_t packed = -1;  // the (batch, key head) in kbuf / vbuf
    TileRows tr;
    for (int64_t tid = tb; tid < te; ++tid) {
      int64_t first, last;
      while (queue.next(tid, kGrain, &first, &last)) for (int64_t item = first; item < last; ++item) {
        const int64_t bh = item / tiles, tl = item % tiles;
        const int64_t b = bh / Hq, h = bh % Hq, hk = h / group;
        const int64_t r0 = tl * block_m, rows = std::min(block_m, Lq - r0);
        const int64_t ht = h * tiles + tl;
        if (packed != b * Hkv + hk) {
          packed = b * Hkv + hk;
          kpack.reset(kp + packed * Lk * d, Lk, d, block_n);
          if constexpr (kHalf) vpack.reset(vsrc + packed * Lk * d, Lk, d, block_n);
        }
        build_rows(bias, h, q0 + r0, rows, tr);
        std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
        std::fill(m.begin(), m.end(), kNegInf);
        std::fill(l.begin(), l.end(), 0.f);
        const T* qt = qp + ((b * Hq + h) * Lq + r0) * d;
        const int64_t kb0 = span_lo[ht] / block_n, kb1 = std::min(nb, (span_hi[ht] + block_n - 1) / block_n);
        const T* kblocks = kb0 < kb1 ? kpack.ensure(kb0, kb1) : nullptr;
        const T* vblocks = kHalf && kb0 < kb1 ? vpack.ensure(kb0, kb1) : nullptr;
        for (int64_t kb = kb0; kb < kb1; ++kb) {
          const int64_t j0 = kb * block_n, bn = std::min(block_n, Lk - j0);
          int64_t ra, rb;
          live_rows(tr, j0, bn, ra, rb);
          if (ra >= rb) continue;
          Strip st[2];
          const int ns = strips(tr, j0, bn, ra, rb, kHalf, st);
          for (int i = 0; i < ns; ++i) {  // scores of each strip's rows over its columns
            const Strip& z = st[i];
            at::native::cpublas::brgemm(z.r1 - z.r0, z.c1 - z.c0, d, d, block_n, block_n, false, qt + z.r0 * d,
                                        kblocks + kb * d * block_n + z.c0 * (kHalf ? 2 : 1),
                                        sc.data() + z.r0 * block_n + z.c0, kHalf);
          }
          for (int64_t x = ra; x < rb; ++x) {
            float* s = sc.data() + x * block_n;
            const float* bp = nullptr;
            float cst = 0.f;
            bool mul;
            int64_t ka, kb;
            const int kind = bias_view(bias, h, tr, x, j0, bn, br.data(), &bp, &cst, &mul, &ka, &kb);
            if (kind == 0) {
              std::fill(s, s + bn, 0.f);
              continue;
            }
            std::fill(s, s + ka, 0.f);
            std::fill(s + kb, s + bn, 0.f);
            row_softmax(s + ka, kb - ka, scale, bp ? bp + ka : nullptr, cst, mul, m[x], l[x], acc.data() + x * d, d);
          }
          if constexpr (kHalf) {
            const int64_t bn2 = bn + bn % 2;  // VNNI pairs of keys: a zero probability pads an odd block
            for (int64_t x = ra; x < rb; ++x) {
              at::vec::convert(sc.data() + x * block_n, pb.data() + x * block_n, bn);
              if (bn2 > bn) pb[x * block_n + bn] = T(0.f);
            }
          }
          for (int i = 0; i < ns; ++i) {  // P V of each strip over its columns (the other probabilities are 0)
            const Strip& z = st[i];
            if constexpr (kHalf) {
              at::native::cpublas::brgemm(z.r1 - z.r0, d, z.c1 - z.c0, block_n, d, d, true,
                                          pb.data() + z.r0 * block_n + z.c0, vblocks + (kb * block_n + z.c0) * d,
                                          acc.data() + z.r0 * d, true);
            } else {
              at::native::cpublas::brgemm(z.r1 - z.r0, d, z.c1 - z.c0, block_n, d, d, true,
                                          sc.data() + z.r0 * block_n + z.c0, vsrc + ((b * Hkv + hk) * Lk + j0 + z.c0) * d,
                                          acc.data() + z.r0 * d, false);
            }
          }
        }
        T* ot = op + ((b * Hq + h) * Lq + r0) * d;
        float* lt = lp + (b * Hq + h) * Lq + r0;
        for (int64_t x = 0; x < rows; ++x) {
          if (l[x] > 0.f || std::isnan(l[x])) {  // NaN inputs: a NaN row
            scale_row(acc.data() + x * d, 1.f / l[x], d);
            at::vec::convert(acc.data() + x * d, ot + x * d, d);
            lt[x] = m[x] + std::log(l[x]);
          } else {
            std::fill(ot + x * d, ot + (x + 1) * d, static_cast<T>(0.f));
            lt[x] = kNegInf;
          }
        }
      }
    }
    at::native::cpublas::brgemm_release(kHalf);
    release_large(kbuf);
    release_large(vbuf);
  });
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& pitch, const at::Tensor& shift,
                                                     const at::Tensor& table, const at::Tensor& rtable,
                                                     const at::Tensor& reach, int64_t kind, bool causal,
                                                     double scale_d, int64_t block_m, int64_t block_n) {
  check_inputs(q, k, v, true);
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  const Bias bias = make_bias(kind, causal, pitch, shift, table, rtable, reach, k.size(2));
  TORCH_CHECK(bias.H == Hq, "the bias has one head per query head");
  TORCH_CHECK(block_n % 2 == 0, "block_n: even");
  auto out = at::empty_like(q);
  auto lse = at::empty({B, Hq, Lq}, q.options().dtype(at::kFloat));
  if (B * Hq * Lq == 0) return {out, lse};
  const float scale = static_cast<float>(scale_d);
  if (q.scalar_type() == at::kFloat) {
    forward_impl<float>(q, k, v, bias, scale, block_m, block_n, out, lse);
  } else {
    forward_impl<at::BFloat16>(q, k, v, bias, scale, block_m, block_n, out, lse);
  }
  return {out, lse};
}

// ---------------------------------------------------------------------------------------------------------------
// Backward (FA2: recompute P from lse). Per (batch, query head): dq, and dk, dv of that head (summed over the
// query heads of a key head at the end); with dist, dsum[b, h, x] = sum of dS over |i - j| = x.

inline void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst) {
  at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, static_cast<int>(rows), static_cast<int>(cols));
}

// y[0, n) += x[0, n)
inline void add_to(float* y, const float* x, int64_t n) {
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(y + j) + Vec::loadu(x + j)).store(y + j);
  for (; j < n; ++j) y[j] += x[j];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& pitch, const at::Tensor& shift, const at::Tensor& table,
    const at::Tensor& rtable, const at::Tensor& reach, int64_t kind, bool causal, double scale_d, bool dist,
    int64_t block_m, int64_t block_n) {
  check_inputs(q, k, v);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.is_contiguous() && dout.scalar_type() == at::kFloat, "dout");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat, "out");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.numel() == q.numel() / q.size(3), "lse");
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), d = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), group = Hq / Hkv;
  const Bias bias = make_bias(kind, causal, pitch, shift, table, rtable, reach, Lk);
  TORCH_CHECK(bias.H == Hq, "the bias has one head per query head");
  const float scale = static_cast<float>(scale_d);
  // Every output element is written by the loop below (no zero fill of fresh memory): dq per tile, dk and dv per
  // (batch, query head), into per-query-head buffers summed over each key head's group at the end where group > 1.
  auto dq = at::empty_like(q);
  auto dk = at::empty_like(k);
  auto dv = at::empty_like(v);
  auto dkh = group > 1 ? at::empty({B, Hq, Lk, d}, q.options()) : dk;
  auto dvh = group > 1 ? at::empty({B, Hq, Lk, d}, q.options()) : dv;
  auto dsum = at::zeros({B, Hq, dist ? Lk : 0}, q.options());
  if (B * Hq * Lq == 0) {
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dsum};
  }
  const int64_t nb = (Lk + block_n - 1) / block_n;
  const Spans sp = spans(bias, Hq, Lq, Lk, block_m);
  const int64_t tiles = sp.tiles, q0 = Lk - Lq;
  const std::vector<int64_t>&span_lo = sp.lo, &span_hi = sp.hi;
  std::vector<double> cost(B * Hq, 0.0);
  for (int64_t idx = 0; idx < B * Hq; ++idx) {
    const int64_t h = idx % Hq;
    for (int64_t tl = 0; tl < tiles; ++tl) cost[idx] += static_cast<double>(span_hi[h * tiles + tl] - span_lo[h * tiles + tl]);
  }
  auto lists = balance(cost, at::get_num_threads());
  for (auto& list : lists) std::sort(list.begin(), list.end());  // a key head's query heads in a row: packed once
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* dop = dout.data_ptr<float>();
  const float* outp = out.data_ptr<float>();
  const float* lp = lse.data_ptr<float>();
  float* dqp = dq.data_ptr<float>();
  float* dkp = dkh.data_ptr<float>();
  float* dvp = dvh.data_ptr<float>();
  float* dsp = dist ? dsum.data_ptr<float>() : nullptr;
  at::parallel_for(0, static_cast<int64_t>(lists.size()), 1, [&](int64_t tb, int64_t te) {
    std::vector<float> sc(block_m * block_n), dp(block_m * block_n), br(block_n), tp(block_n * block_m);
    std::vector<float> left, right, dl(block_m);
    std::vector<char> live(block_m);
    thread_local std::vector<float> kbuf, vbuf;  // one key head's K^T, V^T blocks, kept across calls
    PackedHead<float> kpack(kbuf, Layout::kTransposed), vpack(vbuf, Layout::kTransposed);
    int64_t packed = -1;
    TileRows tr;
    for (int64_t tid = tb; tid < te; ++tid) {
      for (int64_t bh : lists[tid]) {
        const int64_t b = bh / Hq, h = bh % Hq, hk = h / group;
        if (packed != b * Hkv + hk) {
          packed = b * Hkv + hk;
          kpack.reset(kp + packed * Lk * d, Lk, d, block_n);
          vpack.reset(vp + packed * Lk * d, Lk, d, block_n);
        }
        float* dkt = dkp + bh * Lk * d;
        float* dvt = dvp + bh * Lk * d;
        std::fill(dkt, dkt + Lk * d, 0.f);
        std::fill(dvt, dvt + Lk * d, 0.f);
        if (dist) {
          left.assign(Lk, 0.f);  // left[Lk - 1 - x]: dS summed over keys x to the left (i - j = x)
          right.assign(Lk, 0.f);  // right[x]: over keys x to the right (j - i = x)
        }
        for (int64_t tl = 0; tl < tiles; ++tl) {
          const int64_t r0 = tl * block_m, rows = std::min(block_m, Lq - r0);
          const int64_t ht = h * tiles + tl;
          build_rows(bias, h, q0 + r0, rows, tr);
          const float* qt = qp + (bh * Lq + r0) * d;
          const float* dot = dop + (bh * Lq + r0) * d;
          const float* lt = lp + bh * Lq + r0;
          float* dqt = dqp + (bh * Lq + r0) * d;
          std::fill(dqt, dqt + rows * d, 0.f);
          for (int64_t x = 0; x < rows; ++x) {  // delta = rowsum(dO * O)
            dl[x] = at::vec::map2_reduce_all<float>([](const Vec& a, const Vec& o) { return a * o; },
                                                    [](const Vec& a, const Vec& b) { return a + b; }, dot + x * d,
                                                    outp + (bh * Lq + r0 + x) * d, d);
          }
          const int64_t kb0 = span_lo[ht] / block_n, kb1 = std::min(nb, (span_hi[ht] + block_n - 1) / block_n);
          const float* kblocks = kb0 < kb1 ? kpack.ensure(kb0, kb1) : nullptr;
          const float* vblocks = kb0 < kb1 ? vpack.ensure(kb0, kb1) : nullptr;
          for (int64_t kb = kb0; kb < kb1; ++kb) {
            const int64_t j0 = kb * block_n, bn = std::min(block_n, Lk - j0);
            const int64_t kvo = kb * d * block_n;
            int64_t ra, rb;
            live_rows(tr, j0, bn, ra, rb);
            if (ra >= rb) continue;
            const int64_t mr = rb - ra;
            float* sr = sc.data() + ra * block_n;
            float* dr = dp.data() + ra * block_n;
            at::native::cpublas::brgemm(mr, bn, d, d, block_n, block_n, false, qt + ra * d, kblocks + kvo, sr,
                                        false);
            at::native::cpublas::brgemm(mr, bn, d, d, block_n, block_n, false, dot + ra * d, vblocks + kvo, dr,
                                        false);
            bool any = false;
            for (int64_t x = ra; x < rb; ++x) {
              float* s = sc.data() + x * block_n;
              float* g = dp.data() + x * block_n;
              const float* bp = nullptr;
              float cst = 0.f;
              bool mul;
              int64_t ka, kb;
              live[x] = bias_view(bias, h, tr, x, j0, bn, br.data(), &bp, &cst, &mul, &ka, &kb) != 0 &&
                        lt[x] != kNegInf;
              if (!live[x]) {
                std::fill(s, s + bn, 0.f);
                std::fill(g, g + bn, 0.f);
                continue;
              }
              any = true;
              // the kept keys [ka, kb) only: the others' P and dS are 0
              std::fill(s, s + ka, 0.f);
              std::fill(s + kb, s + bn, 0.f);
              std::fill(g, g + ka, 0.f);
              std::fill(g + kb, g + bn, 0.f);
              scale_add(s + ka, (mul || !bp) ? nullptr : bp + ka, mul ? 0.f : cst, scale, kb - ka);
              const Vec vl(lt[x]), vd(dl[x]), vc(cst);
              int64_t j = ka;
              for (; j + Vec::size() <= kb; j += Vec::size()) {
                Vec p = (Vec::loadu(s + j) - vl).exp_u20();
                if (mul) p = p * (bp ? Vec::loadu(bp + j) : vc);
                p.store(s + j);
                (p * (Vec::loadu(g + j) - vd)).store(g + j);  // dS
              }
              for (; j < kb; ++j) {
                s[j] = std::exp(s[j] - lt[x]) * (mul ? (bp ? bp[j] : cst) : 1.f);
                g[j] = s[j] * (g[j] - dl[x]);
              }
              if (dist) {
                const int64_t i = q0 + r0 + x;
                const int64_t mid = std::min(bn, std::max<int64_t>(0, i + 1 - j0));  // keys j0 .. i: i - j
                if (mid > 0) add_to(left.data() + (Lk - 1 - i + j0), g, mid);
                if (bn > mid) add_to(right.data() + (j0 + mid - i), g + mid, bn - mid);
              }
            }
            if (!any) continue;
            // dv += P^T dO; dk += dS^T Q; dq += dS K (scaled once per tile and per head below)
            transpose(sr, mr, bn, block_n, tp.data(), block_m);
            at::native::cpublas::brgemm(bn, d, mr, block_m, d, d, true, tp.data(), dot + ra * d, dvt + j0 * d, false);
            transpose(dr, mr, bn, block_n, tp.data(), block_m);
            at::native::cpublas::brgemm(bn, d, mr, block_m, d, d, true, tp.data(), qt + ra * d, dkt + j0 * d, false);
            at::native::cpublas::brgemm(mr, d, bn, block_n, d, d, true, dr, kp + (packed * Lk + j0) * d, dqt + ra * d,
                                        false);
          }
          scale_row(dqt, scale, rows * d);
        }
        scale_row(dkt, scale, Lk * d);
        if (dist) {
          float* ds = dsp + bh * Lk;
          for (int64_t x = 0; x < Lk; ++x) ds[x] = left[Lk - 1 - x] + right[x];
        }
      }
    }
    at::native::cpublas::brgemm_release(false);
    release_large(kbuf);
    release_large(vbuf);
  });
  if (group > 1) {  // dk, dv of a key head: the sum over its query heads
    const float* dkhp = dkh.data_ptr<float>();
    const float* dvhp = dvh.data_ptr<float>();
    float* dko = dk.data_ptr<float>();
    float* dvo = dv.data_ptr<float>();
    const int64_t per = Lk * d;
    at::parallel_for(0, B * Hkv * per, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end;) {
        const int64_t bk = e / per, off = e % per, len = std::min(end - e, per - off);
        const int64_t src = (bk / Hkv * Hq + bk % Hkv * group) * per + off;
        std::copy(dkhp + src, dkhp + src + len, dko + e);
        std::copy(dvhp + src, dvhp + src + len, dvo + e);
        for (int64_t gi = 1; gi < group; ++gi) {
          add_to(dko + e, dkhp + src + gi * per, len);
          add_to(dvo + e, dvhp + src + gi * per, len);
        }
        e += len;
      }
    });
  }
  return {dq, dk, dv, dsum};
}

}  // namespace

// How many of at::parallel_for's threads take part in a loop of at::get_num_threads() items: the build's check that
// the source was compiled with the parallel backend's flags (without -fopenmp every loop runs on one thread).
int64_t parallel_threads() {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> seen(static_cast<size_t>(n), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[static_cast<size_t>(at::get_thread_num())] = 1; });
  return std::accumulate(seen.begin(), seen.end(), int64_t{0});
}

TORCH_LIBRARY(plsh_cpu, m) {
  m.def("parallel_threads() -> int", &parallel_threads);
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, Tensor pitch, Tensor shift, Tensor table, Tensor rtable, "
      "Tensor reach, int kind, bool causal, float scale, int block_m, int block_n) -> (Tensor, Tensor)");
  m.def(
      "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor pitch, "
      "Tensor shift, Tensor table, Tensor rtable, Tensor reach, int kind, bool causal, float scale, bool dist, "
      "int block_m, int block_n) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(plsh_cpu, CPU, m) {
  m.impl("attention_forward", attention_forward);
  m.impl("attention_backward", attention_backward);
}
