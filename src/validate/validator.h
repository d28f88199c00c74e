// The checks every entry point of the C ABI shares: a Validator that checks
// arguments in order and keeps the first failure ("attnres_forward: dim must be
// ..."), records the byte span of every buffer, and rejects any output that
// overlaps an input or another output. Each op's rules are in its own file
// (block_attn_res.cc, phase1.cc, phase2.cc); validate.h is what src/abi.cc calls.
#ifndef ATTNRES_SRC_VALIDATE_VALIDATOR_H_
#define ATTNRES_SRC_VALIDATE_VALIDATOR_H_

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "backends.h"
#include "validate/validate.h"

namespace attnres::validate {

// An argument's name for messages, "blocks" or "blocks[3]": composed only when a
// message is written, so that a call that passes costs no string building.
struct Name {
  Name(const char* base, int64_t index = -1) : base(base), index(index) {}  // NOLINT: implicit
  const char* base;
  int64_t index;  // -1: not an array element
};

std::ostream& operator<<(std::ostream& os, const Name& name);

// The byte range [begin, end) a buffer spans, with its name for messages.
struct Span {
  uintptr_t begin, end;
  Name name;
  bool is_output;
};

// Checks arguments in order and keeps the first failure. One per call (never
// nested: it shares the thread's list of spans, which is kept between calls so
// that a warm call allocates nothing).
class Validator {
 public:
  explicit Validator(const char* function) : function_(function), spans_(ThreadSpans()) {
    spans_.clear();
  }
  // A call over thousands of sources does not leave its list behind in the thread.
  ~Validator() {
    if (spans_.capacity() > kKeptSpans) std::vector<Span>().swap(spans_);
  }

  bool ok() const { return status_ == ATTNRES_OK; }

  // The status of the call; on failure, also the message of attnres_last_error().
  attnres_status Finish() {
    if (!ok()) Fail(status_, message_);
    return status_;
  }

  template <typename... Args>
  void Check(bool condition, attnres_status status, const Args&... parts) {
    if (!ok() || condition) return;
    std::ostringstream os;
    os << function_ << ": ";
    (os << ... << parts);
    status_ = status;
    message_ = os.str();
  }

  void NotNull(const void* p, Name name) {
    Check(p != nullptr, ATTNRES_ERROR_NULL_POINTER, name, " must not be NULL");
  }

  void Aligned(const void* p, int64_t alignment, Name name) {
    Check(reinterpret_cast<uintptr_t>(p) % alignment == 0, ATTNRES_ERROR_INVALID_ARGUMENT, name,
          " must be aligned to ", alignment, " bytes (its element size), got address ", p);
  }

  void RowStride(int64_t stride, int64_t dim, const char* name) {
    Check(stride >= dim, ATTNRES_ERROR_INVALID_ARGUMENT, name, " must be >= dim (", dim,
          "), got ", stride);
  }

  // A 0/1 flag.
  void Flag(int32_t value, const char* name) {
    Check(value == 0 || value == 1, ATTNRES_ERROR_INVALID_ARGUMENT, name, " must be 0 or 1, got ",
          value);
  }

  // Records the span of a [rows, stride] buffer whose rows hold `cols` elements
  // of `elem` bytes (nothing for a NULL pointer or no rows).
  [[gnu::always_inline]] void AddRows(const void* p, int64_t rows, int64_t stride, int64_t cols,
                                      int64_t elem, Name name, bool is_output) {
    if (!ok() || p == nullptr || rows == 0) return;
    Aligned(p, elem, name);
    int64_t elems = 0, bytes = 0;
    const bool overflow = __builtin_mul_overflow(rows - 1, stride, &elems) ||
                          __builtin_add_overflow(elems, cols, &elems) ||
                          __builtin_mul_overflow(elems, elem, &bytes);
    const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
    Check(!overflow && bytes >= 0 && begin + static_cast<uintptr_t>(bytes) >= begin,
          ATTNRES_ERROR_INVALID_ARGUMENT, name, " spans more than the address space (", rows,
          " rows, row stride ", stride, ")");
    if (ok()) spans_.push_back({begin, begin + static_cast<uintptr_t>(bytes), name, is_output});
  }

  // A [rows, stride] buffer the call must have: not NULL, stride >= cols, span recorded.
  void RequiredRows(const void* p, int64_t rows, int64_t stride, int64_t cols, int64_t elem,
                    const char* name, const char* stride_name, bool is_output) {
    NotNull(p, name);
    RowStride(stride, cols, stride_name);
    AddRows(p, rows, stride, cols, elem, name, is_output);
  }

  // No output may overlap an input or another output (inputs may share memory).
  void NoOverlap();

 private:
  // Spans kept by a thread between calls, at most: a larger list is freed.
  static constexpr size_t kKeptSpans = 1024;

  // The spans of this thread's current call, kept between calls: a backward over
  // 10 sources records ~25 spans, and a vector grown afresh on every call would
  // cost a malloc (and a consolidation of glibc's fast bins) per call.
  static std::vector<Span>& ThreadSpans() {
    thread_local std::vector<Span> spans;
    return spans;
  }

  const char* function_;
  attnres_status status_ = ATTNRES_OK;
  std::string message_;
  std::vector<Span>& spans_;
};

// Bounds that keep every size the backends derive (padded rows, scratch of a tile
// times L, S x N stats) inside int64; no buffer that large can exist anyway.
constexpr int64_t kMaxDim = int64_t{1} << 48, kMaxBlocks = int64_t{1} << 40;

// ---- Checks shared by the ops, in the order each op's validator calls them ----

// Every call: the struct, dtype, device, sizes and the scalars scale, eps, rmsnorm.
void ValidateHeader(Validator& v, const attnres_params* p);

// source_row_stride and the N block pointers (blocks and each blocks[i] not NULL).
void CheckBlocks(Validator& v, const attnres_params* p);
// The spans of the N blocks, [num_tokens rows of dim] at source_row_stride.
void AddBlockSpans(Validator& v, const attnres_params* p);
// proj_weight and gamma, each [rows, dim] (1 row, or phase 1's S).
void AddWeights(Validator& v, const attnres_params* p, int64_t rows);
// Their gradients, outputs of the same shape.
void AddWeightGrads(Validator& v, const attnres_params* p, int64_t rows);

// Whether any grad_blocks[i] is given (grad_blocks itself may be NULL).
bool AnyGradBlock(const attnres_params* p);
// The spans of the non-NULL grad_blocks[i], at grad_source_row_stride.
void AddGradBlocks(Validator& v, const attnres_params* p);

// grad_gamma only with RMSNorm.
void CheckGradGamma(Validator& v, const attnres_params* p);
// grad_partial only with a partial block.
void CheckGradPartial(Validator& v, const attnres_params* p);
// The upstream gradient of the single op and of phase 2 (required rows at
// grad_out_row_stride), then CheckGradGamma.
void ValidateGradOut(Validator& v, const attnres_params* p);

// A [num_tokens] column of the accumulation type (LSEs and their gradients).
void AddColumn(Validator& v, const attnres_params* p, const void* column, Name name,
               bool is_output);

}  // namespace attnres::validate

#endif  // ATTNRES_SRC_VALIDATE_VALIDATOR_H_
