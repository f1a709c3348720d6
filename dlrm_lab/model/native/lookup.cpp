// A served batch's pooled table lookup over fbgemm's inference layout (one uint8 buffer of every table's rows, each
// row fp32, fp16, int8 or int4 with its fp16 scale and bias in front, padded to the row alignment), every feature's
// bags in one loop. Written by hand because fbgemm's CPU op pays about 1.2 us a feature a call whatever its bags
// (it looks up and runs a JIT kernel per table): 26 features cost a 1-sample batch ~31 us of its ~160, where the
// rows themselves are 26 cache lines. Same inputs and outputs as `int_nbit_split_embedding_codegen_lookup_function`
// (sum or mean pooling, no per-id weights), so a package can take either.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <vector>

namespace {

// fbgemm's SparseType values (fbgemm_gpu.split_embedding_configs)
constexpr int64_t kFP32 = 0, kFP16 = 1, kINT8 = 2, kINT4 = 3, kBF16 = 5;
constexpr int64_t kScaleBias = 4;  // fbgemm's DEFAULT_SCALE_BIAS_SIZE_IN_BYTES: fp16 scale, fp16 bias, in front
constexpr int64_t kSum = 0, kMean = 1;
constexpr int64_t kAhead = 16;  // lines of rows fetched ahead of the row pooled

int64_t row_bytes(int64_t ty, int64_t dim, int64_t alignment) {
  int64_t bytes = 0;
  switch (ty) {
    case kFP32: bytes = dim * 4; break;
    case kFP16: bytes = dim * 2; break;
    case kINT8: bytes = dim + kScaleBias; break;
    case kINT4: bytes = dim / 2 + kScaleBias; break;
    default: TORCH_CHECK(false, "pooled_lookup: table type ", ty, " is not fp32, fp16, int8 or int4");
  }
  return alignment > 1 ? (bytes + alignment - 1) / alignment * alignment : bytes;
}

using Vec = at::vec::Vectorized<float>;

// An int8 or int4 row's fp16 scale and bias, in front of its values, as floats.
inline std::pair<float, float> scale_bias(const uint8_t* row) {
  c10::Half sb[2];
  std::memcpy(sb, row, sizeof sb);
  return {static_cast<float>(sb[0]), static_cast<float>(sb[1])};
}

// value d of an int4 row's values `q`: two a byte, the low nibble first
inline float nibble(const uint8_t* q, int64_t d) { return (q[d / 2] >> (4 * (d % 2))) & 0xF; }

// values d..d+Vec::size() of a row of type Ty as floats
template <int64_t Ty>
inline Vec load_row(const uint8_t* row, int64_t d) {
  if constexpr (Ty == kFP32) {
    return Vec::loadu(reinterpret_cast<const float*>(row) + d);
  } else if constexpr (Ty == kFP16) {
    Vec v;
    at::vec::load_fp32_from_fp16(reinterpret_cast<const c10::Half*>(row) + d, v);
    return v;
  } else if constexpr (Ty == kINT8) {
    const auto [scale, bias] = scale_bias(row);
    const uint8_t* bytes = row + kScaleBias + d;
#if defined(CPU_CAPABILITY_AVX512)
    const Vec q(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)))));
#elif defined(CPU_CAPABILITY_AVX2)
    const Vec q(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)))));
#else
    alignas(64) float values[Vec::size()];
    for (int64_t j = 0; j < Vec::size(); ++j) values[j] = bytes[j];
    const Vec q = Vec::loadu(values);
#endif
    return at::vec::fmadd(q, Vec(scale), Vec(bias));
  } else {  // int4
    const auto [scale, bias] = scale_bias(row);
    alignas(64) float values[Vec::size()];
    for (int64_t j = 0; j < Vec::size(); ++j) values[j] = nibble(row + kScaleBias, d + j);
    return at::vec::fmadd(Vec::loadu(values), Vec(scale), Vec(bias));
  }
}

