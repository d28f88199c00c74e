// libFuzzer target for the C ABI: the single op (attnres_forward /
// attnres_backward) and the two-phase schedule (attnres_phase1_forward /
// attnres_phase1_backward / attnres_phase2_forward / attnres_phase2_backward).
//
// Each input picks one of the six entry points and drives one random descriptor:
// sizes (0, small, negative, huge: tokens, dim, blocks, queries), every dtype and
// flag value (known and unknown: rmsnorm, accumulate_grads, input_norm), scalars
// (scale, eps, norm_eps: finite, 0, NaN, Inf, negative), row strides (dense,
// padded, below dim, beyond 2^31), optional pointers and pointer-array entries
// present or NULL, pointers the entry point requires to be NULL now and then set,
// and then at most one pointer mutation: a pointer misaligned, an output pointed
// into another buffer, inputs aliased (allowed), a span that wraps the address
// space, or every field the entry point ignores holding garbage.
//
// The harness carries its own statement of the validation rules of
// include/attnres/attnres.h (Violation below) and checks, for every call:
//   - the status is OK exactly when the descriptor is valid;
//   - on failure: a known status, a non-empty attnres_last_error() naming the
//     function, and not one byte written to any output;
//   - on success: nothing written between rows of strided outputs;
//   - inputs are never modified;
//   - no sanitizer report (ASan, UBSan) and no crash.
// Buffers are allocated with exactly the bytes the descriptor says the library
// may touch, so any read or write beyond them is an ASan report. Bogus pointers
// are handed over only where validation must reject the call before touching
// memory, and for fields the call ignores (the gradient group in forward, `out`
// in backward, the other entry points' fields). A valid descriptor whose buffers
// exceed kMaxBufferBytes is skipped (its memory cannot be provided).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attnres/attnres.h"

namespace {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kMaxBufferBytes = 4 << 20;  // all buffers of one call together
// Pointer arrays (blocks, query_outs, ...) are caller memory of num_blocks or
// num_queries entries: only counts that can be allocated are generated (a longer
// claimed array is a caller bug the library cannot detect).
constexpr int64_t kMaxArrayLength = 300;
constexpr unsigned char kSentinel = 0xA5;
constexpr size_t kNone = static_cast<size_t>(-1);  // no buffer for this field
// Never mapped, and odd: misaligned for every dtype, so validating an ignored
// field fails as surely as dereferencing it.
void* const kGarbage = reinterpret_cast<void*>(uintptr_t{0xdead0001});
// The reason Violation() gives for overlapping outputs: the one rule that depends
// on where the buffers are rather than on the descriptor.
constexpr char kOverlap[] = "outputs overlap";

enum Op {
  kForward,
  kBackward,
  kPhase1Forward,
  kPhase1Backward,
  kPhase2Forward,
  kPhase2Backward,
  kNumOps
};
constexpr const char* kOpNames[kNumOps] = {
    "attnres_forward",        "attnres_backward",       "attnres_phase1_forward",
    "attnres_phase1_backward", "attnres_phase2_forward", "attnres_phase2_backward"};
constexpr attnres_status (*kEntryPoints[kNumOps])(const attnres_params*) = {
    attnres_forward,        attnres_backward,       attnres_phase1_forward,
    attnres_phase1_backward, attnres_phase2_forward, attnres_phase2_backward};

bool IsBackward(Op op) { return op % 2 == 1; }
int Phase(Op op) { return op / 2; }  // 0: the single op

[[noreturn]] void Bug(const char* what, const std::string& detail) {
  std::fprintf(stderr, "attnres fuzz: %s\n  %s\n  last error: %s\n", what, detail.c_str(),
               attnres_last_error());
  std::abort();
}

// Sizes: mostly small, sometimes a boundary value.
int64_t PickSize(FuzzedDataProvider& fdp, int64_t typical_max) {
  static const int64_t kSpecial[] = {0,          1,          -1,         2,
                                     kI64Min,    kI64Max,    kI64Max / 2, (int64_t{1} << 31) - 1,
                                     int64_t{1} << 31, int64_t{1} << 32, int64_t{1} << 40,
                                     int64_t{1} << 61, int64_t{1} << 62, -(int64_t{1} << 31)};
  const uint8_t mode = fdp.ConsumeIntegral<uint8_t>();
  if (mode < 200) return fdp.ConsumeIntegralInRange<int64_t>(0, typical_max);
  if (mode < 240) return fdp.PickValueInArray(kSpecial);
  return fdp.ConsumeIntegral<int64_t>();
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return b > 0 ? kI64Max : kI64Min;
  return r;
}

// A row stride for rows of `dim`: dense, padded, below dim, or huge.
int64_t PickStride(FuzzedDataProvider& fdp, int64_t dim) {
  const uint8_t mode = fdp.ConsumeIntegral<uint8_t>();
  const int64_t d = dim > 0 ? dim : 1;
  if (mode < 120) return d;
  if (mode < 200) return SaturatingAdd(d, fdp.ConsumeIntegralInRange<int64_t>(1, 9));
  if (mode < 220) return d - fdp.ConsumeIntegralInRange<int64_t>(1, 3);  // below dim
  return PickSize(fdp, SaturatingAdd(d, std::min<int64_t>(d, kI64Max / 4) * 3 + 64));
}

double PickScalar(FuzzedDataProvider& fdp, double typical) {
  static const double kSpecial[] = {0.0,  -0.0, 1.0,   -1.0,  1e-6, 1e4,  -1e4, 1e30,
                                    1e-310, std::numeric_limits<double>::max(),
                                    std::numeric_limits<double>::infinity(),
                                    -std::numeric_limits<double>::infinity(),
                                    std::numeric_limits<double>::quiet_NaN()};
  const uint8_t mode = fdp.ConsumeIntegral<uint8_t>();
  if (mode < 170) return typical;
  if (mode < 240) return fdp.PickValueInArray(kSpecial);
  return fdp.ConsumeFloatingPoint<double>();
}

int32_t PickEnum(FuzzedDataProvider& fdp, int32_t known_count) {
  const uint8_t mode = fdp.ConsumeIntegral<uint8_t>();
  if (mode < 245) return static_cast<int32_t>(mode % known_count);
  return fdp.ConsumeIntegral<int32_t>();
}

// The number of entries a pointer array of `*count` gets (capped with the count).
int64_t ArrayLength(int64_t* count) {
  *count = std::min(*count, kMaxArrayLength);
  return std::max<int64_t>(*count, 0);
}

uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The geometry of a buffer: `rows` rows of `cols` elements, `stride` apart.
struct Shape {
  int64_t rows, stride, cols, elem;
};

// One buffer of the call: what the descriptor says, and what is passed.
struct Buffer {
  std::string name;
  bool is_output = false;
  bool present = false;  // non-NULL in the params
  // Validation looks at it: false for the fields of the other direction that the
  // single op's harness still backs (they must stay untouched), and for the
  // entries of a pointer array passed as NULL.
  bool checked = true;
  Shape shape{};
  __int128 span_bytes = 0;  // (rows - 1) * stride + cols elements, in bytes; 0 if rows <= 0
  std::unique_ptr<unsigned char[]> storage;
  size_t storage_bytes = 0;
  unsigned char* ptr = nullptr;  // what the params get (may differ from storage)
  std::vector<unsigned char> snapshot;

