// The bf16 dot interaction's forward on AMX: each sample's Gram matrix of [dense, sparse...] (n <= 32 vectors of
// width D <= 32) as at most three tile products, its upper triangle read out row by row. Written by hand because the
// lane-blocked kernel (dot_interaction.cpp) spends most of its time moving data, not multiplying: each block of
// samples transposed in, 351 pairs of `vdpbf16ps`, their sums transposed out (kaggle, 256 samples: about 0.3 us a
// sample on one AMX core), where a tile multiply takes a sample's whole 27 x 27 matrix at once. oneDNN's batched
// GEMM of such tiny matrices packs each sample's operands and costs more still (BENCHMARKS.md).
#pragma once

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace amx_triangle {

// Whether this CPU has AMX's bf16 tiles and Linux lets this process use them: a process asks once for the tiles'
// state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it the first tile instruction faults.
inline bool available() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Whether a forward of n vectors (dense first) of width D over these pairs takes this kernel: the tiles hold n <= 32
// rows and K = D <= 32 bf16, and the pairs are the upper triangle in row order (torch's `triu_indices(n, n, 1)`,
// the interaction's default; a sharded collection's order takes the lane-blocked kernel).
inline bool fits(int64_t n, int64_t D, const std::vector<int64_t>& first, const std::vector<int64_t>& second) {
  if (n < 2 || n > 32 || D < 2 || D > 32 || D % 2 != 0) return false;
  if (static_cast<int64_t>(first.size()) != n * (n - 1) / 2) return false;
  int64_t p = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i + 1; j < n; ++j, ++p)
      if (first[p] != i || second[p] != j) return false;
  return available();
}

struct alignas(64) Config {  // the tile configuration's memory layout (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-2 the products (rows 0-15 x cols 0-15, rows 0-15 x cols 16-, rows 16- x cols 16-; the fourth, below the
// diagonal, is never needed), 3-4 the sample's rows as A (rows 0-15, 16-), 5-6 its transposed words as B.
inline Config config(int64_t n, int64_t D) {
  Config c;
  const int low = static_cast<int>(std::min<int64_t>(n, 16)), high = static_cast<int>(n > 16 ? n - 16 : 0);
  const auto set = [&](int t, int rows, int bytes) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = static_cast<uint16_t>(bytes);
  };
  set(0, low, low * 4);
  set(3, low, static_cast<int>(2 * D));
  set(5, static_cast<int>(D / 2), low * 4);
  if (high) {
    set(1, low, high * 4);
    set(2, high, high * 4);
    set(4, high, static_cast<int>(2 * D));
    set(6, static_cast<int>(D / 2), high * 4);
  }
  return c;
}

// Index vectors of `words8`'s three stages of two-source permutes (a lane's source lane, +16 for the second)
struct Stages {
  alignas(64) int32_t one[2][16], two[2][16], three[2][16];
};
constexpr Stages stages() {
  Stages t{};
  for (int L = 0; L < 16; ++L)
    for (int h = 0; h < 2; ++h) {
      const int c1 = L / 4, r1 = 4 * h + L % 4;  // stage 1: rows 4m.. of words 4h..: lane (c - 4m) * 4 + (r - 4h)
      t.one[h][L] = (c1 < 2 ? 0 : 16) + (c1 % 2) * 8 + r1;
      const int c2 = L / 2, r2 = 2 * h + L % 2;  // stage 2: rows 8q.. of words 2h'..: lane (c - 8q) * 2 + (r - 2h')
      t.two[h][L] = (c2 < 4 ? 0 : 16) + (c2 % 4) * 4 + r2;  // h: h' % 2 (its stage-1 source holds 4 words)
      t.three[h][L] = (L < 8 ? 0 : 16) + (L % 8) * 2 + h;  // stage 3: rows 0-15 of word r: lane c; h: r % 2
    }
  return t;
}