// one value of a row as a float (the width's remainder past whole vectors)
template <int64_t Ty>
inline float load_value(const uint8_t* row, int64_t d) {
  if constexpr (Ty == kFP32) {
    return reinterpret_cast<const float*>(row)[d];
  } else if constexpr (Ty == kFP16) {
    return static_cast<float>(reinterpret_cast<const c10::Half*>(row)[d]);
  } else {
    const auto [scale, bias] = scale_bias(row);
    return scale * (Ty == kINT8 ? row[kScaleBias + d] : nibble(row + kScaleBias, d)) + bias;
  }
}

inline void store(Vec v, float* to) { v.store(to); }

template <typename Reduced>
inline void store(Vec v, Reduced* to) {  // rounded a vector at a time (c10's scalar conversion is a value a call)
  at::vec::convert_from_float<Reduced>(v, Vec(0.f)).store(to, Vec::size());
}

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
template <>
inline void store(Vec v, c10::BFloat16* to) {  // one instruction where torch's portable rounding takes ten
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif

// The row of `id` (`size` bytes; the last row's start the buffer holds at `room`) into the cache, every line of it.
inline void fetch(const uint8_t* table, int64_t size, int64_t room, int32_t id) {
  const uint64_t at = static_cast<uint64_t>(id) * size;
  if (at > static_cast<uint64_t>(room)) return;  // one unsigned compare: GCC drops a prefetch under `a >= 0 && a < n`
  for (int64_t line = 0; line < size; line += 64) __builtin_prefetch(table + at + line, 0);
}

// Bags b0..b1 of feature f (rows of type Ty, `size` bytes each, `dim` values; its bag offsets at `offs`) pooled
// into their rows of `out`: one tight loop a feature, its type, layout and pooling fixed outside it; each bag's ids
// in turn, every vector of a row added before the next row (a wide row's lines fetched together, not one a pass).
// V > 0: rows of exactly V vectors, the sums held in registers; V == 0: any width, the sums in `acc`.
template <int64_t Ty, bool Mean, int V, typename Out>
void pool_feature(const uint8_t* table, int64_t size, int64_t room, int64_t dim, const int32_t* ids,
                  const int32_t* offs, int64_t b0, int64_t b1, int64_t f, int64_t total_d, Out* out, float* acc) {
  const int64_t whole = V ? V * Vec::size() : dim - dim % Vec::size();
  const int32_t last = offs[b1];
  // as many lines in flight whatever a row's width: a row of several lines is fetched fewer rows ahead
  const int32_t ahead = static_cast<int32_t>(std::max<int64_t>(2, kAhead / ((size + 63) / 64)));
  for (int32_t i = offs[b0]; i < std::min(offs[b0] + ahead, last); ++i) fetch(table, size, room, ids[i]);
  for (int64_t b = b0; b < b1; ++b) {
    const int32_t start = offs[b], stop = offs[b + 1];
    TORCH_CHECK(start <= stop, "pooled_lookup: a bag of feature ", f, " ends (", stop, ") before it starts (", start,
                ")");
    Vec sums[V ? V : 1];
    for (int v = 0; v < V; ++v) sums[v] = Vec(0.f);
    if (!V) std::fill(acc, acc + dim, 0.f);
    for (int32_t i = start; i < stop; ++i) {
      // rows far apart in tables far larger than the caches: the row `ahead` ids on fetched, not waited on
      if (i + ahead < last) fetch(table, size, room, ids[i + ahead]);
      // checked against the whole buffer: the op, like fbgemm's, is not told each table's rows
      TORCH_CHECK(static_cast<uint64_t>(ids[i]) * size <= static_cast<uint64_t>(room), "pooled_lookup: id ", ids[i],
                  " of feature ", f, " past the tables");
      const uint8_t* row = table + static_cast<int64_t>(ids[i]) * size;
      if constexpr (V > 0) {
        for (int v = 0; v < V; ++v) sums[v] = sums[v] + load_row<Ty>(row, v * Vec::size());
      } else {
        for (int64_t d = 0; d < whole; d += Vec::size()) (Vec::loadu(acc + d) + load_row<Ty>(row, d)).store(acc + d);
        for (int64_t d = whole; d < dim; ++d) acc[d] += load_value<Ty>(row, d);
      }
    }
    Out* to = out + b * total_d;
    const float scale = Mean && stop > start ? 1.f / static_cast<float>(stop - start) : 1.f;
    if constexpr (V > 0) {
      for (int v = 0; v < V; ++v) store(Mean ? sums[v] * Vec(scale) : sums[v], to + v * Vec::size());
    } else {
      for (int64_t d = 0; d < whole; d += Vec::size())
        store(Mean ? Vec::loadu(acc + d) * Vec(scale) : Vec::loadu(acc + d), to + d);
      for (int64_t d = whole; d < dim; ++d) to[d] = static_cast<Out>(acc[d] * scale);
    }
  }
}

template <int64_t Ty, bool Mean, typename Out>
void pool_feature(const uint8_t* table, int64_t size, int64_t room, int64_t dim, const int32_t* ids,
                  const int32_t* offs, int64_t b0, int64_t b1, int64_t f, int64_t total_d, Out* out, float* acc) {
  const auto go = [&](auto vectors) {
    pool_feature<Ty, Mean, decltype(vectors)::value>(table, size, room, dim, ids, offs, b0, b1, f, total_d, out, acc);
  };
  const int64_t n = Vec::size();  // the usual widths in registers: 16, 32, 64 and 128 values at 16 lanes
  if (dim == n) go(std::integral_constant<int, 1>{});
  else if (dim == 2 * n) go(std::integral_constant<int, 2>{});
  else if (dim == 4 * n) go(std::integral_constant<int, 4>{});
  else if (dim == 8 * n) go(std::integral_constant<int, 8>{});
  else go(std::integral_constant<int, 0>{});
}

template <int64_t Ty, typename Out>
void pool_feature(const uint8_t* table, int64_t size, int64_t room, int64_t dim, const int32_t* ids,
                  const int32_t* offs, int64_t b0, int64_t b1, int64_t mode, int64_t f, int64_t total_d, Out* out,
                  float* acc) {
  if (mode == kMean)
    pool_feature<Ty, true>(table, size, room, dim, ids, offs, b0, b1, f, total_d, out, acc);
  else
    pool_feature<Ty, false>(table, size, room, dim, ids, offs, b0, b1, f, total_d, out, acc);
}

template <typename Out>
void pool(const uint8_t* tables, int64_t table_bytes, const int64_t* woff, const uint8_t* tys, const int32_t* doff,
          const int32_t* ids, int64_t num_ids, const int32_t* offs, int64_t features, int64_t batch, int64_t total_d,
          int64_t mode, int64_t alignment, Out* out) {
  const int64_t bags = features * batch;
  TORCH_CHECK(offs[0] >= 0 && offs[bags] <= num_ids, "pooled_lookup: bag offsets ", offs[0], "..", offs[bags],
              " outside the ", num_ids, " ids");
  int64_t widest = 0;
  std::vector<int64_t> sizes(features);  // each feature's row, in bytes
  for (int64_t f = 0; f < features; ++f) {
    const int64_t dim = doff[f + 1] - doff[f];
    TORCH_CHECK(dim > 0 && (tys[f] != kINT4 || dim % 2 == 0), "pooled_lookup: feature ", f, " of width ", dim);
    sizes[f] = row_bytes(tys[f], dim, alignment);
    TORCH_CHECK(woff[f] >= 0 && woff[f] + sizes[f] <= table_bytes, "pooled_lookup: feature ", f,
                "'s table starts past the tables' ", table_bytes, " bytes");  // its ids' bound is unsigned below
    widest = std::max<int64_t>(widest, dim);
  }
  // bags feature-major (fbgemm's order); a chunk of them a task, one thread for a small batch
  at::parallel_for(0, bags, 2048, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(widest);  // a bag's sums, in the cache between its rows
    for (int64_t f = begin / batch; f * batch < end; ++f) {
      const int64_t b0 = std::max(begin - f * batch, int64_t{0}), b1 = std::min(end - f * batch, batch);
      const int64_t dim = doff[f + 1] - doff[f], size = sizes[f];
      const uint8_t* table = tables + woff[f];
      const int64_t room = table_bytes - woff[f] - size;  // the last row's start the buffer holds
      const int32_t* bag = offs + f * batch;
      Out* to = out + doff[f];
      switch (tys[f]) {
        case kFP32: pool_feature<kFP32>(table, size, room, dim, ids, bag, b0, b1, mode, f, total_d, to, sums.data()); break;
        case kFP16: pool_feature<kFP16>(table, size, room, dim, ids, bag, b0, b1, mode, f, total_d, to, sums.data()); break;
        case kINT8: pool_feature<kINT8>(table, size, room, dim, ids, bag, b0, b1, mode, f, total_d, to, sums.data()); break;
        default: pool_feature<kINT4>(table, size, room, dim, ids, bag, b0, b1, mode, f, total_d, to, sums.data());
      }
    }
  });
}