  bool NonEmpty() const { return present && shape.rows > 0; }
  bool Overflows() const { return span_bytes > kI64Max; }
};

// An array of pointers in the params (blocks, grad_blocks, query_outs, ...).
struct PointerArray {
  bool built = false;    // this entry point's harness has it (else the field is left alone)
  bool checked = true;   // the call reads it (see Buffer::checked)
  bool present = false;  // the array itself is non-NULL
  std::vector<size_t> entries;  // into Harness::buffers
  std::vector<void*> ptrs;      // what the params get
};

__int128 SpanBytes(const Shape& s) {
  if (s.rows <= 0) return 0;
  // |elems| < 2^127; capped so that the byte count cannot overflow either.
  const __int128 elems = static_cast<__int128>(s.rows - 1) * s.stride + s.cols;
  const __int128 cap = static_cast<__int128>(1) << 100;
  return (elems > cap ? cap : elems < -cap ? -cap : elems) * s.elem;
}

// Input values in the storage dtype: nice (|x| <= 2), any bits (NaN, Inf,
// subnormals), zeros, or nice with a sprinkle of specials.
void FillInput(Buffer& b, int32_t dtype, bool is_cache, int mode, uint64_t* rng) {
  const int64_t elem = b.shape.elem;
  const size_t n = b.storage_bytes / elem;
  for (size_t k = 0; k < n; ++k) {
    const uint64_t r = SplitMix(rng);
    double v = (static_cast<double>(r >> 11) * 0x1.0p-53) * 4.0 - 2.0;
    if (is_cache) v = 0.05 + std::fabs(v);  // rms / alpha: positive
    if (mode == 2) v = 0;
    if (mode == 3 && (r & 15) == 0) {
      static const double kSpecial[] = {std::numeric_limits<double>::quiet_NaN(),
                                        std::numeric_limits<double>::infinity(),
                                        -std::numeric_limits<double>::infinity(), 1e-40, 0.0,
                                        65504.0, 1e4, -3e38};
      v = kSpecial[(r >> 4) % 8];
    }
    unsigned char* p = b.storage.get() + k * elem;
    if (mode == 1) {
      std::memcpy(p, &r, elem);
      continue;
    }
    if (elem == 8) {
      std::memcpy(p, &v, 8);
    } else {
      const float f = static_cast<float>(v);
      if (elem == 4) {
        std::memcpy(p, &f, 4);
      } else if (dtype == ATTNRES_DTYPE_FLOAT16) {
        // Truncating float -> half (exponent clamped), good enough for inputs.
        uint32_t u;
        std::memcpy(&u, &f, 4);
        const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
        int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
        uint16_t h = sign;
        if (std::isnan(f)) h = 0x7E00;
        else if (exp >= 31) h |= 0x7C00;
        else if (exp > 0) h |= static_cast<uint16_t>((exp << 10) | ((u >> 13) & 0x3FF));
        std::memcpy(p, &h, 2);
      } else {  // bfloat16 (and unknown dtypes): the top half of the float
        uint32_t u;
        std::memcpy(&u, &f, 4);
        const uint16_t h = static_cast<uint16_t>(u >> 16);
        std::memcpy(p, &h, 2);
      }
    }
  }
}

struct Harness {
  FuzzedDataProvider fdp;
  Op op = kForward;
  bool backward = false;
  attnres_params p{};
  int64_t elem = 2, acc = 4;  // element bytes of the dtype and of its accumulation type
  bool has_partial = false;
  std::vector<Buffer> buffers;
  PointerArray blocks, grad_blocks, query_outs, query_lses, grad_query_outs, grad_query_lses;
  // The buffer behind each pointer field, kNone where this entry point's harness
  // has none (the field keeps its default, NULL, or garbage).
  size_t partial_idx = kNone, w_idx = kNone, gamma_idx = kNone, rms_idx = kNone,
         alpha_idx = kNone, out_idx = kNone, grad_out_idx = kNone, grad_partial_idx = kNone,
         grad_w_idx = kNone, grad_gamma_idx = kNone, query_out_idx = kNone,
         query_lse_idx = kNone, grad_query_out_idx = kNone, grad_query_lse_idx = kNone,
         norm_weight_idx = kNone, grad_norm_weight_idx = kNone, partial_update_idx = kNone,
         new_partial_idx = kNone, grad_partial_in_idx = kNone;
  bool garbage = false;  // the fields the call ignores hold garbage
  std::string mutation = "none";

