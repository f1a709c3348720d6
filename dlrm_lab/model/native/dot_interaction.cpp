// The DLRM dot interaction on CPU: each sample's pairwise dot products of [dense, sparse...] (F + 1 vectors of
// width D), the pairs chosen by flat index into the (F + 1) x (F + 1) Gram matrix. Written by hand because
// torch's ways are a batched GEMM of tiny matrices (27 x 16 at kaggle: oneDNN, MKL and Inductor's template pack
// each sample's operands) followed by a gather of the triangle, about 1 us a sample on one AMX core; here a block
// of samples is transposed so that a vector holds one coordinate of as many samples as it has lanes, and every
// pair is D fused multiply-adds on full vectors (no packing, no horizontal sums, no gather).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "amx_triangle.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();  // samples a block holds: one fp32 vector's lanes
constexpr int64_t kTile = 8;  // coordinates of one feature's gradient a backward keeps in registers at once

struct Shape {
  int64_t batch, features, width, pairs;  // features: F + 1 (dense first)
};

Shape check(const at::Tensor& dense, const at::Tensor& sparse, const at::Tensor& pairs) {
  TORCH_CHECK(dense.dim() == 2 && sparse.dim() == 3, "dot_interaction: dense B x D and sparse B x F x D expected, got ",
              dense.sizes(), " and ", sparse.sizes());
  TORCH_CHECK(sparse.size(0) == dense.size(0) && sparse.size(2) == dense.size(1),
              "dot_interaction: dense ", dense.sizes(), " and sparse ", sparse.sizes(), " disagree");
  TORCH_CHECK(dense.scalar_type() == sparse.scalar_type() ||
                  (sparse.scalar_type() == at::kFloat &&
                   (dense.scalar_type() == at::kBFloat16 || dense.scalar_type() == at::kHalf)),
              "dot_interaction: dense ", dense.scalar_type(), " and sparse ", sparse.scalar_type(),
              " differ (only fp32 sparse beside bf16 or fp16 dense may)");
  TORCH_CHECK(pairs.dim() == 1 && pairs.scalar_type() == at::kLong, "dot_interaction: pairs must be 1-D int64");
  return {dense.size(0), sparse.size(1) + 1, dense.size(1), pairs.size(0)};
}

// Each pair's two rows of the Gram matrix, checked against its size once. The row by a multiply, not a division:
// (p + 0.5) / n lies at least 0.5 / n from a whole number, far beyond a double's error at these sizes; 351
// integer divisions took as long as the products of a one-sample batch.
void split_pairs(const at::Tensor& pairs, int64_t n, std::vector<int64_t>& first, std::vector<int64_t>& second) {
  auto flat = pairs.contiguous();
  const int64_t* p = flat.data_ptr<int64_t>();
  const int64_t count = flat.numel();
  first.resize(count);
  second.resize(count);
  int64_t low = 0, high = 0;
  const double inv = 1.0 / static_cast<double>(n);
  for (int64_t k = 0; k < count; ++k) {
    low = std::min(low, p[k]);
    high = std::max(high, p[k]);
    first[k] = static_cast<int64_t>((static_cast<double>(p[k]) + 0.5) * inv);
    second[k] = p[k] - first[k] * n;
  }
  TORCH_CHECK(low >= 0 && high < n * n, "dot_interaction: pair indices from ", low, " to ", high, " outside the ", n,
              " x ", n, " Gram matrix");
}

// A thread's scratch, kept between calls (a call allocates and zeroes nothing it need not), on a cache line: a
// vector load from malloc's 16-byte alignment spans two lines, and the pairs' loads are most of the kernel.
float* scratch(int which, size_t size) {
  constexpr size_t kLine = 64 / sizeof(float);
  thread_local std::vector<float> buffers[6];
  auto& b = buffers[which];
  if (b.size() < size + kLine) b.resize(size + kLine);
  const auto at = reinterpret_cast<uintptr_t>(b.data());
  return b.data() + (kLine - (at / sizeof(float)) % kLine) % kLine;
}

