// libFuzzer target for the C ABI (attnres_forward / attnres_backward).
//
// Each input drives one random descriptor: sizes (0, small, negative, huge),
// every dtype and flag value (known and unknown), scale/eps (finite, 0, NaN,
// Inf, negative), row strides (dense, padded, below dim, beyond 2^31), optional
// pointers present or NULL, and then at most one pointer mutation: a required
// pointer set to NULL, a pointer misaligned, an output pointed into another
// buffer, inputs aliased (allowed), a span that wraps the address space.
//
// The harness carries its own statement of the validation rules of
// include/attnres/attnres.h (ExpectedValid below) and checks, for every call:
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
// in backward). A valid descriptor whose buffers exceed kMaxBufferBytes is
// skipped (its memory cannot be provided).
#include <fuzzer/FuzzedDataProvider.h>

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
constexpr unsigned char kSentinel = 0xA5;

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

uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One buffer of the call: what the descriptor says, and what is passed.
struct Buffer {
  std::string name;
  bool is_output = false;
  bool present = false;  // non-NULL in the params
  int64_t rows = 0, stride = 0, cols = 0, elem = 1;
  __int128 span_bytes = 0;  // (rows - 1) * stride + cols elements, in bytes; 0 if rows == 0
  std::unique_ptr<unsigned char[]> storage;
  size_t storage_bytes = 0;
  unsigned char* ptr = nullptr;  // what the params get (may differ from storage)
  std::vector<unsigned char> snapshot;

  bool NonEmpty() const { return present && rows > 0; }
  bool Overflows() const { return span_bytes > kI64Max; }
};

__int128 SpanBytes(int64_t rows, int64_t stride, int64_t cols, int64_t elem) {
  if (rows <= 0) return 0;
  // |elems| < 2^127; capped so that the byte count cannot overflow either.
  const __int128 elems = static_cast<__int128>(rows - 1) * stride + cols;
  const __int128 cap = static_cast<__int128>(1) << 100;
  return (elems > cap ? cap : elems < -cap ? -cap : elems) * elem;
}