  Harness(const uint8_t* data, size_t size) : fdp(data, size) {}

  // Likely / unlikely choices: a required pointer passed, a pointer that must be
  // NULL for this entry point passed anyway.
  bool Usually() { return fdp.ConsumeIntegral<uint8_t>() != 0; }
  bool Rarely() { return fdp.ConsumeIntegral<uint8_t>() >= 248; }

  Shape Rows(int64_t stride) const { return {p.num_tokens, stride, p.dim, elem}; }
  Shape Weights(int64_t rows) const { return {rows, p.dim, p.dim, elem}; }  // [rows, dim]
  Shape Column() const { return {p.num_tokens, 1, 1, acc}; }  // [num_tokens] of acc

  size_t Add(const std::string& name, bool is_output, bool present, const Shape& shape,
             bool checked = true) {
    Buffer b;
    b.name = name;
    b.is_output = is_output;
    b.present = present;
    b.checked = checked;
    b.shape = shape;
    b.span_bytes = SpanBytes(shape);
    buffers.push_back(std::move(b));
    return buffers.size() - 1;
  }

  // The `length` entries of a pointer array, each present when a byte is at least
  // `present_from` (1: required, higher: optional).
  void AddEntries(PointerArray& a, const char* name, int64_t length, bool is_output,
                  uint8_t present_from, const Shape& shape) {
    a.built = true;
    for (int64_t i = 0; i < length; ++i) {
      a.entries.push_back(Add(std::string(name) + "[" + std::to_string(i) + "]", is_output,
                              fdp.ConsumeIntegral<uint8_t>() >= present_from, shape, a.checked));
    }
  }

  // Whether the array is passed; the entries of an array passed as NULL are not looked at.
  void SetPresent(PointerArray& a, bool present) {
    a.present = present;
    for (size_t i : a.entries) buffers[i].checked &= present;
  }

  bool AllEntries(const PointerArray& a) const {
    return a.present && std::all_of(a.entries.begin(), a.entries.end(),
                                     [&](size_t i) { return buffers[i].present; });
  }
  bool AnyEntry(const PointerArray& a) const {
    return a.present && std::any_of(a.entries.begin(), a.entries.end(),
                                    [&](size_t i) { return buffers[i].present; });
  }

  // ---- The validation rules of the header, restated independently of src/abi.cc:
  // nullptr when the call must succeed, otherwise why it must fail.

  const char* Violation() const {
    const char* why = CommonViolation();
    if (why == nullptr) {
      why = Phase(op) == 0 ? SingleOpViolation()
            : Phase(op) == 1 ? Phase1Violation()
                             : Phase2Violation();
    }
    return why != nullptr ? why : SpanViolation();
  }

  // Rules of every entry point: the struct, sizes, scalars, the source rows, w.
  const char* CommonViolation() const {
    if (p.abi_version != ATTNRES_ABI_VERSION) return "abi_version";
    if (p.dtype < 0 || p.dtype > 3) return "dtype";
    if (p.device != ATTNRES_DEVICE_CPU) return "device (no CUDA in the fuzz build)";
    if (p.num_tokens < 0) return "num_tokens < 0";
    if (p.dim < 1) return "dim < 1";
    if (p.rmsnorm != 0 && p.rmsnorm != 1) return "rmsnorm";
    if (!std::isfinite(p.scale)) return "scale";
    if (!std::isfinite(p.eps) || p.eps < 0) return "eps";
    // The blocks, partial, and phase 2's query_out all have rows of this stride.
    if (p.source_row_stride < p.dim) return "source_row_stride";
    if (p.proj_weight == nullptr) return "proj_weight NULL";
    return nullptr;
  }

  // `out` of the single op's and phase 2's forward.
  const char* OutViolation() const {
    if (p.out == nullptr) return "out NULL";
    if (p.out_row_stride < p.dim) return "out_row_stride";
    return nullptr;
  }

  // The upstream gradient of the single op's and phase 2's backward, and what a
  // gradient needs to exist (grad_gamma: RMSNorm; grad_partial: a partial block).
  const char* GradOutViolation() const {
    if (p.grad_out == nullptr) return "grad_out NULL";
    if (p.grad_out_row_stride < p.dim) return "grad_out_row_stride";
    if (p.grad_gamma != nullptr && !p.rmsnorm) return "grad_gamma without rmsnorm";
    if (p.grad_partial != nullptr && p.partial == nullptr) return "grad_partial without partial";
    return nullptr;
  }