// dst[j * ldd + i] = src[i * lds + j] for i < M, j < N. ATen's `transpose_mxn` copies its register arrays through
// memory (`rep movsq`) in this build: twice the pairs' own time; here 16 x 16 tiles stay in registers.
// E: float, or a 32-bit word holding two bf16 (moved, never computed on: the shuffles keep every bit).
template <typename E>
void transpose(const E* src, int64_t lds, E* dst, int64_t ldd, int64_t M, int64_t N) {
  static_assert(sizeof(E) == 4);
  int64_t i0 = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i0 + 16 <= M; i0 += 16) {
    int64_t j0 = 0;
    for (; j0 + 16 <= N; j0 += 16) {
      __m512 r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(src + (i0 + i) * lds + j0));
      for (int m = 0; m < 16; m += 2) {  // within each 4-column lane: rows paired
        t[m] = _mm512_unpacklo_ps(r[m], r[m + 1]);
        t[m + 1] = _mm512_unpackhi_ps(r[m], r[m + 1]);
      }
      for (int q = 0; q < 16; q += 4) {  // r[q + c], lane k: column 4k + c of rows q..q + 3
        const __m512d a = _mm512_castps_pd(t[q]), b = _mm512_castps_pd(t[q + 2]);
        const __m512d c = _mm512_castps_pd(t[q + 1]), d = _mm512_castps_pd(t[q + 3]);
        r[q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
      }
      for (int c = 0; c < 4; ++c) {  // column 4k + c: lane k of r[c], r[4 + c], r[8 + c], r[12 + c]
        const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
        const __m512 w0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
        const __m512 w1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        float* to = reinterpret_cast<float*>(dst + (j0 + c) * ldd + i0);
        _mm512_storeu_ps(to, _mm512_shuffle_f32x4(v0, w0, 0x88));
        _mm512_storeu_ps(to + 4 * ldd, _mm512_shuffle_f32x4(v0, w0, 0xDD));
        _mm512_storeu_ps(to + 8 * ldd, _mm512_shuffle_f32x4(v1, w1, 0x88));
        _mm512_storeu_ps(to + 12 * ldd, _mm512_shuffle_f32x4(v1, w1, 0xDD));
      }
    }
    for (int64_t i = i0; i < i0 + 16; ++i)
      for (int64_t j = j0; j < N; ++j) dst[j * ldd + i] = src[i * lds + j];
  }
#endif
  for (int64_t i = i0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) dst[j * ldd + i] = src[i * lds + j];
}

// Rows [count x cols] of T (leading dimension ld) as float into `to` [count x cols] (leading dimension cols).
template <typename T>
const float* as_float(const T* rows, int64_t ld, int64_t count, int64_t cols, float* to) {
  if constexpr (std::is_same_v<T, float>) {
    return rows;  // read in place: the caller's transpose takes `ld`
  } else {
    for (int64_t k = 0; k < count; ++k) at::vec::convert(rows + k * ld, to + k * cols, cols);
    return to;
  }
}

// A block of up to kLanes samples of [dense, sparse...] as float, coordinate-major: block[(f * D + d) * kLanes + s]
// (lanes past `count` hold zeros). `stage`: count x (F + 1) * D floats of room for a conversion.
// `dense` and `sparse`: the block's first rows.
template <typename T>
void load_block(const T* dense, const T* sparse, int64_t count, const Shape& s, float* stage, float* block) {
  const int64_t F = s.features - 1, D = s.width;
  if (count < kLanes) std::fill(block, block + s.features * D * kLanes, 0.f);
  const float* dn = as_float(dense, D, count, D, stage);
  transpose(dn, D, block, kLanes, count, D);
  const float* sp = as_float(sparse, F * D, count, F * D, stage);
  transpose(sp, F * D, block + D * kLanes, kLanes, count, F * D);
}

// The block's sparse rows in the compute dtype T: in place where they are stored in it, else rounded into `room`
// (count x F * D), as a cast before the call would round them. fp32 embeddings beside a bf16 dense part (autocast)
// are read as they are, and their gradient written in fp32: a cast each way outside took 0.7-0.9 ms of a kaggle
// training step at 2048 samples (Zen 5), most of it the backward's, against 0.06-0.11 ms alone.
template <typename T, typename S>
const T* sparse_rows(const S* sparse, int64_t b0, int64_t count, int64_t FD, T* room) {
  if constexpr (std::is_same_v<T, S>) {
    return sparse + b0 * FD;
  } else {
    at::vec::convert(sparse + b0 * FD, room, count * FD);
    return room;
  }
}