// bt[r * 32 + c] = word r of row c, for 16 rows of 8 words (D = 16): in registers, three stages of 8 two-source
// permutes, each halving the words a vector holds and doubling its rows. A scalar copy took a third of the kernel.
__attribute__((target("avx512f"))) inline void words8(const uint32_t* rows, uint32_t* bt) {
  static constexpr Stages t = stages();
  __m512i v[8], w[8];
  for (int k = 0; k < 8; ++k) v[k] = _mm512_loadu_si512(rows + 16 * k);  // rows 2k, 2k + 1
  for (int m = 0; m < 4; ++m)
    for (int h = 0; h < 2; ++h)
      w[2 * m + h] = _mm512_permutex2var_epi32(v[2 * m], _mm512_load_si512(t.one[h]), v[2 * m + 1]);
  for (int q = 0; q < 2; ++q)  // w[2m + h]: rows 4m.., words 4h..
    for (int h2 = 0; h2 < 4; ++h2)
      v[4 * q + h2] = _mm512_permutex2var_epi32(w[4 * q + h2 / 2], _mm512_load_si512(t.two[h2 % 2]),
                                                w[4 * q + 2 + h2 / 2]);
  for (int r = 0; r < 8; ++r) {  // v[4q + h2]: rows 8q.., words 2h2..
    const __m512i index = _mm512_load_si512(t.three[r % 2]);
    _mm512_storeu_si512(bt + r * 32, _mm512_permutex2var_epi32(v[r / 2], index, v[4 + r / 2]));
  }
}

// Sample b's rows, its dense row then its F sparse rows, as bf16 `stride` values apart in `x` (fp32 sparse rows rounded
// as a cast before the call would round them): the tiles' A operand, or what B is made from.
template <typename S>
inline void sample_rows(const c10::BFloat16* dense, const S* sparse, int64_t b, int64_t F, int64_t D, int64_t stride,
                        uint16_t* x) {
  std::memcpy(x, dense + b * D, D * sizeof(uint16_t));
  const S* rows = sparse + b * F * D;
  for (int64_t f = 0, count = stride == D ? 1 : F, width = stride == D ? F * D : D; f < count; ++f) {
    uint16_t* to = x + stride + f * stride;  // contiguous rows: one copy of all of them
    if constexpr (std::is_same_v<S, float>) {
      at::vec::convert(rows + f * D, reinterpret_cast<c10::BFloat16*>(to), width);
    } else {
      std::memcpy(to, rows + f * D, width * sizeof(uint16_t));
    }
  }
}

// Samples [b0, b1): out row b = [dense row b, the triangle of its Gram matrix, zeros up to `row`]. S: the sparse
// rows' type, bf16 or float (rounded to bf16 as they are read, as a cast before the call would round them).
template <typename S>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void forward(
    const c10::BFloat16* dense, const S* sparse, int64_t b0, int64_t b1, int64_t n, int64_t D, int64_t row,
    c10::BFloat16* out) {
  const int64_t W = D / 2, F = n - 1, pairs = n * (n - 1) / 2;
  const bool high = n > 16;
  alignas(64) uint16_t x[32 * 32] = {};  // the sample's n rows of D bf16, contiguous (rows past n: read, unused)
  alignas(64) uint32_t bt[16 * 32];  // bt[r * 32 + c]: word r (coordinates 2r, 2r + 1) of row c
  alignas(64) float gram[32 * 32];
  const Config cfg = config(n, D);
  _tile_loadconfig(&cfg);
  for (int64_t b = b0; b < b1; ++b) {
    sample_rows(dense, sparse, b, F, D, D, x);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(x);
    if (W == 8) {
      words8(words, bt);
      if (high) words8(words + 16 * 8, bt + 16);
    } else {
      for (int64_t c = 0; c < n; ++c)
        for (int64_t r = 0; r < W; ++r) bt[r * 32 + c] = words[c * W + r];
    }
    _tile_loadd(3, x, 2 * D);
    _tile_loadd(5, bt, 128);
    _tile_zero(0);
    _tile_dpbf16ps(0, 3, 5);
    _tile_stored(0, gram, 128);
    if (high) {
      _tile_loadd(4, x + 16 * D, 2 * D);
      _tile_loadd(6, bt + 16, 128);
      _tile_zero(1);
      _tile_zero(2);
      _tile_dpbf16ps(1, 3, 6);
      _tile_dpbf16ps(2, 4, 6);
      _tile_stored(1, gram + 16, 128);
      _tile_stored(2, gram + 16 * 32 + 16, 128);
    }
    uint16_t* to = reinterpret_cast<uint16_t*>(out + b * row);
    std::memcpy(to, x, D * sizeof(uint16_t));
    int64_t at = D;
    for (int64_t i = 0; i + 1 < n; ++i) {  // row i's entries right of the diagonal: one masked vector each 16
      const float* from = gram + i * 32 + i + 1;
      for (int64_t left = n - 1 - i, k = 0; left > 0; left -= 16, k += 16) {
        const __mmask16 m = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, from + k));
        _mm256_mask_storeu_epi16(to + at + k, m, h);
      }
      at += n - 1 - i;
    }
    std::fill(to + D + pairs, to + row, uint16_t{0});
  }
  _tile_release();
}