  const char* SingleOpViolation() const {
    if (p.num_blocks < 0) return "num_blocks < 0";
    if (p.num_blocks + (p.partial != nullptr ? 1 : 0) < 1) return "no source";
    if (p.num_blocks > 0 && !AllEntries(blocks)) return "blocks or blocks[i] NULL";
    if (p.rms_cache != nullptr && !p.rmsnorm) return "rms_cache without rmsnorm";
    if (!backward) return OutViolation();
    if (const char* why = GradOutViolation()) return why;
    if ((p.grad_partial != nullptr || AnyEntry(grad_blocks)) && p.grad_source_row_stride < p.dim) {
      return "grad_source_row_stride";
    }
    return nullptr;
  }

  // Phase 1 mixes the N >= 1 completed blocks (L = N: no partial block) for S queries.
  const char* Phase1Violation() const {
    if (p.num_blocks < 1) return "num_blocks < 1";
    if (p.partial != nullptr) return "partial in phase 1";
    if (p.num_queries < 1) return "num_queries < 1";
    if (!AllEntries(blocks)) return "blocks or blocks[i] NULL";
    if (!backward) {
      if (!AllEntries(query_outs)) return "query_outs or query_outs[s] NULL";
      if (!AllEntries(query_lses)) return "query_lses or query_lses[s] NULL";
      if (p.out_row_stride < p.dim) return "out_row_stride";
      return nullptr;
    }
    if (!grad_query_outs.present) return "grad_query_outs NULL";
    if (p.accumulate_grads != 0 && p.accumulate_grads != 1) return "accumulate_grads";
    if (p.grad_gamma != nullptr && !p.rmsnorm) return "grad_gamma without rmsnorm";
    // A NULL grad_query_outs[s] is zero: the stride matters only with a row read.
    if (AnyEntry(grad_query_outs) && p.grad_out_row_stride < p.dim) return "grad_out_row_stride";
    if (AnyEntry(grad_blocks) && p.grad_source_row_stride < p.dim) return "grad_source_row_stride";
    return nullptr;
  }

  // Phase 2 merges one query's o (and lse) with the optional partial block. Where
  // the header leaves room, these follow the library (see test_two_phase.cc,
  // TwoPhaseValidation): num_blocks must be 0 (phase 2 reads no blocks),
  // norm_weight needs input_norm, new_partial needs partial_update, and the
  // backward rejects partial_update (it reads the updated partial block instead).
  const char* Phase2Violation() const {
    if (p.num_blocks != 0) return "num_blocks != 0 in phase 2";
    if (p.input_norm != 0 && p.input_norm != 1) return "input_norm";
    if (!std::isfinite(p.norm_eps) || p.norm_eps < 0) return "norm_eps";
    if (p.norm_weight != nullptr && !p.input_norm) return "norm_weight without input_norm";
    if (p.query_out == nullptr) return "query_out NULL";
    // h = o without a partial block: lse is only needed for the merge.
    if (p.partial != nullptr && p.query_lse == nullptr) return "query_lse NULL with partial";
    if (!backward) {
      if (const char* why = OutViolation()) return why;
      if (p.partial_update != nullptr && p.partial == nullptr) return "partial_update alone";
      if ((p.partial_update != nullptr) != (p.new_partial != nullptr)) {
        return "partial_update without new_partial or the reverse";
      }
      return nullptr;
    }
    if (const char* why = GradOutViolation()) return why;
    if (p.grad_norm_weight != nullptr && !p.input_norm) return "grad_norm_weight, no input_norm";
    if (p.partial_update != nullptr) return "partial_update in the backward";
    if (p.grad_partial_in != nullptr && p.grad_partial == nullptr) return "grad_partial_in alone";
    if ((p.grad_partial != nullptr || p.grad_query_out != nullptr) &&
        p.grad_source_row_stride < p.dim) {
      return "grad_source_row_stride";
    }
    return nullptr;
  }

  // Spans: aligned, within int64 bytes and the address space; outputs disjoint
  // from every other buffer.
  const char* SpanViolation() const {
    std::vector<const Buffer*> spans;
    for (const Buffer& b : buffers) {
      if (!b.NonEmpty() || !b.checked) continue;
      if (reinterpret_cast<uintptr_t>(b.ptr) % b.shape.elem != 0) return "misaligned";
      if (b.Overflows()) return "span overflows int64";
      const unsigned __int128 end =
          static_cast<unsigned __int128>(reinterpret_cast<uintptr_t>(b.ptr)) + b.span_bytes;
      if (end > std::numeric_limits<uintptr_t>::max()) return "span wraps";
      spans.push_back(&b);
    }
    for (size_t a = 0; a < spans.size(); ++a) {
      for (size_t c = a + 1; c < spans.size(); ++c) {
        if (!spans[a]->is_output && !spans[c]->is_output) continue;
        const uintptr_t a0 = reinterpret_cast<uintptr_t>(spans[a]->ptr);
        const uintptr_t c0 = reinterpret_cast<uintptr_t>(spans[c]->ptr);
        const uintptr_t a1 = a0 + static_cast<uintptr_t>(spans[a]->span_bytes);
        const uintptr_t c1 = c0 + static_cast<uintptr_t>(spans[c]->span_bytes);
        if (a0 < c1 && c0 < a1) return kOverlap;
      }
    }
    return nullptr;
  }

  // ---- The descriptor.