// `load_block` for bf16 (only: `words` says so) read as 32-bit words, two coordinates each, moved not converted:
// block[(f * D / 2 + k) * kLanes + s] (lanes past `count` hold zeros). The rows must start on a word.
template <typename T>
const uint32_t* load_words(const T* dense, const T* sparse, int64_t count, const Shape& s, uint32_t* block) {
  const int64_t F = s.features - 1, D = s.width, W = D / 2;
  if (count < kLanes) std::fill(block, block + s.features * W * kLanes, 0u);
  transpose(reinterpret_cast<const uint32_t*>(dense), W, block, kLanes, count, W);
  transpose(reinterpret_cast<const uint32_t*>(sparse), F * W, block + W * kLanes, kLanes, count, F * W);
  return block;
}

// Each listed pair's dot product, for every lane: dots[p * kLanes + s]. Four pairs at a time, each its own
// accumulator, so that the fused multiply-adds do not wait on one another.
void pair_dots(const float* block, const int64_t* first, const int64_t* second, int64_t P, int64_t D, float* dots) {
  int64_t p = 0;
  const int64_t stride = D * kLanes;
  for (; p + 4 <= P; p += 4) {
    const float *a0 = block + first[p] * stride, *b0 = block + second[p] * stride;
    const float *a1 = block + first[p + 1] * stride, *b1 = block + second[p + 1] * stride;
    const float *a2 = block + first[p + 2] * stride, *b2 = block + second[p + 2] * stride;
    const float *a3 = block + first[p + 3] * stride, *b3 = block + second[p + 3] * stride;
    Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
    for (int64_t d = 0; d < stride; d += kLanes) {
      s0 = at::vec::fmadd(Vec::loadu(a0 + d), Vec::loadu(b0 + d), s0);
      s1 = at::vec::fmadd(Vec::loadu(a1 + d), Vec::loadu(b1 + d), s1);
      s2 = at::vec::fmadd(Vec::loadu(a2 + d), Vec::loadu(b2 + d), s2);
      s3 = at::vec::fmadd(Vec::loadu(a3 + d), Vec::loadu(b3 + d), s3);
    }
    s0.store(dots + p * kLanes);
    s1.store(dots + (p + 1) * kLanes);
    s2.store(dots + (p + 2) * kLanes);
    s3.store(dots + (p + 3) * kLanes);
  }
  for (; p < P; ++p) {
    const float *a = block + first[p] * stride, *b = block + second[p] * stride;
    Vec acc(0.f);
    for (int64_t d = 0; d < stride; d += kLanes) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
    acc.store(dots + p * kLanes);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16 served: a block as 32-bit words, block[(f * D / 2 + k) * kLanes + s] the k-th pair of coordinates of feature
// f in sample s, so that one `vdpbf16ps` takes two coordinates of 16 samples: half the instructions and half the
// bytes of the fp32 block, and no conversion in (each product of two bf16 is exact in fp32; the sums are rounded
// as fused multiply-adds round them, in another order).
__attribute__((target("avx512bf16"))) inline __m512 dot(__m512 acc, const uint32_t* a, const uint32_t* b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
}

__attribute__((target("avx512bf16"))) void pair_dots_bf16_any(const uint32_t* block, const int64_t* first,
                                                            const int64_t* second, int64_t P, int64_t words,
                                                            float* dots) {
  const int64_t stride = words * 16;
  int64_t p = 0;
  for (; p + 4 <= P; p += 4) {
    const uint32_t *a0 = block + first[p] * stride, *b0 = block + second[p] * stride;
    const uint32_t *a1 = block + first[p + 1] * stride, *b1 = block + second[p + 1] * stride;
    const uint32_t *a2 = block + first[p + 2] * stride, *b2 = block + second[p + 2] * stride;
    const uint32_t *a3 = block + first[p + 3] * stride, *b3 = block + second[p + 3] * stride;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t k = 0; k < stride; k += 16) {
      s0 = dot(s0, a0 + k, b0 + k);
      s1 = dot(s1, a1 + k, b1 + k);
      s2 = dot(s2, a2 + k, b2 + k);
      s3 = dot(s3, a3 + k, b3 + k);
    }
    _mm512_storeu_ps(dots + p * 16, s0);
    _mm512_storeu_ps(dots + (p + 1) * 16, s1);
    _mm512_storeu_ps(dots + (p + 2) * 16, s2);
    _mm512_storeu_ps(dots + (p + 3) * 16, s3);
  }
  for (; p < P; ++p) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < stride; k += 16) acc = dot(acc, block + first[p] * stride + k, block + second[p] * stride + k);
    _mm512_storeu_ps(dots + p * 16, acc);
  }
}

