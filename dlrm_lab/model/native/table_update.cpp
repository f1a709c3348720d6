// A training step's update of its tables' rows, the batch's ids grouped by row: for each distinct row, its ids'
// gradient rows summed, then row-wise Adagrad (state += mean(g^2), row -= lr g / (sqrt(state) + eps)) or SGD
// (row -= lr g), in place. Written by hand because torch's ops take five passes over the batch's rows for this
// (a pooled sum, the rows and their state gathered, updated, scattered back) where one suffices; fbgemm's own CPU
// update runs table by table on one core (train/table_update.py says more).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kAhead = 32;  // distinct rows fetched ahead of the one updated

// The pass itself over raw rows (`rowwise_update`'s, and `group_and_update`'s without tensors between them)
void update_rows(float* tp, int64_t tstride, int64_t rows, int64_t width, float* sp, const int64_t* uq,
                 const int64_t* st, const int64_t* src, int64_t count, const float* gp, int64_t gstride, int64_t grows,
                 const float* sc, float rate, float epsilon, float uniform = 1.f) {
  const int64_t whole = width - width % Vec::size();
  at::parallel_for(0, count, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> g(width);
    for (int64_t u = begin; u < end; ++u) {
      if (u + kAhead < end) {  // rows far apart in tables far larger than the caches: fetched ahead, not waited on
        const int64_t next = u + kAhead;
        if (uq[next] >= 0 && uq[next] < rows) {
          __builtin_prefetch(tp + uq[next] * tstride, 1);
          if (sp) __builtin_prefetch(sp + uq[next], 1);
        }
        if (src[st[next]] >= 0 && src[st[next]] < grows) __builtin_prefetch(gp + src[st[next]] * gstride, 0);
      }
      const int64_t row = uq[u];
      TORCH_CHECK(row >= 0 && row < rows, "rowwise_update: row ", row, " outside the table's ", rows);
      std::fill(g.begin(), g.end(), 0.f);
      for (int64_t k = st[u]; k < st[u + 1]; ++k) {
        TORCH_CHECK(src[k] >= 0 && src[k] < grows, "rowwise_update: gradient row ", src[k], " of ", grows);
        const float* from = gp + src[k] * gstride;
        const Vec s(sc ? sc[k] : uniform);
        int64_t d = 0;
        for (; d < whole; d += Vec::size())
          at::vec::fmadd(s, Vec::loadu(from + d), Vec::loadu(g.data() + d)).store(g.data() + d);
        for (; d < width; ++d) g[d] += (sc ? sc[k] : uniform) * from[d];
      }
      float step = -rate;
      if (sp) {
        float squares = 0.f;
        for (int64_t d = 0; d < width; ++d) squares += g[d] * g[d];
        const float value = sp[row] + squares / static_cast<float>(width);
        sp[row] = value;
        step = -rate / (std::sqrt(value) + epsilon);
      }
      float* to = tp + row * tstride;
      const Vec sv(step);
      int64_t d = 0;
      for (; d < whole; d += Vec::size())
        at::vec::fmadd(sv, Vec::loadu(g.data() + d), Vec::loadu(to + d)).store(to + d);
      for (; d < width; ++d) to[d] += step * g[d];
    }
  });
}

// The table, its gradient rows and its row-wise state checked as an update takes them (`op`: whose message):
// the state's pointer, or null without one
float* checked_rows(const char* op, const at::Tensor& table, const std::optional<at::Tensor>& state,
                    const at::Tensor& grad_rows) {
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.stride(1) == 1, op,
              ": the table must be fp32 rows, got ", table.scalar_type(), " ", table.sizes());
  TORCH_CHECK(grad_rows.scalar_type() == at::kFloat && grad_rows.dim() == 2 && grad_rows.stride(1) == 1 &&
                  grad_rows.size(1) == table.size(1),
              op, ": gradient rows ", grad_rows.sizes(), " do not meet the table's width ", table.size(1));
  if (!state.has_value()) return nullptr;
  TORCH_CHECK(state->scalar_type() == at::kFloat && state->is_contiguous() && state->numel() >= table.size(0), op,
              ": the state must be one fp32 value a row");
  return state->data_ptr<float>();
}