  // The fields every entry point reads, consumed in the order of the harness of
  // the single op alone, whose first byte was the direction bit: byte % kNumOps
  // keeps that bit, so a shipped seed that still picks the single op keeps its meaning.
  void BuildCommon() {
    op = static_cast<Op>(fdp.ConsumeIntegral<uint8_t>() % kNumOps);
    backward = IsBackward(op);
    attnres_params_init(&p);
    if (fdp.ConsumeIntegral<uint8_t>() == 255) p.abi_version = fdp.ConsumeIntegral<int32_t>();
    p.dtype = PickEnum(fdp, 4);
    if (fdp.ConsumeIntegral<uint8_t>() >= 250) p.device = PickEnum(fdp, 2);
    p.num_tokens = PickSize(fdp, 40);
    p.dim = PickSize(fdp, 80);
    if (p.dim == 0 && fdp.ConsumeBool()) p.dim = 1;
    if (Phase(op) == 2) {  // reads no blocks: mostly 0
      p.num_blocks = Usually() ? 0 : PickSize(fdp, 5);
    } else {
      p.num_blocks = PickSize(fdp, 5);
      if (Phase(op) == 1 && p.num_blocks == 0 && fdp.ConsumeBool()) p.num_blocks = 1;
    }
    has_partial = Phase(op) == 1 ? Rarely() : fdp.ConsumeBool();
    p.rmsnorm = PickEnum(fdp, 2);
    p.scale = PickScalar(fdp, 1.0 / std::sqrt(static_cast<double>(p.dim > 0 ? p.dim : 1)));
    p.eps = PickScalar(fdp, 1e-6);
    p.source_row_stride = PickStride(fdp, p.dim);
    p.out_row_stride = PickStride(fdp, p.dim);
    p.grad_out_row_stride = PickStride(fdp, p.dim);
    p.grad_source_row_stride = PickStride(fdp, p.dim);
    elem = p.dtype == ATTNRES_DTYPE_FLOAT64 ? 8 : p.dtype == ATTNRES_DTYPE_FLOAT32 ? 4 : 2;
    acc = p.dtype == ATTNRES_DTYPE_FLOAT64 ? 8 : 4;
  }

  void AddBlocks() {
    AddEntries(blocks, "blocks", ArrayLength(&p.num_blocks), false, 1,
               Rows(p.source_row_stride));
  }

  void Build() {
    BuildCommon();
    switch (Phase(op)) {
      case 0: BuildSingleOp(); break;
      case 1: BuildPhase1(); break;
      default: BuildPhase2(); break;
    }
  }

  // Both directions' fields are backed (the other direction's must stay untouched).
  void BuildSingleOp() {
    AddBlocks();
    const int64_t L = std::max<int64_t>(p.num_blocks, 0) + (has_partial ? 1 : 0);
    const Shape cache{p.num_tokens, L, L, acc};
    partial_idx = Add("partial", false, has_partial, Rows(p.source_row_stride));
    w_idx = Add("proj_weight", false, Usually(), Weights(1));
    gamma_idx = Add("gamma", false, fdp.ConsumeBool(), Weights(1));
    const bool caches = fdp.ConsumeBool();
    rms_idx = Add("rms_cache", !backward,
                  caches && fdp.ConsumeIntegral<uint8_t>() < 230
                      ? p.rmsnorm == 1 || fdp.ConsumeBool()
                      : false,
                  cache);
    alpha_idx = Add("alpha_cache", !backward, caches && fdp.ConsumeBool(), cache);
    out_idx = Add("out", true, Usually(), Rows(p.out_row_stride), !backward);
    grad_out_idx = Add("grad_out", false, Usually(), Rows(p.grad_out_row_stride), backward);
    const bool grad_array = Usually();
    SetPresent(blocks, p.num_blocks > 0 ? Usually() : !fdp.ConsumeBool());
    grad_blocks.checked = backward;
    AddEntries(grad_blocks, "grad_blocks", ArrayLength(&p.num_blocks), true, 40,
               Rows(p.grad_source_row_stride));
    SetPresent(grad_blocks, grad_array);
    grad_partial_idx = Add("grad_partial", true,
                           fdp.ConsumeIntegral<uint8_t>() < 250 ? has_partial : true,
                           Rows(p.grad_source_row_stride), backward);
    grad_w_idx = Add("grad_proj_weight", true, fdp.ConsumeBool(), Weights(1), backward);
    grad_gamma_idx = Add("grad_gamma", true,
                         fdp.ConsumeBool() && (p.rmsnorm == 1 || fdp.ConsumeBool()), Weights(1),
                         backward);
  }

  // The weights and their gradients are [S, dim]; one o and lse per query.
  void BuildPhase1() {
    p.num_queries = PickSize(fdp, 4);
    if (p.num_queries == 0 && fdp.ConsumeBool()) p.num_queries = 1;
    const int64_t queries = ArrayLength(&p.num_queries);
    AddBlocks();
    SetPresent(blocks, Usually());
    partial_idx = Add("partial", false, has_partial, Rows(p.source_row_stride));
    w_idx = Add("proj_weight", false, Usually(), Weights(p.num_queries));
    gamma_idx = Add("gamma", false, fdp.ConsumeBool(), Weights(p.num_queries));
    if (!backward) {
      AddEntries(query_outs, "query_outs", queries, true, 1, Rows(p.out_row_stride));
      SetPresent(query_outs, Usually());
      AddEntries(query_lses, "query_lses", queries, true, 1, Column());
      SetPresent(query_lses, Usually());
      return;
    }
    AddEntries(grad_query_outs, "grad_query_outs", queries, false, 40, Rows(p.grad_out_row_stride));
    SetPresent(grad_query_outs, Usually());
    AddEntries(grad_query_lses, "grad_query_lses", queries, false, 40, Column());
    SetPresent(grad_query_lses, fdp.ConsumeBool());
    p.accumulate_grads = PickEnum(fdp, 2);
    AddEntries(grad_blocks, "grad_blocks", ArrayLength(&p.num_blocks), true, 40,
               Rows(p.grad_source_row_stride));
    SetPresent(grad_blocks, fdp.ConsumeIntegral<uint8_t>() >= 40);
    grad_w_idx = Add("grad_proj_weight", true, fdp.ConsumeBool(), Weights(p.num_queries));
    grad_gamma_idx = Add("grad_gamma", true, fdp.ConsumeBool() && (p.rmsnorm == 1 || Rarely()),
                         Weights(p.num_queries));
  }