// Input values in the storage dtype: nice (|x| <= 2), any bits (NaN, Inf,
// subnormals), zeros, or nice with a sprinkle of specials.
void FillInput(Buffer& b, int32_t dtype, bool is_cache, int mode, uint64_t* rng) {
  const size_t n = b.storage_bytes / b.elem;
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
    unsigned char* p = b.storage.get() + k * b.elem;
    if (mode == 1) {
      std::memcpy(p, &r, b.elem);
      continue;
    }
    if (b.elem == 8) {
      std::memcpy(p, &v, 8);
    } else {
      const float f = static_cast<float>(v);
      if (b.elem == 4) {
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
  attnres_params p{};
  bool backward = false;
  std::vector<Buffer> buffers;  // blocks, partial, w, gamma, caches, then direction-specific
  std::vector<const void*> block_ptrs;
  std::vector<void*> grad_ptrs;
  bool grad_array_present = false;
  bool blocks_array_null = false;  // blocks = NULL (required when num_blocks > 0)
  // Index lists into `buffers`.
  std::vector<size_t> block_idx, grad_block_idx;
  size_t partial_idx = 0, w_idx = 0, gamma_idx = 0, out_idx = 0, rms_idx = 0, alpha_idx = 0,
         grad_out_idx = 0, grad_partial_idx = 0, grad_w_idx = 0, grad_gamma_idx = 0;
  std::string mutation = "none";
  bool mutation_forces_failure = false;

  Harness(const uint8_t* data, size_t size) : fdp(data, size) {}

  size_t Add(const std::string& name, bool is_output, bool present, int64_t rows, int64_t stride,
             int64_t cols, int64_t elem) {
    Buffer b;
    b.name = name;
    b.is_output = is_output;
    b.present = present;
    b.rows = rows;
    b.stride = stride;
    b.cols = cols;
    b.elem = elem;
    b.span_bytes = SpanBytes(rows, stride, cols, elem);
    buffers.push_back(std::move(b));
    return buffers.size() - 1;
  }

  // The validation rules of the header, restated independently of src/abi.cc.
  bool ExpectedValid(std::string* why) const {
    auto fail = [&](const char* reason) {
      *why = reason;
      return false;
    };
    if (p.abi_version != ATTNRES_ABI_VERSION) return fail("abi_version");
    if (p.dtype < 0 || p.dtype > 3) return fail("dtype");
    if (p.device != ATTNRES_DEVICE_CPU) return fail("device (no CUDA in the fuzz build)");
    if (p.num_tokens < 0) return fail("num_tokens < 0");
    if (p.dim < 1) return fail("dim < 1");
    if (p.num_blocks < 0) return fail("num_blocks < 0");
    if (p.num_blocks + (p.partial != nullptr ? 1 : 0) < 1) return fail("no source");
    if (p.rmsnorm != 0 && p.rmsnorm != 1) return fail("rmsnorm");
    if (!std::isfinite(p.scale)) return fail("scale");
    if (!std::isfinite(p.eps) || p.eps < 0) return fail("eps");
    if (p.source_row_stride < p.dim) return fail("source_row_stride");
    if (p.num_blocks > 0 && p.blocks == nullptr) return fail("blocks NULL");
    for (size_t i : block_idx) {
      if (!buffers[i].present) return fail("blocks[i] NULL");
    }
    if (p.proj_weight == nullptr) return fail("proj_weight NULL");
    if (p.rms_cache != nullptr && !p.rmsnorm) return fail("rms_cache without rmsnorm");
    if (!backward) {
      if (p.out == nullptr) return fail("out NULL");
      if (p.out_row_stride < p.dim) return fail("out_row_stride");
    } else {
      if (p.grad_out == nullptr) return fail("grad_out NULL");
      if (p.grad_out_row_stride < p.dim) return fail("grad_out_row_stride");
      if (p.grad_gamma != nullptr && !p.rmsnorm) return fail("grad_gamma without rmsnorm");
      if (p.grad_partial != nullptr && p.partial == nullptr) return fail("grad_partial alone");
      bool any_source_grad = p.grad_partial != nullptr;
      for (size_t i : grad_block_idx) any_source_grad |= grad_array_present && buffers[i].present;
      if (any_source_grad && p.grad_source_row_stride < p.dim) return fail("grad_source stride");
    }
    // Spans: aligned, within int64 bytes and the address space; outputs disjoint.
    std::vector<const Buffer*> spans;
    for (const Buffer& b : buffers) {
      if (!b.NonEmpty() || !Checked(b)) continue;
      if (reinterpret_cast<uintptr_t>(b.ptr) % b.elem != 0) return fail("misaligned");
      if (b.Overflows()) return fail("span overflows int64");
      const unsigned __int128 end =
          static_cast<unsigned __int128>(reinterpret_cast<uintptr_t>(b.ptr)) + b.span_bytes;
      if (end > std::numeric_limits<uintptr_t>::max()) return fail("span wraps");
      spans.push_back(&b);
    }
    for (size_t a = 0; a < spans.size(); ++a) {
      for (size_t c = a + 1; c < spans.size(); ++c) {
        if (!spans[a]->is_output && !spans[c]->is_output) continue;
        const uintptr_t a0 = reinterpret_cast<uintptr_t>(spans[a]->ptr);
        const uintptr_t c0 = reinterpret_cast<uintptr_t>(spans[c]->ptr);
        const uintptr_t a1 = a0 + static_cast<uintptr_t>(spans[a]->span_bytes);
        const uintptr_t c1 = c0 + static_cast<uintptr_t>(spans[c]->span_bytes);
        if (a0 < c1 && c0 < a1) return fail("outputs overlap");
      }
    }
    return true;
  }

  // Whether validation looks at this buffer in this direction.
  bool Checked(const Buffer& b) const {
    if (&b == &buffers[out_idx]) return !backward;
    if (&b == &buffers[grad_out_idx] || &b == &buffers[grad_partial_idx] ||
        &b == &buffers[grad_w_idx] || &b == &buffers[grad_gamma_idx]) {
      return backward;
    }
    for (size_t i : grad_block_idx) {
      if (&b == &buffers[i]) return backward && grad_array_present;
    }
    return true;
  }

  void Build() {
    backward = fdp.ConsumeBool();
    attnres_params_init(&p);
    if (fdp.ConsumeIntegral<uint8_t>() == 255) p.abi_version = fdp.ConsumeIntegral<int32_t>();
    p.dtype = PickEnum(fdp, 4);
    if (fdp.ConsumeIntegral<uint8_t>() >= 250) p.device = PickEnum(fdp, 2);
    p.num_tokens = PickSize(fdp, 40);
    p.dim = PickSize(fdp, 80);
    if (p.dim == 0 && fdp.ConsumeBool()) p.dim = 1;
    p.num_blocks = PickSize(fdp, 5);
    const bool has_partial = fdp.ConsumeBool();
    p.rmsnorm = PickEnum(fdp, 2);
    p.scale = PickScalar(fdp, 1.0 / std::sqrt(static_cast<double>(p.dim > 0 ? p.dim : 1)));
    p.eps = PickScalar(fdp, 1e-6);
    p.source_row_stride = PickStride(fdp, p.dim);
    p.out_row_stride = PickStride(fdp, p.dim);
    p.grad_out_row_stride = PickStride(fdp, p.dim);
    p.grad_source_row_stride = PickStride(fdp, p.dim);

    const int64_t elem = p.dtype == ATTNRES_DTYPE_FLOAT64   ? 8
                         : p.dtype == ATTNRES_DTYPE_FLOAT32 ? 4
                                                            : 2;
    const int64_t acc = p.dtype == ATTNRES_DTYPE_FLOAT64 ? 8 : 4;
    // The blocks array itself is caller memory of num_blocks entries: only
    // counts that can be allocated are generated (a longer claimed array is a
    // caller bug the library cannot detect).
    const int64_t n = p.num_blocks > 0 ? std::min<int64_t>(p.num_blocks, 300) : 0;
    if (p.num_blocks > 300) p.num_blocks = n;
    const int64_t L = (p.num_blocks > 0 ? p.num_blocks : 0) + (has_partial ? 1 : 0);
    const int64_t rows = p.num_tokens, dim = p.dim;
    buffers.reserve(2 * n + 16);
    for (int64_t i = 0; i < n; ++i) {
      block_idx.push_back(Add("blocks[" + std::to_string(i) + "]", false,
                              fdp.ConsumeIntegral<uint8_t>() != 0, rows, p.source_row_stride,
                              dim, elem));
    }
    partial_idx = Add("partial", false, has_partial, rows, p.source_row_stride, dim, elem);
    w_idx = Add("proj_weight", false, fdp.ConsumeIntegral<uint8_t>() != 0, 1, dim, dim, elem);
    gamma_idx = Add("gamma", false, fdp.ConsumeBool(), 1, dim, dim, elem);
    const bool caches = fdp.ConsumeBool();
    rms_idx = Add("rms_cache", !backward, caches && fdp.ConsumeIntegral<uint8_t>() < 230 ? p.rmsnorm == 1 || fdp.ConsumeBool() : false, rows, L, L, acc);
    alpha_idx = Add("alpha_cache", !backward, caches && fdp.ConsumeBool(), rows, L, L, acc);
    out_idx = Add("out", true, fdp.ConsumeIntegral<uint8_t>() != 0, rows, p.out_row_stride, dim,
                  elem);
    grad_out_idx = Add("grad_out", false, fdp.ConsumeIntegral<uint8_t>() != 0, rows,
                       p.grad_out_row_stride, dim, elem);
    grad_array_present = fdp.ConsumeIntegral<uint8_t>() != 0;
    blocks_array_null = p.num_blocks > 0 ? fdp.ConsumeIntegral<uint8_t>() == 0 : fdp.ConsumeBool();
    for (int64_t i = 0; i < n; ++i) {
      grad_block_idx.push_back(Add("grad_blocks[" + std::to_string(i) + "]", true,
                                   fdp.ConsumeIntegral<uint8_t>() >= 40, rows,
                                   p.grad_source_row_stride, dim, elem));
    }
    grad_partial_idx = Add("grad_partial", true,
                           fdp.ConsumeIntegral<uint8_t>() < 250 ? has_partial : true, rows,
                           p.grad_source_row_stride, dim, elem);
    grad_w_idx = Add("grad_proj_weight", true, fdp.ConsumeBool(), 1, dim, dim, elem);
    grad_gamma_idx = Add("grad_gamma", true, fdp.ConsumeBool() && (p.rmsnorm == 1 || fdp.ConsumeBool()),
                         1, dim, dim, elem);
  }

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
    for (Buffer& b : buffers) {
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
        FillInput(b, p.dtype, &b == &buffers[rms_idx] || &b == &buffers[alpha_idx], mode, &rng);
      }
    }
    return true;
  }

  // At most one pointer-level change; records whether it must make the call fail.
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
    auto checked_nonempty = [&](const Buffer& b) { return b.NonEmpty() && Checked(b); };
    switch (kind) {
      case 1: {  // misalign a pointer validation looks at
        if (Buffer* b = pick(checked_nonempty)) {
          b->ptr += fdp.ConsumeIntegralInRange<int64_t>(1, b->elem - 1);
          mutation = "misaligned " + b->name;
        }
        break;
      }
      case 2: {  // point an output into another buffer (input or output)
        Buffer* out = pick([&](const Buffer& b) { return b.is_output && checked_nonempty(b); });
        Buffer* into = pick(checked_nonempty);
        if (out != nullptr && into != nullptr && out != into && into->storage_bytes > 0) {
          const size_t offset = fdp.ConsumeIntegralInRange<size_t>(0, into->storage_bytes - 1);
          out->ptr = into->storage.get() + offset / out->elem * out->elem;
          mutation = out->name + " into " + into->name;
        }
        break;
      }
      case 3: {  // two inputs share memory: allowed
        Buffer* a = pick([&](const Buffer& b) { return !b.is_output && b.present; });
        Buffer* c = pick([&](const Buffer& b) { return !b.is_output && b.present; });
        if (a != nullptr && c != nullptr && a != c && a->rows == c->rows &&
            a->stride == c->stride && a->cols == c->cols && a->elem == c->elem) {
          a->ptr = c->ptr;
          mutation = a->name + " aliases " + c->name;
        }
        break;
      }
      case 4: {  // a span that wraps the address space
        if (Buffer* b = pick(checked_nonempty)) {
          // The highest aligned address: any span of >= 1 element wraps.
          const uintptr_t top = std::numeric_limits<uintptr_t>::max();
          b->ptr = reinterpret_cast<unsigned char*>(top / b->elem * b->elem);
          mutation = b->name + " at the top of the address space";
        }
        break;
      }
      case 5: {  // ignored fields hold garbage: never dereferenced
        unsigned char* bogus = reinterpret_cast<unsigned char*>(uintptr_t{0xdead0000});
        if (backward) {
          buffers[out_idx].ptr = bogus + 1;
          buffers[out_idx].present = true;
          p.out_row_stride = fdp.ConsumeIntegral<int64_t>();
        } else {
          buffers[grad_out_idx].ptr = bogus;
          buffers[grad_out_idx].present = true;
          buffers[grad_w_idx].ptr = bogus + 2;
          buffers[grad_w_idx].present = true;
          p.grad_out_row_stride = fdp.ConsumeIntegral<int64_t>();
        }
        mutation = "garbage in ignored fields";
        break;
      }
      default: break;  // 0, 6, 7: no mutation (most inputs)
    }
  }

  void FillParams() {
    for (size_t i : block_idx) {
      block_ptrs.push_back(buffers[i].present ? buffers[i].ptr : nullptr);
    }
    for (size_t i : grad_block_idx) {
      grad_ptrs.push_back(buffers[i].present ? buffers[i].ptr : nullptr);
    }
    auto ptr = [&](size_t i) -> unsigned char* {
      return buffers[i].present ? buffers[i].ptr : nullptr;
    };
    // With num_blocks <= 0 the array is never read: NULL or a dummy.
    static const void* const kNoBlocks[1] = {nullptr};
    p.blocks = blocks_array_null ? nullptr : block_ptrs.empty() ? kNoBlocks : block_ptrs.data();
    p.partial = ptr(partial_idx);
    p.proj_weight = ptr(w_idx);
    p.gamma = ptr(gamma_idx);
    p.rms_cache = ptr(rms_idx);
    p.alpha_cache = ptr(alpha_idx);
    p.out = ptr(out_idx);
    p.grad_out = ptr(grad_out_idx);
    p.grad_blocks = grad_array_present && !grad_ptrs.empty() ? grad_ptrs.data() : nullptr;
    if (p.grad_blocks == nullptr) grad_array_present = false;
    p.grad_partial = ptr(grad_partial_idx);
    p.grad_proj_weight = ptr(grad_w_idx);
    p.grad_gamma = ptr(grad_gamma_idx);
  }

  void Snapshot() {
    for (Buffer& b : buffers) {
      if (b.present && !b.is_output && b.storage != nullptr) {
        b.snapshot.assign(b.storage.get(), b.storage.get() + b.storage_bytes);
      }
    }
    // Outputs that are pointed into another buffer are compared via that buffer.
  }

  std::string Describe() const {
    char s[512];
    std::snprintf(s, sizeof(s),
                  "%s dtype=%d device=%d tokens=%lld dim=%lld N=%lld partial=%d rmsnorm=%d "
                  "scale=%g eps=%g strides src=%lld out=%lld gout=%lld gsrc=%lld mutation=%s",
                  backward ? "backward" : "forward", p.dtype, p.device,
                  static_cast<long long>(p.num_tokens), static_cast<long long>(p.dim),
                  static_cast<long long>(p.num_blocks), p.partial != nullptr, p.rmsnorm, p.scale,
                  p.eps, static_cast<long long>(p.source_row_stride),
                  static_cast<long long>(p.out_row_stride),
                  static_cast<long long>(p.grad_out_row_stride),
                  static_cast<long long>(p.grad_source_row_stride), mutation.c_str());
    return s;
  }

  void Check(attnres_status status, bool valid, const std::string& why) {
    const std::string where = Describe() + (valid ? "" : " (invalid: " + why + ")");
    if (static_cast<int>(status) < ATTNRES_OK || static_cast<int>(status) > ATTNRES_ERROR_INTERNAL) {
      Bug("unknown status", where);
    }
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
      const char* fn = backward ? "attnres_backward" : "attnres_forward";
      if (msg.rfind(fn, 0) != 0) Bug("last error does not name the function", where);
      for (const Buffer& b : buffers) {
        if (!b.is_output || b.storage == nullptr) continue;
        for (size_t k = 0; k < b.storage_bytes; ++k) {
          if (b.storage[k] != kSentinel) Bug("an output was written by a failed call", where + " " + b.name);
        }
      }
      return;
    }
    // Success: outputs of the other direction and the padding between the
    // rows of strided outputs are untouched.
    for (const Buffer& b : buffers) {
      if (!b.is_output || b.storage == nullptr || b.ptr != b.storage.get()) continue;
      if (!Checked(b)) {
        for (size_t k = 0; k < b.storage_bytes; ++k) {
          if (b.storage[k] != kSentinel) Bug("an output of the other direction was written", where + " " + b.name);
        }
        continue;
      }
      for (int64_t r = 0; r + 1 < b.rows; ++r) {
        for (int64_t k = b.cols; k < b.stride; ++k) {
          if (b.storage[(r * b.stride + k) * b.elem] != kSentinel) {
            Bug("padding between output rows was written", where + " " + b.name);
          }
        }
      }
    }
  }
};