at::Tensor pooled_lookup(const at::Tensor& tables, const at::Tensor& weights_offsets, const at::Tensor& weights_tys,
                         const at::Tensor& D_offsets, const at::Tensor& ids, const at::Tensor& offsets,
                         int64_t total_D, int64_t pooling_mode, int64_t row_alignment, int64_t output_dtype) {
  TORCH_CHECK(tables.scalar_type() == at::kByte && tables.is_contiguous(), "pooled_lookup: tables: contiguous uint8");
  TORCH_CHECK(ids.scalar_type() == at::kInt && offsets.scalar_type() == at::kInt, "pooled_lookup: int32 ids, offsets");
  TORCH_CHECK(pooling_mode == kSum || pooling_mode == kMean, "pooled_lookup: pooling mode ", pooling_mode);
  const at::Tensor woff = weights_offsets.to(at::kLong).contiguous(), tys = weights_tys.to(at::kByte).contiguous();
  const at::Tensor doff = D_offsets.to(at::kInt).contiguous(), idc = ids.contiguous(), offc = offsets.contiguous();
  const int64_t features = doff.numel() - 1;
  TORCH_CHECK(features > 0 && woff.numel() >= features && tys.numel() >= features, "pooled_lookup: layout of ",
              features, " features");
  TORCH_CHECK((offc.numel() - 1) % features == 0, "pooled_lookup: ", offc.numel() - 1, " bags for ", features,
              " features");
  const int64_t batch = (offc.numel() - 1) / features;
  at::ScalarType type = output_dtype == kFP32 ? at::kFloat : output_dtype == kFP16 ? at::kHalf : at::kBFloat16;
  TORCH_CHECK(output_dtype == kFP32 || output_dtype == kFP16 || output_dtype == kBF16, "pooled_lookup: output type ",
              output_dtype);
  at::Tensor out = at::empty({batch, total_D}, tables.options().dtype(type));
  if (batch == 0) return out;
  const auto go = [&](auto* to) {
    pool(tables.data_ptr<uint8_t>(), tables.numel(), woff.data_ptr<int64_t>(), tys.data_ptr<uint8_t>(),
         doff.data_ptr<int32_t>(), idc.data_ptr<int32_t>(), idc.numel(), offc.data_ptr<int32_t>(), features, batch,
         total_D, pooling_mode, row_alignment, to);
  };
  if (type == at::kFloat) go(out.data_ptr<float>());
  else if (type == at::kHalf) go(out.data_ptr<c10::Half>());
  else go(out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dlrm_lab, m) {
  m.def(
      "pooled_lookup(Tensor tables, Tensor weights_offsets, Tensor weights_tys, Tensor D_offsets, Tensor ids, "
      "Tensor offsets, int total_D, int pooling_mode, int row_alignment, int output_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(dlrm_lab, CPU, m) { m.impl("pooled_lookup", &pooled_lookup); }
