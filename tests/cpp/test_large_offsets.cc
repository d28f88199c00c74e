// 64-bit indexing: rows whose offsets lie beyond 2^31 and 2^32 elements are read
// and written where they are. No memory is needed: each tensor lives in a large
// MAP_NORESERVE anonymous mapping (untouched pages read as zeros and cost
// nothing), with a row stride of 2^31 + 8 elements, so row t starts at element
// t * (2^31 + 8) -- past 2^35 for the last of 20 rows. Only the touched rows
// become resident (a few hundred pages). The results must be bitwise those of
// the same problem laid out densely, and nothing may be written after a row.
// CPU only: device memory has no such free reservation; the CUDA backend's
// counterpart, CudaBackend.RowStridesPast32Bits, allocates the gigabytes.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"
#include "test_util.h"

namespace attnres_test {
namespace {

constexpr int64_t kStride = (int64_t{1} << 31) + 8;  // elements

class Mapping {
 public:
  explicit Mapping(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
  }
  ~Mapping() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  unsigned char* data() const { return data_; }

 private:
  unsigned char* data_ = nullptr;
  size_t bytes_;
};

void Store(void* base, int64_t index, attnres_dtype dtype, double v) {
  unsigned char* p = static_cast<unsigned char*>(base) + index * DTypeSize(dtype);
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: std::memcpy(p, &v, 8); return;
    case ATTNRES_DTYPE_FLOAT32: { const float f = static_cast<float>(v); std::memcpy(p, &f, 4); return; }
    case ATTNRES_DTYPE_BFLOAT16: { const uint16_t h = DoubleToBf16(v); std::memcpy(p, &h, 2); return; }
    case ATTNRES_DTYPE_FLOAT16: { const uint16_t h = DoubleToF16(v); std::memcpy(p, &h, 2); return; }
  }
}

double Load(const void* base, int64_t index, attnres_dtype dtype) {
  const unsigned char* p = static_cast<const unsigned char*>(base) + index * DTypeSize(dtype);
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: { double v; std::memcpy(&v, p, 8); return v; }
    case ATTNRES_DTYPE_FLOAT32: { float v; std::memcpy(&v, p, 4); return v; }
    case ATTNRES_DTYPE_BFLOAT16: { uint16_t h; std::memcpy(&h, p, 2); return Bf16ToDouble(h); }
    case ATTNRES_DTYPE_FLOAT16: { uint16_t h; std::memcpy(&h, p, 2); return F16ToDouble(h); }
  }
  return 0;
}

// A [tokens, dim] tensor with rows kStride apart in its own mapping, starting
// `offset` elements in.
struct Strided {
  std::unique_ptr<Mapping> map;
  int64_t offset = 0;
  void* ptr(attnres_dtype dtype) const { return map->data() + offset * DTypeSize(dtype); }
};

std::unique_ptr<Mapping> MapRows(int64_t tokens, int64_t extra_elems, attnres_dtype dtype) {
  const size_t elems = static_cast<size_t>((tokens - 1) * kStride + extra_elems + 64);
  auto m = std::make_unique<Mapping>(elems * DTypeSize(dtype));
  if (m->data() == nullptr) return nullptr;
  return m;
}

// The rows of a [rows, dim] tensor kStride elements apart in `m`; the 32 elements
// after each must still be zero (the mapping's fill).
void ReadMapped(const Mapping& m, int64_t rows, int64_t dim, attnres_dtype dtype,
                const std::string& name, std::vector<double>* v) {
  v->assign(rows * dim, 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t d = 0; d < dim; ++d) (*v)[t * dim + d] = Load(m.data(), t * kStride + d, dtype);
    for (int64_t d = dim; d < dim + 32; ++d) {
      ASSERT_EQ(Load(m.data(), t * kStride + d, dtype), 0.0) << "written after row " << t << " of " << name;
    }
  }
}

// Stores a [rows, dim] tensor's rows kStride elements apart, the first `first`
// elements into `m`.
void StoreMapped(Mapping* m, const std::vector<double>& values, int64_t rows, int64_t dim,
                 int64_t first, attnres_dtype dtype) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t d = 0; d < dim; ++d) Store(m->data(), t * kStride + first + d, dtype, values[t * dim + d]);
  }
}

// The forward of `dense`'s problem with its sources at block_ptrs and partial
// (rows kStride apart) and out in `out`: out and alpha bit for bit the dense run's.
void ExpectMappedForward(AbiProblem& dense, const std::vector<const void*>& block_ptrs,
                         const void* partial, const Mapping& out, const ForwardOutput& f_dense) {
  const Case& c = dense.config();
  const attnres_dtype dtype = c.dtype;
  const int64_t T = c.tokens, D = c.dim, L = c.num_sources();
  attnres_params p = dense.InputParams();  // w and gamma from the dense problem
  p.blocks = block_ptrs.data();
  p.partial = partial;
  p.source_row_stride = kStride;
  p.out = out.data();
  p.out_row_stride = kStride;
  std::vector<double> alpha(T * L);
  std::vector<float> alpha_f(T * L);
  if (dtype == ATTNRES_DTYPE_FLOAT64) {
    p.alpha_cache = alpha.data();
  } else {
    p.alpha_cache = alpha_f.data();
  }
  ASSERT_EQ(attnres_forward(&p), ATTNRES_OK) << attnres_last_error();

  std::vector<double> out_values;
  ASSERT_NO_FATAL_FAILURE(ReadMapped(out, T, D, dtype, "out", &out_values));
  EXPECT_TRUE(BitwiseEqual(out_values, f_dense.out)) << "out differs from the dense layout";
  if (dtype != ATTNRES_DTYPE_FLOAT64) {
    for (int64_t k = 0; k < T * L; ++k) alpha[k] = alpha_f[k];
  }
  EXPECT_TRUE(BitwiseEqual(alpha, f_dense.alpha)) << "alpha differs from the dense layout";
}