void rowwise_update(const at::Tensor& table, const std::optional<at::Tensor>& state, const at::Tensor& unique,
                    const at::Tensor& starts, const at::Tensor& sources, const at::Tensor& grad_rows,
                    const std::optional<at::Tensor>& scale, double lr, double eps) {
  float* sp = checked_rows("rowwise_update", table, state, grad_rows);
  TORCH_CHECK(unique.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
                  sources.scalar_type() == at::kLong && unique.is_contiguous() && starts.is_contiguous() &&
                  sources.is_contiguous() && starts.numel() == unique.numel() + 1,
              "rowwise_update: unique, starts (one more) and sources must be contiguous int64");
  const int64_t count = unique.numel();
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(count == 0 || (st[0] == 0 && st[count] == sources.numel()), "rowwise_update: starts do not span sources");
  const float* sc = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == sources.numel(),
                "rowwise_update: one fp32 scale an id");
    sc = scale->data_ptr<float>();
  }
  update_rows(table.data_ptr<float>(), table.stride(0), table.size(0), table.size(1), sp, unique.data_ptr<int64_t>(),
              st, sources.data_ptr<int64_t>(), count, grad_rows.data_ptr<float>(), grad_rows.stride(0),
              grad_rows.size(0), sc, static_cast<float>(lr), static_cast<float>(eps));
}

// A slot of the hash table: a row (< 2^32) and its group, 8 bytes, so a probe touches one line
struct Slot {
  uint32_t row;
  uint32_t group;  // kEmpty: no row yet
};
constexpr uint32_t kEmpty = ~uint32_t{0};
constexpr int64_t kSlotsAhead = 16;  // ids whose slot is fetched ahead of the one probed