// The backward of `forward` for widths D <= 16 (one tile of columns): d<a, b>/da = b, so the rows' gradient is
// G X, G the sample's pair gradients placed symmetrically (zero diagonal) in a 32 x 32 matrix, X its rows; one tile
// product per 16 rows, K = 32 (rows past n zero). The dense output's own gradient is added to row 0's. The lane kernel
// gathers each feature's gradient pair by pair (kaggle, 2,048 samples, AMX: 1.2 ms of a 17 ms training step).
inline bool fits_backward(int64_t n, int64_t D, const std::vector<int64_t>& first, const std::vector<int64_t>& second) {
  return D <= 16 && fits(n, D, first, second);
}

inline Config backward_config(int64_t D) {
  Config c;
  for (int t : {0, 1}) {  // the gradient's rows 0-15, 16-31: 16 x D fp32
    c.rows[t] = 16;
    c.colsb[t] = static_cast<uint16_t>(4 * D);
  }
  for (int t : {2, 3}) {  // G's rows 0-15, 16-31: 16 x 32 bf16
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  c.rows[4] = 16;  // X as VNNI pairs of rows: 16 x D pairs
  c.colsb[4] = static_cast<uint16_t>(4 * D);
  return c;
}

// Samples [b0, b1): grad_dense row b = the output gradient's first D + row 0 of G X; grad_sparse rows = rows 1.. of G X
// (S: bf16, or float where the embeddings came in fp32: their gradient is written in fp32, unrounded).
template <typename S>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void backward(
    const c10::BFloat16* grad, const c10::BFloat16* dense, const S* sparse, int64_t b0, int64_t b1, int64_t n,
    int64_t D, c10::BFloat16* grad_dense, S* grad_sparse) {
  const int64_t F = n - 1, row = D + n * (n - 1) / 2;
  alignas(64) uint16_t x[32 * 16] = {};  // the sample's rows, 16 bf16 apart (rows past n and columns past D zero)
  alignas(64) uint16_t pairs[16 * 32];  // x as VNNI pairs: pairs[k * 32 + 2 d + e] = x[2 k + e][d]
  alignas(64) uint16_t g[32 * 32] = {};  // G: the pair gradients, symmetric, zero diagonal
  alignas(64) float out[32 * 16];
  alignas(64) int16_t interleave[32];
  for (int k = 0; k < 16; ++k) {
    interleave[2 * k] = static_cast<int16_t>(k);
    interleave[2 * k + 1] = static_cast<int16_t>(16 + k);
  }
  const __m512i order = _mm512_load_si512(interleave);
  const Config cfg = backward_config(D);
  _tile_loadconfig(&cfg);
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* gr = reinterpret_cast<const uint16_t*>(grad + b * row);
    sample_rows(dense, sparse, b, F, D, 16, x);
    for (int k = 0; k < 16; ++k)  // rows 2k, 2k + 1 are one 64-byte line: interleaved in one permute
      _mm512_store_si512(pairs + k * 32, _mm512_permutexvar_epi16(order, _mm512_load_si512(x + k * 32)));
    int64_t p = D;
    for (int64_t i = 0; i + 1 < n; ++i) {
      const int64_t len = n - 1 - i;  // row i right of the diagonal, as the output holds it; column i below it
      const __mmask32 m = static_cast<__mmask32>((len >= 32 ? ~0ull : (1ull << len) - 1));
      _mm512_mask_storeu_epi16(g + i * 32 + i + 1, m, _mm512_maskz_loadu_epi16(m, gr + p));
      for (int64_t j = 0; j < len; ++j) g[(i + 1 + j) * 32 + i] = gr[p + j];
      p += len;
    }
    _tile_loadd(2, g, 64);
    _tile_loadd(3, g + 16 * 32, 64);
    _tile_loadd(4, pairs, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
    _tile_stored(0, out, 64);
    _tile_stored(1, out + 16 * 16, 64);
    for (int64_t d = 0; d < D; ++d)
      grad_dense[b * D + d] = c10::BFloat16(static_cast<float>(c10::BFloat16(grad[b * row + d])) + out[d]);
    for (int64_t f = 0; f < F; ++f) {
      const float* from = out + (f + 1) * 16;
      S* to = grad_sparse + (b * F + f) * D;
      if constexpr (std::is_same_v<S, float>) {
        std::memcpy(to, from, D * sizeof(float));
      } else {
        at::vec::convert(from, to, D);
      }
    }
  }
  _tile_release();
}

}  // namespace amx_triangle
#endif