  // One query: o and its partial block rows share source_row_stride; weights are [dim].
  void BuildPhase2() {
    p.input_norm = PickEnum(fdp, 2);
    p.norm_eps = PickScalar(fdp, 1e-6);
    AddBlocks();
    SetPresent(blocks, Usually());
    partial_idx = Add("partial", false, has_partial, Rows(p.source_row_stride));
    query_out_idx = Add("query_out", false, Usually(), Rows(p.source_row_stride));
    query_lse_idx = Add("query_lse", false, has_partial ? Usually() : fdp.ConsumeBool(), Column());
    w_idx = Add("proj_weight", false, Usually(), Weights(1));
    gamma_idx = Add("gamma", false, fdp.ConsumeBool(), Weights(1));
    norm_weight_idx = Add("norm_weight", false,
                          fdp.ConsumeBool() && (p.input_norm == 1 || Rarely()), Weights(1));
    if (!backward) {
      out_idx = Add("out", true, Usually(), Rows(p.out_row_stride));
      const bool update = has_partial ? fdp.ConsumeBool() : Rarely();
      partial_update_idx = Add("partial_update", false, update, Rows(p.source_row_stride));
      new_partial_idx = Add("new_partial", true, update ? Usually() : Rarely(),
                            Rows(p.out_row_stride));
      return;
    }
    grad_out_idx = Add("grad_out", false, Usually(), Rows(p.grad_out_row_stride));
    partial_update_idx = Add("partial_update", false, Rarely(), Rows(p.source_row_stride));
    const bool grad_partial = has_partial ? fdp.ConsumeBool() : Rarely();
    grad_partial_idx = Add("grad_partial", true, grad_partial, Rows(p.grad_source_row_stride));
    grad_partial_in_idx = Add("grad_partial_in", false, grad_partial ? fdp.ConsumeBool() : Rarely(),
                              Rows(p.grad_out_row_stride));
    grad_query_out_idx = Add("grad_query_out", true, fdp.ConsumeBool(),
                             Rows(p.grad_source_row_stride));
    grad_query_lse_idx = Add("grad_query_lse", true, fdp.ConsumeBool(), Column());
    grad_w_idx = Add("grad_proj_weight", true, fdp.ConsumeBool(), Weights(1));
    grad_gamma_idx = Add("grad_gamma", true, fdp.ConsumeBool() && (p.rmsnorm == 1 || Rarely()),
                         Weights(1));
    grad_norm_weight_idx = Add("grad_norm_weight", true,
                               fdp.ConsumeBool() && (p.input_norm == 1 || Rarely()), Weights(1));
  }

  // ---- Memory and pointers.

  // Allocates every buffer the call may touch; returns false when the
  // descriptor is valid but too big to back with memory.
  bool Allocate(bool descriptor_invalid) {
    __int128 total = 0;
    for (const Buffer& b : buffers) {
      if (b.present && b.span_bytes > 0) total += b.span_bytes;  // < 0: negative stride
    }
    const bool affordable = total <= kMaxBufferBytes;
    if (!affordable && !descriptor_invalid) return false;
    const int mode = fdp.ConsumeIntegralInRange<int>(0, 3);
    uint64_t rng = fdp.ConsumeIntegral<uint64_t>();
    for (size_t i = 0; i < buffers.size(); ++i) {
      Buffer& b = buffers[i];
      if (!b.present) continue;
      // Stand-ins for spans that cannot be backed: the call must fail before
      // touching them, and ASan reports any access beyond their 64 bytes.
      const __int128 want = affordable ? b.span_bytes : std::min<__int128>(b.span_bytes, 64);
      b.storage_bytes = static_cast<size_t>(want > 0 ? want : 0);
      b.storage.reset(new unsigned char[b.storage_bytes]);
      b.ptr = b.storage.get();
      if (b.is_output) {
        std::memset(b.ptr, kSentinel, b.storage_bytes);
      } else {
        FillInput(b, p.dtype, i == rms_idx || i == alpha_idx, mode, &rng);
      }
    }
    return true;
  }