template <typename I>
int64_t first_seen(const I* ids, const int64_t* bases, int64_t segments, int64_t n, int64_t num_rows, Slot* slots,
                   uint64_t mask, int shift, int64_t* unique, uint32_t* group_of, uint32_t* count) {
  const int64_t each = segments ? n / segments : n;
  uint32_t distinct = 0;
  for (int64_t seg = 0, k = 0; seg < std::max<int64_t>(segments, 1); ++seg) {
    const int64_t base = bases ? bases[seg] : 0;
    for (const int64_t end = k + each; k < end; ++k) {
      if (k + kSlotsAhead < end)  // in a step the slots are cold (the step's GEMMs had the caches): fetched ahead
        __builtin_prefetch(slots + ((static_cast<uint64_t>(static_cast<int64_t>(ids[k + kSlotsAhead]) + base) *
                                     0x9E3779B97F4A7C15ull) >> shift), 1);
      const int64_t row = static_cast<int64_t>(ids[k]) + base;
      TORCH_CHECK(row >= 0 && row < num_rows, "group_rows: row ", row, " outside the table's ", num_rows);
      const auto key = static_cast<uint32_t>(row);
      uint64_t h = (static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> shift;
      while (slots[h].group != kEmpty && slots[h].row != key) h = (h + 1) & mask;
      if (slots[h].group == kEmpty) {
        slots[h] = {key, distinct};
        unique[distinct] = row;
        count[distinct++] = 0;
      }
      ++count[group_of[k] = slots[h].group];
    }
  }
  return distinct;
}

// Bags all `bag` ids long, feature-major (`batch` bags a feature): the bag of feature f and sample b takes the
// gradient row b * per_sample + f
struct Bags {
  int64_t bag, batch, per_sample;
};

// `group_rows`' work into buffers of n, n + 1 and n values (n: the ids' count): the distinct rows' count. Each
// grouped id's place in `od` holds its position, or its source row where `source_in` is given, or its bag's
// gradient row where `bags` is
int64_t group_into(const at::Tensor& ids_in, const std::optional<at::Tensor>& bases_in, int64_t num_rows,
                   const std::optional<at::Tensor>& source_in, int64_t* uq, int64_t* st, int64_t* od,
                   const Bags* bags = nullptr) {
  TORCH_CHECK(ids_in.dim() == 1 && (ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt),
              "group_rows: ids must be 1-D int32 or int64, got ", ids_in.scalar_type(), " ", ids_in.sizes());
  TORCH_CHECK(num_rows > 0 && num_rows <= (int64_t{1} << 32) && ids_in.numel() < (int64_t{1} << 32),
              "group_rows: ", num_rows, " rows and ", ids_in.numel(), " ids must each fit 32 bits");
  const auto ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  at::Tensor bases, source;
  int64_t segments = 0;
  if (bases_in.has_value()) {
    bases = bases_in->to(at::kLong).contiguous();
    segments = bases.numel();
    TORCH_CHECK(bases.dim() == 1 && segments > 0 && n % segments == 0, "group_rows: ", n, " ids in ", segments,
                " equal segments");
  }
  if (source_in.has_value()) {
    source = source_in->to(at::kLong).contiguous();
    TORCH_CHECK(source.dim() == 1 && source.numel() == n, "group_rows: a source row for each of the ", n,
                " ids, got ", source.sizes());
  }
  int bits = 10;  // at least 1,024 slots, at most half of them taken
  while ((int64_t{1} << bits) < 2 * n) ++bits;
  const uint64_t size = uint64_t{1} << bits;
  thread_local std::vector<Slot> slots;
  thread_local std::vector<uint32_t> group_of, count;
  slots.assign(size, Slot{0, kEmpty});
  if (static_cast<int64_t>(group_of.size()) < n) {
    group_of.resize(n);
    count.resize(n);
  }
  const int64_t* base = segments ? bases.data_ptr<int64_t>() : nullptr;
  const int shift = 64 - bits;
  const int64_t distinct =
      ids.scalar_type() == at::kInt
          ? first_seen(ids.data_ptr<int32_t>(), base, segments, n, num_rows, slots.data(), size - 1, shift, uq,
                       group_of.data(), count.data())
          : first_seen(ids.data_ptr<int64_t>(), base, segments, n, num_rows, slots.data(), size - 1, shift, uq,
                       group_of.data(), count.data());
  uint32_t total = 0;
  for (int64_t g = 0; g < distinct; ++g) {
    st[g] = total;
    total += std::exchange(count[g], total);  // count[g]: the next free place of row g's ids
  }
  st[distinct] = n;
  const int64_t* src = source.defined() ? source.data_ptr<int64_t>() : nullptr;
  if (bags) {
    for (int64_t f = 0, k = 0; f < n / (bags->batch * bags->bag); ++f)
      for (int64_t b = 0; b < bags->batch; ++b)
        for (int64_t j = 0; j < bags->bag; ++j, ++k) od[count[group_of[k]]++] = b * bags->per_sample + f;
  } else {
    for (int64_t k = 0; k < n; ++k) od[count[group_of[k]]++] = src ? src[k] : k;
  }
  return distinct;
}

// The batch's ids grouped by row, for `rowwise_update`: (unique rows in the order first seen, starts: where each
// row's ids begin in `order` (one more), order: the ids' positions, grouped, ascending within a row; or, given
// `source`, source[position] for each, the gradient row each id takes, gathered here rather than by a second pass).
// An id's row is the id plus its segment's base where `bases` is given (the ids in as many equal segments as bases:
// one a feature, its table's first row). One probe of a hash table of the rows seen an id (open addressing, twice
// the ids' count in slots), then a counting scatter: kaggle's 53k ids in one read and one write, where an LSD radix
// sort of (row, position) took two scatters over 8,192 buckets and torch's sort and unique_consecutive 0.6-1.0 ms.
// A row's ids keep their order, so its gradient sums in the same order as a sort's: the update is the same.
std::tuple<at::Tensor, at::Tensor, at::Tensor> group_rows(const at::Tensor& ids, const std::optional<at::Tensor>& bases,
                                                          int64_t num_rows, const std::optional<at::Tensor>& source) {
  const int64_t n = ids.numel();
  const auto options = ids.options().dtype(at::kLong);
  auto unique = at::empty({n}, options);
  auto starts = at::empty({n + 1}, options);
  auto order = at::empty({n}, options);
  const int64_t distinct = group_into(ids, bases, num_rows, source, unique.data_ptr<int64_t>(),
                                      starts.data_ptr<int64_t>(), order.data_ptr<int64_t>());
  return {unique.narrow(0, 0, distinct), starts.narrow(0, 0, distinct + 1), order};
}

// The grouping (`group_into`'s, each id's gradient row from `source` or `bags`) then the pass (`update_rows`,
// every id scaled by `uniform`), the grouping's three arrays in buffers kept between calls: both one-call updates'
void grouped_update(const at::Tensor& table, float* sp, const at::Tensor& ids, const std::optional<at::Tensor>& bases,
                    const std::optional<at::Tensor>& source, const Bags* bags, const at::Tensor& grad_rows, double lr,
                    double eps, float uniform) {
  const int64_t rows = table.size(0), n = ids.numel();
  thread_local std::vector<int64_t> unique, starts, order;
  if (static_cast<int64_t>(unique.size()) < n) {
    unique.resize(n);
    starts.resize(n + 1);
    order.resize(n);
  }
  const int64_t distinct = group_into(ids, bases, rows, source, unique.data(), starts.data(), order.data(), bags);
  update_rows(table.data_ptr<float>(), table.stride(0), rows, table.size(1), sp, unique.data(), starts.data(),
              order.data(), distinct, grad_rows.data_ptr<float>(), grad_rows.stride(0), grad_rows.size(0), nullptr,
              static_cast<float>(lr), static_cast<float>(eps), uniform);
}

// `group_rows` with a source, then `rowwise_update` without scales, in one call: the grouping's three arrays stay
// in buffers kept between calls rather than tensors made each step, and one dispatch where there were two
void group_and_update(const at::Tensor& table, const std::optional<at::Tensor>& state, const at::Tensor& ids,
                      const std::optional<at::Tensor>& bases, const at::Tensor& source, const at::Tensor& grad_rows,
                      double lr, double eps) {
  float* sp = checked_rows("group_and_update", table, state, grad_rows);
  grouped_update(table, sp, ids, bases, source, nullptr, grad_rows, lr, eps, 1.f);
}

// The bags' length if every one of the offsets' bags holds the same number of ids (one or more), else 0
template <typename O>
int64_t uniform_bag(const O* off, int64_t bags) {
  if (bags == 0 || off[0] != 0) return 0;
  const int64_t bag = off[1];
  if (bag <= 0) return 0;
  for (int64_t i = 1; i <= bags; ++i)
    if (off[i] != i * bag) return 0;
  return bag;
}

// `group_and_update` for bags all the same length (Criteo's one id a bag), each id's gradient row found from its
// place rather than handed in; `mean`: each id's gradient over its bag's length. False, and nothing done, where
// the offsets' bags differ in length: the caller takes the ragged path. Everything `apply_update` did in Python
// between the gradient and the kernel (the bags' check, their rows) in the one call
bool group_and_update_bags(const at::Tensor& table, const std::optional<at::Tensor>& state, const at::Tensor& ids,
                           const at::Tensor& bases, const at::Tensor& offsets, int64_t per_sample,
                           const at::Tensor& grad_rows, double lr, double eps, bool mean) {
  float* sp = checked_rows("group_and_update_bags", table, state, grad_rows);
  TORCH_CHECK(offsets.dim() == 1 && offsets.is_contiguous() &&
                  (offsets.scalar_type() == at::kInt || offsets.scalar_type() == at::kLong) && offsets.numel() > 0,
              "group_and_update_bags: offsets must be 1-D contiguous int32 or int64");
  const int64_t features = bases.numel(), count_bags = offsets.numel() - 1, n = ids.numel();
  TORCH_CHECK(features > 0 && count_bags % features == 0, "group_and_update_bags: ", count_bags, " bags for ",
              features, " features");
  const int64_t bag = offsets.scalar_type() == at::kInt ? uniform_bag(offsets.data_ptr<int32_t>(), count_bags)
                                                        : uniform_bag(offsets.data_ptr<int64_t>(), count_bags);
  if (bag == 0 || n != count_bags * bag) return false;
  const Bags bags{bag, count_bags / features, per_sample};
  TORCH_CHECK(per_sample >= features && (bags.batch - 1) * per_sample + features <= grad_rows.size(0),
              "group_and_update_bags: ", bags.batch, " samples of ", features, " features, ", per_sample,
              " gradient rows apart, do not fit the ", grad_rows.size(0), " gradient rows");
  grouped_update(table, sp, ids, bases, std::nullopt, &bags, grad_rows, lr, eps,
                 mean ? 1.f / static_cast<float>(bag) : 1.f);
  return true;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dlrm_lab, m) {
  m.def("group_rows(Tensor ids, Tensor? bases, int num_rows, Tensor? source=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "rowwise_update(Tensor(a!) table, Tensor(b!)? state, Tensor unique, Tensor starts, Tensor sources, "
      "Tensor grad_rows, Tensor? scale, float lr, float eps) -> ()");
  m.def(
      "group_and_update(Tensor(a!) table, Tensor(b!)? state, Tensor ids, Tensor? bases, Tensor source, "
      "Tensor grad_rows, float lr, float eps) -> ()");
  m.def(
      "group_and_update_bags(Tensor(a!) table, Tensor(b!)? state, Tensor ids, Tensor bases, Tensor offsets, "
      "int per_sample, Tensor grad_rows, float lr, float eps, bool mean) -> bool");
}

TORCH_LIBRARY_IMPL(dlrm_lab, CPU, m) {
  m.impl("rowwise_update", &rowwise_update);
  m.impl("group_rows", &group_rows);
  m.impl("group_and_update", &group_and_update);
  m.impl("group_and_update_bags", &group_and_update_bags);
}
