// A case runner shared by the command-line tool and the benchmarks: builds a
// random problem (uniform values, reproducible from the seed) in a given dtype (one allocation per block, optional padded
// rows), runs it through the C ABI, and measures the error against the float64
// reference.
#ifndef ATTNRES_SRC_REF_HARNESS_H_
#define ATTNRES_SRC_REF_HARNESS_H_

#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"

namespace attnres::harness {

struct CaseSpec {
  int64_t tokens = 16;
  int64_t dim = 64;
  int64_t num_blocks = 4;
  bool partial = true;
  bool rmsnorm = true;
  double scale = 1.0;
  double eps = 1e-6;
  attnres_dtype dtype = ATTNRES_DTYPE_FLOAT32;
  int64_t row_padding = 0;     // extra elements per row: row stride = dim + padding
  bool backward_caches = true; // pass the forward's caches to the backward
  double logit_magnitude = 1;  // scales w: large values test the softmax's range
  uint64_t seed = 1;

  int64_t num_sources() const { return num_blocks + (partial ? 1 : 0); }
  std::string Describe() const;
};

// Max error relative to the max-abs of the reference tensor, per output (a phase 1
// case fills lse where the single op fills rms and alpha).
struct Errors {
  double out = 0, rms = 0, alpha = 0, lse = 0, grad_sources = 0, grad_w = 0, grad_gamma = 0;
  double WorstForward() const;
  double WorstBackward() const;
};

// SPEC §3 tolerances for a dtype.
double ForwardTolerance(attnres_dtype dtype);
double BackwardTolerance(attnres_dtype dtype);
const char* DtypeName(attnres_dtype dtype);
bool ParseDtype(const std::string& name, attnres_dtype* dtype);
int64_t ElementBytes(attnres_dtype dtype);

// Bytes aligned to 64, as PyTorch's CPU allocator aligns tensors (the kernels
// stream outputs whose rows are aligned to the store width).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    void* p = ::operator new(n * sizeof(T), std::align_val_t{64});
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const Aligned64&) const { return true; }
  bool operator!=(const Aligned64&) const { return false; }
};
using Bytes = std::vector<char, Aligned64<char>>;

// Buffers of one case and the params that point into them.
class Case {
 public:
  explicit Case(const CaseSpec& spec);

  // The problem as the reference sees it: the dtype-rounded inputs in float64
  // (built on demand: the benchmarks' cases would not fit twice in memory).
  ref::Problem Problem() const;
  const CaseSpec& spec() const { return spec_; }

  attnres_status Forward();   // writes out + both caches
  attnres_status Backward();  // writes every gradient
  attnres_params ForwardParams();
  attnres_params BackwardParams();

  Errors Compare() const;  // runs the reference; call after Forward() and Backward()

 private:
  CaseSpec spec_;
  int64_t stride_;
  std::vector<Bytes> sources_, grad_sources_;
  Bytes w_, gamma_, out_, grad_out_, grad_w_, grad_gamma_;
  Bytes rms_, alpha_;  // accumulation type
  std::vector<const void*> block_ptrs_;
  std::vector<void*> grad_block_ptrs_;
};

// Phase 1 of the two-phase schedule (SPEC §5): `queries` rows of w and gamma over
// the spec's blocks (spec.partial unused: phase 1 reads only completed blocks). The
// backward is given a random gradient for every query's output and lse.
class Phase1Case {
 public:
  Phase1Case(const CaseSpec& spec, int64_t queries);

  const CaseSpec& spec() const { return spec_; }
  int64_t queries() const { return queries_; }

  attnres_status Forward();   // writes every query's output and lse
  attnres_status Backward();  // writes the block gradients, dw and dgamma
  attnres_params ForwardParams();
  attnres_params BackwardParams();

  Errors Compare() const;  // runs the reference; call after Forward() and Backward()

 private:
  CaseSpec spec_;
  int64_t queries_, stride_;
  std::vector<Bytes> blocks_, grad_blocks_, outs_, lses_, grad_outs_, grad_lses_;
  Bytes w_, gamma_, grad_w_, grad_gamma_;
  std::vector<const void*> block_ptrs_, grad_out_ptrs_, grad_lse_ptrs_;
  std::vector<void*> grad_block_ptrs_, out_ptrs_, lse_ptrs_;
};

}  // namespace attnres::harness

#endif  // ATTNRES_SRC_REF_HARNESS_H_