void CheckLargeOffsets(attnres_dtype dtype, int threads) {
  Case c(dtype, 20, 1000, 2, 3131);  // 20 tokens: several tiles (8 rows each at this dim) and a partial one
  SCOPED_TRACE(c.Describe() + " threads=" + std::to_string(threads));
  const int64_t T = c.tokens, D = c.dim, L = c.num_sources();
  const attnres::ref::Problem problem = MakeProblem(c);
  const std::vector<double> grad_out = MakeGradOut(c);

  // The dense run.
  AbiProblem dense(c, problem);
  const ForwardOutput f_dense = dense.Forward(true, true);
  ASSERT_EQ(f_dense.status, ATTNRES_OK) << f_dense.error;
  const BackwardOutput b_dense = dense.Backward(grad_out, BackwardOptions());
  ASSERT_EQ(b_dense.status, ATTNRES_OK) << b_dense.error;

  // Sources interleaved in one mapping (inputs may share memory): source i's
  // row t at element t * kStride + i * D.
  std::unique_ptr<Mapping> sources = MapRows(T, L * D, dtype);
  std::unique_ptr<Mapping> out = MapRows(T, D, dtype), g_out = MapRows(T, D, dtype);
  std::vector<std::unique_ptr<Mapping>> grads;
  for (int64_t i = 0; i < L; ++i) grads.push_back(MapRows(T, D, dtype));
  bool mapped = sources && out && g_out;
  for (const auto& g : grads) mapped = mapped && g;
  if (!mapped) {
    GTEST_SKIP() << "mmap(MAP_NORESERVE) of ~" << (T * kStride * DTypeSize(dtype) >> 30)
                 << " GiB per tensor failed (vm.overcommit_memory = 2?)";
  }
  std::vector<const void*> block_ptrs;
  const size_t es = DTypeSize(dtype);
  for (int64_t i = 0; i < L; ++i) {
    StoreMapped(sources.get(), problem.sources[i], T, D, i * D, dtype);
    if (i < c.num_blocks) block_ptrs.push_back(sources->data() + i * D * es);
  }
  StoreMapped(g_out.get(), grad_out, T, D, 0, dtype);

  attnres_set_num_threads(threads);
  const void* partial = sources->data() + c.num_blocks * D * es;
  ASSERT_NO_FATAL_FAILURE(ExpectMappedForward(dense, block_ptrs, partial, *out, f_dense));

  attnres_params b = dense.InputParams();
  b.blocks = block_ptrs.data();
  b.partial = partial;
  b.source_row_stride = kStride;
  b.grad_out = g_out->data();
  b.grad_out_row_stride = kStride;
  std::vector<void*> grad_ptrs;
  for (int64_t i = 0; i < c.num_blocks; ++i) grad_ptrs.push_back(grads[i]->data());
  b.grad_blocks = grad_ptrs.data();
  b.grad_partial = grads[L - 1]->data();
  b.grad_source_row_stride = kStride;
  std::vector<unsigned char> grad_w(D * es), grad_gamma(D * es);
  b.grad_proj_weight = grad_w.data();
  b.grad_gamma = grad_gamma.data();
  ASSERT_EQ(attnres_backward(&b), ATTNRES_OK) << attnres_last_error();
  attnres_set_num_threads(0);

  for (int64_t i = 0; i < L; ++i) {
    std::vector<double> g;
    ASSERT_NO_FATAL_FAILURE(
        ReadMapped(*grads[i], T, D, dtype, "the gradient of source " + std::to_string(i), &g));
    EXPECT_TRUE(BitwiseEqual(g, b_dense.grad_sources[i])) << "grad of source " << i;
  }
  std::vector<double> gw(D), gg(D);
  for (int64_t d = 0; d < D; ++d) {
    gw[d] = Load(grad_w.data(), d, dtype);
    gg[d] = Load(grad_gamma.data(), d, dtype);
  }
  EXPECT_TRUE(BitwiseEqual(gw, b_dense.grad_w)) << "dw differs";
  EXPECT_TRUE(BitwiseEqual(gg, b_dense.grad_gamma)) << "dgamma differs";
}

TEST(LargeOffsets, RowsBeyond2To31ElementsF32) { CheckLargeOffsets(ATTNRES_DTYPE_FLOAT32, 2); }
TEST(LargeOffsets, RowsBeyond2To31ElementsBf16) { CheckLargeOffsets(ATTNRES_DTYPE_BFLOAT16, 1); }
TEST(LargeOffsets, RowsBeyond2To31ElementsF64) { CheckLargeOffsets(ATTNRES_DTYPE_FLOAT64, 2); }

}  // namespace
}  // namespace attnres_test