  // At most one pointer-level change.
  void Mutate() {
    const uint8_t kind = fdp.ConsumeIntegral<uint8_t>() % 8;
    auto pick = [&](auto&& filter) -> Buffer* {
      std::vector<Buffer*> candidates;
      for (Buffer& b : buffers) {
        if (filter(b)) candidates.push_back(&b);
      }
      if (candidates.empty()) return nullptr;
      return candidates[fdp.ConsumeIntegralInRange<size_t>(0, candidates.size() - 1)];
    };
    auto checked_nonempty = [&](const Buffer& b) { return b.NonEmpty() && b.checked; };
    switch (kind) {
      case 1: {  // misalign a pointer validation looks at
        if (Buffer* b = pick(checked_nonempty)) {
          b->ptr += fdp.ConsumeIntegralInRange<int64_t>(1, b->shape.elem - 1);
          mutation = "misaligned " + b->name;
        }
        break;
      }
      case 2: {  // point an output into another buffer (input or output)
        Buffer* out = pick([&](const Buffer& b) { return b.is_output && checked_nonempty(b); });
        Buffer* into = pick(checked_nonempty);
        if (out != nullptr && into != nullptr && out != into && into->storage_bytes > 0) {
          const size_t offset = fdp.ConsumeIntegralInRange<size_t>(0, into->storage_bytes - 1);
          out->ptr = into->storage.get() + offset / out->shape.elem * out->shape.elem;
          mutation = out->name + " into " + into->name;
        }
        break;
      }
      case 3: {  // two inputs share memory: allowed
        Buffer* a = pick([&](const Buffer& b) { return !b.is_output && b.present; });
        Buffer* c = pick([&](const Buffer& b) { return !b.is_output && b.present; });
        if (a != nullptr && c != nullptr && a != c && a->shape.rows == c->shape.rows &&
            a->shape.stride == c->shape.stride && a->shape.cols == c->shape.cols &&
            a->shape.elem == c->shape.elem) {
          a->ptr = c->ptr;
          mutation = a->name + " aliases " + c->name;
        }
        break;
      }
      case 4: {  // a span that wraps the address space
        if (Buffer* b = pick(checked_nonempty)) {
          // The highest aligned address: any span of >= 1 element wraps.
          const uintptr_t top = std::numeric_limits<uintptr_t>::max();
          b->ptr = reinterpret_cast<unsigned char*>(top / b->shape.elem * b->shape.elem);
          mutation = b->name + " at the top of the address space";
        }
        break;
      }
      case 5: {  // ignored fields hold garbage: never validated, never dereferenced
        garbage = true;  // the pointers: FillParams
        const int64_t stride = fdp.ConsumeIntegral<int64_t>();
        if (backward) {
          p.out_row_stride = stride;
        } else {
          p.grad_out_row_stride = p.grad_source_row_stride = stride;
        }
        if (Phase(op) != 1) p.num_queries = kI64Min;
        if (op != kPhase1Backward) p.accumulate_grads = -1;
        if (Phase(op) != 2) {
          p.input_norm = -1;
          p.norm_eps = std::numeric_limits<double>::quiet_NaN();
        }
        mutation = "garbage in ignored fields";
        break;
      }
      default: break;  // 0, 6, 7: no mutation (most inputs)
    }
  }

  // Every pointer field at kGarbage (the CUDA stream too: ignored on the CPU);
  // FillParams then sets the fields this entry point reads.
  void PointersToGarbage() {
    p.stream = kGarbage;
    p.blocks = p.grad_query_outs = p.grad_query_lses = static_cast<const void* const*>(kGarbage);
    p.grad_blocks = p.query_outs = p.query_lses = static_cast<void* const*>(kGarbage);
    p.partial = p.proj_weight = p.gamma = p.grad_out = p.query_out = p.query_lse = p.norm_weight =
        p.partial_update = p.grad_partial_in = kGarbage;
    p.out = p.rms_cache = p.alpha_cache = p.grad_partial = p.grad_proj_weight = p.grad_gamma =
        p.grad_query_out = p.grad_query_lse = p.grad_norm_weight = p.new_partial = kGarbage;
  }

  void* Pointer(const Buffer& b) const {
    if (garbage && !b.checked) return kGarbage;
    return b.present ? b.ptr : nullptr;
  }

  template <typename Field>
  void SetArray(Field& field, PointerArray& a) {
    if (!a.built) return;
    if (garbage && !a.checked) {
      field = static_cast<Field>(kGarbage);
      return;
    }
    a.ptrs.clear();
    for (size_t i : a.entries) a.ptrs.push_back(Pointer(buffers[i]));
    // An empty array is never read: any non-NULL address.
    static void* const kEmpty[1] = {nullptr};
    field = !a.present ? nullptr : a.ptrs.empty() ? kEmpty : a.ptrs.data();
  }

  void FillParams() {
    if (garbage) PointersToGarbage();
    SetArray(p.blocks, blocks);
    SetArray(p.grad_blocks, grad_blocks);
    SetArray(p.query_outs, query_outs);
    SetArray(p.query_lses, query_lses);
    SetArray(p.grad_query_outs, grad_query_outs);
    SetArray(p.grad_query_lses, grad_query_lses);
    auto set = [&](auto& field, size_t i) {
      if (i != kNone) field = Pointer(buffers[i]);
    };
    set(p.partial, partial_idx);
    set(p.proj_weight, w_idx);
    set(p.gamma, gamma_idx);
    set(p.rms_cache, rms_idx);
    set(p.alpha_cache, alpha_idx);
    set(p.out, out_idx);
    set(p.grad_out, grad_out_idx);
    set(p.grad_partial, grad_partial_idx);
    set(p.grad_proj_weight, grad_w_idx);
    set(p.grad_gamma, grad_gamma_idx);
    set(p.query_out, query_out_idx);
    set(p.query_lse, query_lse_idx);
    set(p.grad_query_out, grad_query_out_idx);
    set(p.grad_query_lse, grad_query_lse_idx);
    set(p.norm_weight, norm_weight_idx);
    set(p.grad_norm_weight, grad_norm_weight_idx);
    set(p.partial_update, partial_update_idx);
    set(p.new_partial, new_partial_idx);
    set(p.grad_partial_in, grad_partial_in_idx);
  }