// `W` words a feature (D = 2W) held in registers: the pairs of a run that share their first feature (the triangle's
// order) load it once, and each product reads one operand from memory instead of two, eight pairs at once. kaggle,
// 256 and 2,048 samples, AMX: the whole forward 0.93-0.95x `pair_dots_bf16_any`'s (alternating processes).
template <int W>
__attribute__((target("avx512bf16"))) void pair_dots_bf16_held(const uint32_t* block, const int64_t* first,
                                                                 const int64_t* second, int64_t P, float* dots) {
  constexpr int64_t stride = W * 16;
  constexpr int kAcc = 8;  // pairs at once, each its own accumulator: `vdpbf16ps` waits on its accumulator
  int64_t p = 0;
  while (p < P) {
    const int64_t f = first[p];
    int64_t end = p + 1;
    while (end < P && first[end] == f) ++end;
    __m512bh a[W];
    for (int k = 0; k < W; ++k) a[k] = (__m512bh)_mm512_loadu_si512(block + f * stride + k * 16);
    for (; p + kAcc <= end; p += kAcc) {
      const uint32_t* b[kAcc];
      __m512 acc[kAcc];
      for (int j = 0; j < kAcc; ++j) {
        b[j] = block + second[p + j] * stride;
        acc[j] = _mm512_setzero_ps();
      }
      for (int k = 0; k < W; ++k)
        for (int j = 0; j < kAcc; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], a[k], (__m512bh)_mm512_loadu_si512(b[j] + k * 16));
      for (int j = 0; j < kAcc; ++j) _mm512_storeu_ps(dots + (p + j) * 16, acc[j]);
    }
    for (; p < end; ++p) {
      const uint32_t* b = block + second[p] * stride;
      __m512 acc = _mm512_setzero_ps();
      for (int k = 0; k < W; ++k) acc = _mm512_dpbf16_ps(acc, a[k], (__m512bh)_mm512_loadu_si512(b + k * 16));
      _mm512_storeu_ps(dots + p * 16, acc);
    }
  }
}

void pair_dots_bf16(const uint32_t* block, const int64_t* first, const int64_t* second, int64_t P, int64_t words,
                    float* dots) {
  if (words == 8) return pair_dots_bf16_held<8>(block, first, second, P, dots);
  if (words == 4) return pair_dots_bf16_held<4>(block, first, second, P, dots);
  if (words == 16) return pair_dots_bf16_held<16>(block, first, second, P, dots);
  pair_dots_bf16_any(block, first, second, P, words, dots);
}
#endif

// Whether a bf16 forward takes `pair_dots_bf16`: a CPU with AVX512_BF16 (Inductor's AVX-512 flags leave it out on
// Zen 4), 16 lanes, an even width.
bool bf16_dots(const Shape& s) {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool cpu = __builtin_cpu_supports("avx512bf16");
  return cpu && kLanes == 16 && s.width % 2 == 0;
#else
  return false;
#endif
}

// Rows [count x cols] of float (leading dimension cols) into T rows (leading dimension ld).
template <typename T>
void store_rows(const float* rows, int64_t count, int64_t cols, T* to, int64_t ld) {
  for (int64_t k = 0; k < count; ++k) at::vec::convert(rows + k * cols, to + k * ld, cols);
}

