// The two-phase ops' problems (attnres_phase1_* / attnres_phase2_*), laid out the
// way AbiProblem lays out the single op's: every tensor in its own allocation,
// rows `dim + pad` apart, input padding NaN and output padding the sentinel, on
// the CPU (whichever ISA is in force) or on the CUDA device, where every buffer
// has a device twin `offset` elements past its allocation. The Check* functions
// run a case on every backend (ForEachBackend) against the float64 reference of
// src/ref/two_phase_reference.h, and on CUDA also check that a second run and
// grids capped at 1 and 3 CTAs give the same bits.
#ifndef ATTNRES_TESTS_CPP_PHASE_PROBLEMS_H_
#define ATTNRES_TESTS_CPP_PHASE_PROBLEMS_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/two_phase_reference.h"
#include "test_util.h"

namespace attnres_test {

using Vec = std::vector<double>;
using Vecs = std::vector<std::vector<double>>;

// Random values, representable in the dtype they will be stored in.
class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  Vec Normal(size_t n, double mean, double sd, attnres_dtype dtype);
  double Uniform(double lo, double hi);

 private:
  std::mt19937_64 gen_;
};

Vec Add(const Vec& a, const Vec& b);

// A [rows, dim] tensor with row stride `stride` in its own Buffer (with a device
// twin `offset` elements into its allocation when `device` is CUDA).
class Rows {
 public:
  Rows() = default;
  Rows(attnres_dtype dtype, int64_t rows, int64_t dim, int64_t stride, uint8_t fill,
       attnres_device device = ATTNRES_DEVICE_CPU, size_t offset = 0);

  void Write(const Vec& v);
  Vec Read() const;
  // The padding between rows and the guard still hold `pattern` (an absent
  // tensor, default-constructed, has none).
  bool OutsideIs(uint8_t pattern) const;
  // Every byte, padding and guard included, holds `pattern`.
  bool AllAre(uint8_t pattern) const;
  void Fill(uint8_t pattern) { buf_.Fill(pattern); }
  void* data() { return buf_.abi_data(); }
  const void* data() const { return buf_.abi_data(); }
  Buffer& buffer() { return buf_; }
  const Buffer& buffer() const { return buf_; }

 private:
  int64_t rows_ = 0, dim_ = 0, stride_ = 0;
  Buffer buf_;
};

// What every call returns: its status, attnres_last_error() when it failed, and
// what it wrote where it should not (padding, guards, NULL outputs' buffers, inputs).
struct CallResult {
  attnres_status status = ATTNRES_OK;
  std::string error, layout;
};

// ---------------------------------------------------------------------------
// Phase 1.

struct Phase1Case {
  int64_t tokens = 5, dim = 8, blocks = 3, queries = 2;
  bool rmsnorm = true, gamma = true;
  double scale = 1.0, eps = 1e-6;
  attnres_dtype dtype = ATTNRES_DTYPE_FLOAT32;
  int64_t source_pad = 0, out_pad = 0, grad_out_pad = 0, grad_source_pad = 0;
  size_t offset = 0;                 // CUDA: device twins this many elements in
  std::vector<int> null_grad_outs;   // queries whose grad_query_outs entry is NULL
  std::vector<int> null_grad_lses;   // queries whose grad_query_lses entry is NULL
  bool grad_lses_array_null = false; // grad_query_lses itself NULL
  uint64_t seed = 1;

  Phase1Case() = default;
  // These sizes, the rest as above.
  Phase1Case(attnres_dtype dtype, int64_t tokens, int64_t dim, int64_t blocks, int64_t queries,
             uint64_t seed)
      : tokens(tokens), dim(dim), blocks(blocks), queries(queries), dtype(dtype), seed(seed) {}

  std::string Describe() const;
};

// What a phase 1 backward is given besides the case.
struct Phase1Grads {
  bool accumulate = false;
  Vecs initial;                 // when non-empty: grad_blocks' values before the call
  std::vector<int> null_blocks; // grad_blocks entries that are NULL
  bool skip_w = false, skip_gamma = false, grad_blocks_null = false;
};

class Phase1Abi {
 public:
  explicit Phase1Abi(const Phase1Case& c, attnres_device device = ATTNRES_DEVICE_CPU);

  struct Forward : CallResult {
    Vecs outs, lses;
  };
  struct Backward : CallResult {
    Vecs grad_blocks;  // N, empty where the pointer was NULL
    Vec grad_w, grad_gamma;
  };
  Forward RunForward();
  Backward RunBackward(const Phase1Grads& g = {});

  attnres::ref::Phase1Problem ref;
  Vecs grad_outs, grad_lses;