  void Snapshot() {
    for (Buffer& b : buffers) {
      if (b.present && !b.is_output && b.storage != nullptr) {
        b.snapshot.assign(b.storage.get(), b.storage.get() + b.storage_bytes);
      }
    }
    // Outputs that are pointed into another buffer are compared via that buffer.
  }

  // ---- The checks.

  std::string Describe() const {
    char s[768];
    std::snprintf(s, sizeof(s),
                  "%s dtype=%d device=%d tokens=%lld dim=%lld N=%lld S=%lld partial=%d "
                  "rmsnorm=%d scale=%g eps=%g accumulate=%d input_norm=%d norm_eps=%g "
                  "strides src=%lld out=%lld gout=%lld gsrc=%lld mutation=%s",
                  kOpNames[op], p.dtype, p.device, static_cast<long long>(p.num_tokens),
                  static_cast<long long>(p.dim), static_cast<long long>(p.num_blocks),
                  static_cast<long long>(p.num_queries), has_partial, p.rmsnorm, p.scale, p.eps,
                  p.accumulate_grads, p.input_norm, p.norm_eps,
                  static_cast<long long>(p.source_row_stride),
                  static_cast<long long>(p.out_row_stride),
                  static_cast<long long>(p.grad_out_row_stride),
                  static_cast<long long>(p.grad_source_row_stride), mutation.c_str());
    return s;
  }

  // Every byte of an output's storage still holds the sentinel.
  static bool Untouched(const Buffer& b) {
    return std::all_of(b.storage.get(), b.storage.get() + b.storage_bytes,
                       [](unsigned char c) { return c == kSentinel; });
  }

  // `why`: the harness's reason the call must fail, nullptr if it must succeed.
  void Check(attnres_status status, const char* why) {
    const bool valid = why == nullptr;
    const std::string where = Describe() + (valid ? "" : std::string(" (invalid: ") + why + ")");
    const int code = static_cast<int>(status);
    if (code < ATTNRES_OK || code > ATTNRES_ERROR_INTERNAL) Bug("unknown status", where);
    if (valid && status != ATTNRES_OK) Bug("a valid call failed", where);
    if (!valid && status == ATTNRES_OK) Bug("an invalid call succeeded", where);
    for (const Buffer& b : buffers) {
      if (!b.snapshot.empty() &&
          std::memcmp(b.snapshot.data(), b.storage.get(), b.storage_bytes) != 0) {
        Bug("an input was modified", where + " buffer " + b.name);
      }
    }
    if (status != ATTNRES_OK) {
      const std::string msg = attnres_last_error();
      if (msg.rfind(kOpNames[op], 0) != 0) Bug("last error does not name the function", where);
      for (const Buffer& b : buffers) {
        if (b.is_output && !Untouched(b)) {
          Bug("an output was written by a failed call", where + " " + b.name);
        }
      }
      return;
    }
    // Success: outputs the call does not look at and the padding between the
    // rows of strided outputs are untouched.
    for (const Buffer& b : buffers) {
      if (!b.is_output || b.storage == nullptr || b.ptr != b.storage.get()) continue;
      if (!b.checked) {
        if (!Untouched(b)) Bug("an output the call ignores was written", where + " " + b.name);
        continue;
      }
      const Shape& s = b.shape;
      for (int64_t r = 0; r + 1 < s.rows; ++r) {
        for (int64_t k = s.cols; k < s.stride; ++k) {
          if (b.storage[(r * s.stride + k) * s.elem] != kSentinel) {
            Bug("padding between output rows was written", where + " " + b.name);
          }
        }
      }
    }
  }
};

// Outcome counts per entry point, printed at exit when ATTNRES_FUZZ_STATS is set
// (scripts/fuzz.sh does): proof that the inputs reach the kernels of every entry
// point and not only the validation.
struct Stats {
  long computed[kNumOps] = {}, rejected[kNumOps] = {}, skipped[kNumOps] = {};
  ~Stats() {
    if (std::getenv("ATTNRES_FUZZ_STATS") == nullptr) return;
    for (int op = 0; op < kNumOps; ++op) {
      std::fprintf(stderr,
                   "attnres fuzz outcomes of %-23s: %ld calls computed, %ld rejected by "
                   "validation, %ld skipped (valid but too big to back)\n",
                   kOpNames[op], computed[op], rejected[op], skipped[op]);
    }
  }
};
Stats g_stats;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Harness h(data, size);
  h.Build();
  // Violation needs pointers; decide "invalid regardless of memory" on the
  // descriptor first, with every present buffer at a dummy aligned address.
  alignas(64) static unsigned char dummy[64];
  for (Buffer& b : h.buffers) b.ptr = b.present ? dummy : nullptr;
  h.FillParams();
  // Overlap of the dummies is not a property of the descriptor.
  const char* why = h.Violation();
  if (!h.Allocate(why != nullptr && why != kOverlap)) {
    ++g_stats.skipped[h.op];
    return 0;
  }
  h.Mutate();
  const uint8_t setup = h.fdp.ConsumeIntegral<uint8_t>();
  h.FillParams();
  h.Snapshot();
  why = h.Violation();

  attnres_set_num_threads(1 + (setup & 1));
  attnres_set_cpu_isa((setup & 2) ? "baseline" : nullptr);
  const attnres_status status = kEntryPoints[h.op](&h.p);
  h.Check(status, why);
  ++(status == ATTNRES_OK ? g_stats.computed : g_stats.rejected)[h.op];
  return 0;
}