template <typename T, typename S>
void forward_kernel(const at::Tensor& dense, const at::Tensor& sparse, const std::vector<int64_t>& first,
                    const std::vector<int64_t>& second, const Shape& s, at::Tensor& out) {
  const T* dn = dense.data_ptr<T>();
  const S* sp = sparse.data_ptr<S>();
  T* o = out.data_ptr<T>();
  // row: the output's width, D + P or wider (`dot_interaction_padded`: zero columns up to the next GEMM's K)
  const int64_t D = s.width, P = s.pairs, FD = (s.features - 1) * D, row = out.size(1);
#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (amx_triangle::fits(s.features, D, first, second)) {  // a sample's Gram matrix as tile products
      at::parallel_for(0, s.batch, 64, [&](int64_t begin, int64_t end) {
        amx_triangle::forward<S>(dn, sp, begin, end, s.features, D, row, o);
      });
      return;
    }
  }
#endif
  const int64_t blocks = (s.batch + kLanes - 1) / kLanes;
  bool words = false;
  if constexpr (std::is_same_v<T, at::BFloat16>)  // words read whole: the rows must start on a word
    words = bf16_dots(s) && reinterpret_cast<uintptr_t>(dn) % 4 == 0 &&
            (!std::is_same_v<S, T> || reinterpret_cast<uintptr_t>(sp) % 4 == 0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float* block = scratch(0, s.features * D * kLanes);
    float* dots = scratch(1, P * kLanes);
    float* stage = scratch(2, kLanes * std::max(s.features * D, P));
    T* room = reinterpret_cast<T*>(scratch(5, std::is_same_v<S, T> ? 0 : kLanes * FD));
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t b0 = blk * kLanes, count = std::min(kLanes, s.batch - b0);
      const T* sr = sparse_rows(sp, b0, count, FD, room);
#if defined(CPU_CAPABILITY_AVX512)
      if (words) {
        const uint32_t* w = load_words(dn + b0 * D, sr, count, s, reinterpret_cast<uint32_t*>(block));
        pair_dots_bf16(w, first.data(), second.data(), P, D / 2, dots);
      } else
#endif
      {
        load_block(dn + b0 * D, sr, count, s, stage, block);
        pair_dots(block, first.data(), second.data(), P, D, dots);
      }
      for (int64_t k = 0; k < count; ++k) {
        std::copy(dn + (b0 + k) * D, dn + (b0 + k + 1) * D, o + (b0 + k) * row);
        std::fill(o + (b0 + k) * row + D + P, o + (b0 + k + 1) * row, T(0));
      }
      if constexpr (std::is_same_v<T, float>) {
        transpose(dots, kLanes, o + b0 * row + D, row, P, count);
      } else {
        transpose(dots, kLanes, stage, P, P, count);
        store_rows(stage, count, P, o + b0 * row + D, row);
      }
    }
  });
}

template <typename T, typename S>
void backward_kernel(const at::Tensor& grad, const at::Tensor& dense, const at::Tensor& sparse,
                     const std::vector<int64_t>& first, const std::vector<int64_t>& second, const Shape& s,
                     at::Tensor& grad_dense, at::Tensor& grad_sparse) {
  const T* g = grad.data_ptr<T>();
  const T* dn = dense.data_ptr<T>();
  const S* sp = sparse.data_ptr<S>();
  T* gd = grad_dense.data_ptr<T>();
  S* gs = grad_sparse.data_ptr<S>();
#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (amx_triangle::fits_backward(s.features, s.width, first, second)) {  // G X as tile products
      at::parallel_for(0, s.batch, 64, [&](int64_t begin, int64_t end) {
        amx_triangle::backward<S>(g, dn, sp, begin, end, s.features, s.width, gd, gs);
      });
      return;
    }
  }