 private:
  void MakeValues(const Phase1Case& c);
  void MakeBuffers(const Phase1Case& c);
  attnres_params Inputs() const;
  std::vector<Buffer*> All();
  std::vector<std::vector<unsigned char>> InputBytes() const;
  attnres_status Call(attnres_status (*call)(const attnres_params*), const attnres_params& p,
                      std::string* error, std::string* layout);

  Phase1Case c_;
  attnres_device device_;
  std::vector<Rows> blocks_;
  std::vector<const void*> block_ptrs_;
  Rows w_, gamma_;
  std::vector<Rows> outs_, lses_;
  std::vector<void*> out_ptrs_, lse_ptrs_;
  std::vector<Rows> gouts_, glses_;
  std::vector<const void*> gout_ptrs_, glse_ptrs_;
  std::vector<Rows> gblocks_;
  std::vector<void*> gblock_ptrs_;
  Rows gw_, ggamma_;
};

// ---------------------------------------------------------------------------
// Phase 2.

struct Phase2Case {
  int64_t tokens = 5, dim = 8;
  bool partial = true, rmsnorm = true, gamma = true, input_norm = false, norm_weight = false;
  // The fused partial-block update: the forward adds y into the partial block
  // (writing new_partial = p'), the backward reads p'.
  bool update = false;
  bool grad_partial_in = false;  // the backward adds grad_partial_in into grad_partial
  bool lse = true;               // false: query_lse NULL (allowed without a partial block)
  bool sparse = false;           // grad_query_out, grad_query_lse, grad_partial and dw NULL
  double scale = 1.0, eps = 1e-6, norm_eps = 1e-6;
  attnres_dtype dtype = ATTNRES_DTYPE_FLOAT32;
  int64_t source_pad = 0, out_pad = 0, grad_out_pad = 0, grad_source_pad = 0;
  size_t offset = 0;
  uint64_t seed = 1;
  // Sharp depth attention (SPEC §3): when merge_gap != 0, lse = z_p + merge_gap per
  // token (merge weights sigmoid(+-merge_gap)), the partial block partial_size
  // times o in size.
  double merge_gap = 0, partial_size = 1;

  Phase2Case() = default;
  // These sizes, the rest as above.
  Phase2Case(attnres_dtype dtype, int64_t tokens, int64_t dim, uint64_t seed)
      : tokens(tokens), dim(dim), dtype(dtype), seed(seed) {}

  std::string Describe() const;
};

class Phase2Abi {
 public:
  explicit Phase2Abi(const Phase2Case& c, attnres_device device = ATTNRES_DEVICE_CPU);

  struct Forward : CallResult {
    Vec out, new_partial;
  };
  struct Backward : CallResult {
    // Empty where the pointer was NULL.
    Vec grad_out, grad_lse, grad_partial, grad_w, grad_gamma, grad_norm_weight;
  };
  // fused = false with the update: the plain forward given p' as its partial block.
  Forward RunForward(bool fused = true);
  Backward RunBackward();

  attnres::ref::Phase2Problem ref;  // with the update, its partial is p'
  Vec grad;
  Vec new_partial, grad_partial_in;  // p' and the gradient p' receives elsewhere

 private:
  Vec MakeValues(const Phase2Case& c, Vec* update);
  void MakeSharp(const Phase2Case& c);
  void MakeBuffers(const Phase2Case& c, const Vec& previous, const Vec& update);
  attnres_params Inputs() const;
  std::vector<Buffer*> All();
  std::vector<std::vector<unsigned char>> InputBytes() const;
  attnres_status Call(attnres_status (*call)(const attnres_params*), const attnres_params& p,
                      std::string* error, std::string* layout);
  void ReadBackward(const attnres_params& p, Backward* b);

  Phase2Case c_;
  attnres_device device_;
  Rows qo_, part_, out_, gout_, gq_, gp_, upd_, updated_, gin_, np_;
  Rows lse_, w_, gamma_, nw_, glse_, gw_, gg_, gnw_;
};

// ---------------------------------------------------------------------------
// Checks on every backend.

// Forward and backward (given `g`) within ToleranceFor(c.dtype) of the reference,
// untouched padding, guards, inputs and NULL gradients; then NULL block and weight
// gradients skip exactly those; on CUDA the same bits from a rerun and capped grids.
void CheckPhase1(const Phase1Case& c, const Phase1Grads& g = {});
// The same for phase 2; with the update new_partial is p' bit for bit and out the
// plain forward's of p' bit for bit.
void CheckPhase2(const Phase2Case& c);

}  // namespace attnres_test

#endif  // ATTNRES_TESTS_CPP_PHASE_PROBLEMS_H_