// Outcome counts, printed at exit when ATTNRES_FUZZ_STATS is set (scripts/fuzz.sh
// does): proof that the inputs reach the kernels and not only the validation.
struct Stats {
  long skipped = 0, ok_forward = 0, ok_backward = 0, rejected = 0;
  ~Stats() {
    if (std::getenv("ATTNRES_FUZZ_STATS") == nullptr) return;
    std::fprintf(stderr,
                 "attnres fuzz outcomes: %ld forward and %ld backward calls computed, %ld "
                 "rejected by validation, %ld skipped (valid but too big to back)\n",
                 ok_forward, ok_backward, rejected, skipped);
  }
};
Stats g_stats;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Harness h(data, size);
  h.Build();
  // ExpectedValid needs pointers; decide "invalid regardless of memory" on the
  // descriptor first, with every present buffer at a dummy aligned address.
  alignas(64) static unsigned char dummy[64];
  for (Buffer& b : h.buffers) b.ptr = b.present ? dummy : nullptr;
  h.FillParams();
  std::string why;
  // Overlap of the dummies is not a property of the descriptor: only rules that
  // do not depend on addresses count here.
  bool descriptor_valid = h.ExpectedValid(&why) || why == "outputs overlap";
  for (const Buffer& b : h.buffers) descriptor_valid &= !(b.NonEmpty() && h.Checked(b) && b.Overflows());
  h.block_ptrs.clear();
  h.grad_ptrs.clear();
  if (!h.Allocate(!descriptor_valid)) {
    ++g_stats.skipped;
    return 0;
  }
  h.Mutate();
  const uint8_t setup = h.fdp.ConsumeIntegral<uint8_t>();
  h.FillParams();
  h.Snapshot();
  const bool valid = h.ExpectedValid(&why);

  attnres_set_num_threads(1 + (setup & 1));
  attnres_set_cpu_isa((setup & 2) ? "baseline" : nullptr);
  const attnres_status status = h.backward ? attnres_backward(&h.p) : attnres_forward(&h.p);
  h.Check(status, valid, why);
  if (status != ATTNRES_OK) {
    ++g_stats.rejected;
  } else if (h.backward) {
    ++g_stats.ok_backward;
  } else {
    ++g_stats.ok_forward;
  }
  return 0;
}