#endif
  const int64_t D = s.width, P = s.pairs, F = s.features - 1, row = D + P, blocks = (s.batch + kLanes - 1) / kLanes;
  const int64_t stride = D * kLanes, n = s.features;
  // d<a, b>/da = b, d<a, b>/db = a: each feature's gradient gathered from the pairs it is in (`terms`: for feature i,
  // the pairs' (p, other) in order), in registers a tile of coordinates at a time, written once. Scattered pair by
  // pair instead, every product read and wrote the gradient's block in memory: the backward took 3.6x the forward
  // (kaggle bf16, 2,048 samples, Zen 4: 1.21 against 0.33 ms).
  std::vector<int64_t> starts(n + 1, 0), terms(4 * P);
  for (int64_t p = 0; p < P; ++p) {
    ++starts[first[p] + 1];
    ++starts[second[p] + 1];
  }
  for (int64_t i = 0; i < n; ++i) starts[i + 1] += starts[i];
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t p = 0; p < P; ++p) {
      terms[2 * next[first[p]]] = p, terms[2 * next[first[p]]++ + 1] = second[p];
      terms[2 * next[second[p]]] = p, terms[2 * next[second[p]]++ + 1] = first[p];
    }
  }
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float* block = scratch(0, n * stride);
    float* to = scratch(1, n * stride);
    float* pair_grad = scratch(2, P * kLanes);
    float* stage = scratch(3, kLanes * std::max(n * D, row));
    float* rows = scratch(4, kLanes * n * D);
    T* room = reinterpret_cast<T*>(scratch(5, std::is_same_v<S, T> ? 0 : kLanes * F * D));
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t b0 = blk * kLanes, count = std::min(kLanes, s.batch - b0);
      load_block(dn + b0 * D, sparse_rows(sp, b0, count, F * D, room), count, s, stage, block);
      const float* gf = as_float(g + b0 * row, row, count, row, stage);
      if (count < kLanes) std::fill(pair_grad, pair_grad + P * kLanes, 0.f);
      transpose(gf + D, row, pair_grad, kLanes, count, P);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t* term = terms.data() + 2 * starts[i];
        const int64_t many = starts[i + 1] - starts[i];
        float* ti = to + i * stride;
        int64_t d0 = 0;
        for (; d0 + kTile <= D; d0 += kTile) {
          Vec acc[kTile];
          for (int64_t t = 0; t < kTile; ++t) acc[t] = Vec(0.f);
          for (int64_t k = 0; k < many; ++k) {
            const Vec gp = Vec::loadu(pair_grad + term[2 * k] * kLanes);
            const float* x = block + term[2 * k + 1] * stride + d0 * kLanes;
            for (int64_t t = 0; t < kTile; ++t) acc[t] = at::vec::fmadd(gp, Vec::loadu(x + t * kLanes), acc[t]);
          }
          for (int64_t t = 0; t < kTile; ++t) acc[t].store(ti + (d0 + t) * kLanes);
        }
        for (; d0 < D; ++d0) {  // a width not a whole number of tiles: its last coordinates one at a time
          Vec acc(0.f);
          for (int64_t k = 0; k < many; ++k)
            acc = at::vec::fmadd(Vec::loadu(pair_grad + term[2 * k] * kLanes),
                                 Vec::loadu(block + term[2 * k + 1] * stride + d0 * kLanes), acc);
          acc.store(ti + d0 * kLanes);
        }
      }
      transpose(to, kLanes, rows, n * D, n * D, count);
      for (int64_t k = 0; k < count; ++k) {  // the dense part's own gradient passes through
        float* r = rows + k * n * D;
        for (int64_t d = 0; d < D; ++d) r[d] += gf[k * row + d];
      }
      for (int64_t k = 0; k < count; ++k) {
        at::vec::convert(rows + k * n * D, gd + (b0 + k) * D, D);
        at::vec::convert(rows + k * n * D + D, gs + (b0 + k) * F * D, F * D);
      }
    }
  });
}

// width: the output's, or -1 for D + P
at::Tensor interact(const at::Tensor& dense_in, const at::Tensor& sparse_in, const at::Tensor& pairs, int64_t width) {
  const Shape s = check(dense_in, sparse_in, pairs);
  if (width == -1) width = s.width + s.pairs;
  TORCH_CHECK(width >= s.width + s.pairs, "dot_interaction_padded: a width of ", width, " is narrower than the ",
              s.width + s.pairs, " outputs");
  auto dense = dense_in.contiguous();
  auto sparse = sparse_in.contiguous();
  std::vector<int64_t> first, second;
  split_pairs(pairs, s.features, first, second);
  auto out = at::empty({s.batch, width}, dense.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dense.scalar_type(), "dot_interaction", [&] {
    if (sparse.scalar_type() == dense.scalar_type())
      forward_kernel<scalar_t, scalar_t>(dense, sparse, first, second, s, out);
    else
      forward_kernel<scalar_t, float>(dense, sparse, first, second, s, out);
  });
  return out;
}

at::Tensor dot_interaction(const at::Tensor& dense, const at::Tensor& sparse, const at::Tensor& pairs) {
  return interact(dense, sparse, pairs, -1);
}

at::Tensor dot_interaction_padded(const at::Tensor& dense, const at::Tensor& sparse, const at::Tensor& pairs,
                                  int64_t width) {
  TORCH_CHECK(width >= 0, "dot_interaction_padded: a width of ", width, " is negative");
  return interact(dense, sparse, pairs, width);
}

std::tuple<at::Tensor, at::Tensor> dot_interaction_backward(const at::Tensor& grad_in, const at::Tensor& dense_in,
                                                            const at::Tensor& sparse_in, const at::Tensor& pairs) {
  const Shape s = check(dense_in, sparse_in, pairs);
  TORCH_CHECK(grad_in.dim() == 2 && grad_in.size(0) == s.batch && grad_in.size(1) == s.width + s.pairs,
              "dot_interaction_backward: grad ", grad_in.sizes(), " is not the output's shape");
  auto dense = dense_in.contiguous();
  auto sparse = sparse_in.contiguous();
  auto grad = grad_in.to(dense.scalar_type()).contiguous();
  std::vector<int64_t> first, second;
  split_pairs(pairs, s.features, first, second);
  auto grad_dense = at::empty_like(dense);
  auto grad_sparse = at::empty_like(sparse);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dense.scalar_type(), "dot_interaction_backward", [&] {
    if (sparse.scalar_type() == dense.scalar_type())
      backward_kernel<scalar_t, scalar_t>(grad, dense, sparse, first, second, s, grad_dense, grad_sparse);
    else
      backward_kernel<scalar_t, float>(grad, dense, sparse, first, second, s, grad_dense, grad_sparse);
  });
  return {grad_dense, grad_sparse};
}

// Autograd in C++: a kernel registered from Python (torch.library.register_autograd) would take the GIL on every
// call, from an AOTInductor package's C++ too (30 us of a one-sample batch's 100).
class DotInteractionFunction : public torch::autograd::Function<DotInteractionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& dense, const at::Tensor& sparse,
                            const at::Tensor& pairs) {
    ctx->save_for_backward({dense, sparse, pairs});
    at::AutoDispatchBelowADInplaceOrView guard;  // through the dispatcher: a fake tensor (export) meets its fake kernel
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("dlrm_lab::dot_interaction", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    return op.call(dense, sparse, pairs);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("dlrm_lab::dot_interaction_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&)>();
    auto [grad_dense, grad_sparse] = op.call(grads[0], saved[0], saved[1], saved[2]);
    return {grad_dense, grad_sparse, at::Tensor()};
  }
};

at::Tensor dot_interaction_autograd(const at::Tensor& dense, const at::Tensor& sparse, const at::Tensor& pairs) {
  return DotInteractionFunction::apply(dense, sparse, pairs);
}

}  // namespace

TORCH_LIBRARY(dlrm_lab, m) {
  m.def("dot_interaction(Tensor dense, Tensor sparse, Tensor pairs) -> Tensor");
  m.def("dot_interaction_backward(Tensor grad, Tensor dense, Tensor sparse, Tensor pairs) -> (Tensor, Tensor)");
  // serving's: the output written `width` wide, zero beyond the pairs, where the next GEMM computes at a wider K
  // (`infer.gemm_widths`): no pad op between them (Inductor's took 85 us of a 256-sample kaggle batch, AMX)
  m.def("dot_interaction_padded(Tensor dense, Tensor sparse, Tensor pairs, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(dlrm_lab, CPU, m) {
  m.impl("dot_interaction", &dot_interaction);
  m.impl("dot_interaction_backward", &dot_interaction_backward);
  m.impl("dot_interaction_padded", &dot_interaction_padded);
}

TORCH_LIBRARY_IMPL(dlrm_lab, Autograd, m) { m.impl("dot_interaction", &dot_interaction_autograd); }
