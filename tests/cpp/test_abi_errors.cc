// Every validation path of the C ABI: the status, a message that names the
// argument (with expected and actual values where there are any), and no write
// to any output (every output is pre-filled with a sentinel and compared
// bitwise; every input is compared with a snapshot).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <future>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"
#include "test_util.h"

namespace attnres_test {
namespace {

constexpr int64_t kTokens = 5;
constexpr int64_t kDim = 13;
constexpr int64_t kBlocks = 4;
constexpr int64_t kSources = kBlocks + 1;  // with the partial block

using Floats = std::vector<float>;

// A valid fp32 problem (4 blocks + partial, 5 tokens, dim 13, dense rows) with
// every buffer in its own allocation. Tests break one field of the params that
// ForwardParams()/BackwardParams() return.
class Problem {
 public:
  Problem() {
    std::mt19937_64 rng(11);
    std::normal_distribution<float> normal(0.f, 1.f);
    auto random = [&](size_t n, float s, float offset) {
      Floats v(n);
      for (float& x : v) x = offset + s * normal(rng);
      return v;
    };
    for (int64_t i = 0; i < kBlocks; ++i) blocks_.push_back(random(kTokens * kDim, 1, 0));
    partial_ = random(kTokens * kDim, 1, 0);
    w_ = random(kDim, 0.3f, 0);
    gamma_ = random(kDim, 0.1f, 1);
    grad_out_ = random(kTokens * kDim, 1, 0);
    rms_in_ = Floats(kTokens * kSources, 1.f);   // caches as backward inputs
    alpha_in_ = Floats(kTokens * kSources, 0.2f);
    inputs_snapshot_ = AllInputs();

    out_.resize(kTokens * kDim);
    rms_.resize(kTokens * kSources);
    alpha_.resize(kTokens * kSources);
    grad_blocks_.assign(kBlocks, Floats(kTokens * kDim));
    grad_partial_.resize(kTokens * kDim);
    grad_w_.resize(kDim);
    grad_gamma_.resize(kDim);
    ResetOutputs();

    for (auto& b : blocks_) block_ptrs_.push_back(b.data());
    for (auto& g : grad_blocks_) grad_ptrs_.push_back(g.data());
  }

  attnres_params Inputs() const {
    attnres_params p;
    attnres_params_init(&p);
    p.num_tokens = kTokens;
    p.dim = kDim;
    p.num_blocks = kBlocks;
    p.dtype = ATTNRES_DTYPE_FLOAT32;
    p.blocks = block_ptrs_.data();
    p.partial = partial_.data();
    p.source_row_stride = kDim;
    p.proj_weight = w_.data();
    p.gamma = gamma_.data();
    p.scale = 0.5;
    p.eps = 1e-6;
    p.rmsnorm = 1;
    return p;
  }

  attnres_params ForwardParams() {
    attnres_params p = Inputs();
    p.out = out_.data();
    p.out_row_stride = kDim;
    p.rms_cache = rms_.data();
    p.alpha_cache = alpha_.data();
    return p;
  }

  attnres_params BackwardParams() {
    attnres_params p = Inputs();
    p.grad_out = grad_out_.data();
    p.grad_out_row_stride = kDim;
    p.rms_cache = rms_in_.data();
    p.alpha_cache = alpha_in_.data();
    p.grad_blocks = grad_ptrs_.data();
    p.grad_partial = grad_partial_.data();
    p.grad_source_row_stride = kDim;
    p.grad_proj_weight = grad_w_.data();
    p.grad_gamma = grad_gamma_.data();
    return p;
  }

  void ResetOutputs() {
    for (Floats* v : AllOutputs()) std::memset(v->data(), kOutputSentinel, v->size() * 4);
  }

  ::testing::AssertionResult Untouched() {
    const std::vector<Floats*> outs = AllOutputs();
    const char* names[] = {"out", "rms_cache", "alpha_cache", "grad_partial",
                           "grad_proj_weight", "grad_gamma", "grad_blocks[0]",
                           "grad_blocks[1]", "grad_blocks[2]", "grad_blocks[3]"};
    for (size_t k = 0; k < outs.size(); ++k) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(outs[k]->data());
      for (size_t b = 0; b < outs[k]->size() * 4; ++b) {
        if (bytes[b] != kOutputSentinel) {
          return ::testing::AssertionFailure()
                 << "output " << names[k] << " was written (byte " << b << ")";
        }
      }
    }
    const std::vector<Floats> now = AllInputs();
    for (size_t k = 0; k < now.size(); ++k) {
      if (std::memcmp(now[k].data(), inputs_snapshot_[k].data(), now[k].size() * 4) != 0) {
        return ::testing::AssertionFailure() << "input #" << k << " was modified";
      }
    }
    return ::testing::AssertionSuccess();
  }

  Floats& block(int i) { return blocks_[i]; }
  Floats& partial() { return partial_; }
  Floats& proj_weight() { return w_; }
  Floats& grad_out() { return grad_out_; }
  Floats& out() { return out_; }
  Floats& rms() { return rms_; }
  Floats& alpha() { return alpha_; }
  Floats& grad_block(int i) { return grad_blocks_[i]; }
  Floats& grad_partial() { return grad_partial_; }
  Floats& grad_w() { return grad_w_; }
  std::vector<const void*>& block_ptrs() { return block_ptrs_; }
  std::vector<void*>& grad_ptrs() { return grad_ptrs_; }

  // The oracle's view of the same problem (for the success-after-failure checks).
  attnres::ref::Problem Reference() const {
    attnres::ref::Problem r;
    r.tokens = kTokens;
    r.dim = kDim;
    r.num_blocks = kBlocks;
    r.has_partial = true;
    r.scale = 0.5;
    r.eps = 1e-6;
    for (const Floats& b : blocks_) r.sources.emplace_back(b.begin(), b.end());
    r.sources.emplace_back(partial_.begin(), partial_.end());
    r.w.assign(w_.begin(), w_.end());
    r.gamma.assign(gamma_.begin(), gamma_.end());
    return r;
  }

 private:
  std::vector<Floats*> AllOutputs() {
    std::vector<Floats*> v{&out_, &rms_, &alpha_, &grad_partial_, &grad_w_, &grad_gamma_};
    for (Floats& g : grad_blocks_) v.push_back(&g);
    return v;
  }
  std::vector<Floats> AllInputs() const {
    std::vector<Floats> v(blocks_);
    for (const Floats* f : {&partial_, &w_, &gamma_, &grad_out_, &rms_in_, &alpha_in_}) {
      v.push_back(*f);
    }
    return v;
  }

  std::vector<Floats> blocks_;
  Floats partial_, w_, gamma_, grad_out_, rms_in_, alpha_in_;
  std::vector<Floats> inputs_snapshot_;
  Floats out_, rms_, alpha_;
  std::vector<Floats> grad_blocks_;
  Floats grad_partial_, grad_w_, grad_gamma_;
  std::vector<const void*> block_ptrs_;
  std::vector<void*> grad_ptrs_;
};

std::vector<double> ToDouble(const Floats& v) { return {v.begin(), v.end()}; }

// Stores an out-of-range value into an enum field the way a C caller can
// (static_cast to the enum would be undefined behaviour in C++).
template <typename Enum>
void SetRawEnum(Enum* field, int32_t value) {
  static_assert(sizeof(Enum) == sizeof(int32_t), "C enums are int-sized");
  std::memcpy(field, &value, sizeof(value));
}

class AbiErrors : public ::testing::Test {
 protected:
  // The call failed with `want`, the message names every needle, and nothing
  // was written anywhere.
  void ExpectFailure(attnres_status got, attnres_status want,
                     const std::vector<std::string>& needles) {
    const std::string message = attnres_last_error();
    // Visible in --gtest_output=xml: the messages users will see.
    RecordProperty("message_" + std::to_string(++num_messages_), message);
    EXPECT_EQ(got, want) << "got " << attnres_status_string(got) << ", message: '"
                         << message << "'";
    EXPECT_FALSE(message.empty());
    std::string lower = message;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    for (const std::string& needle : needles) {
      std::string n = needle;
      for (char& ch : n) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      EXPECT_NE(lower.find(n), std::string::npos)
          << "message '" << message << "' does not mention '" << needle << "'";
    }
    EXPECT_TRUE(pb_.Untouched());
  }
  void ForwardFails(const attnres_params& p, attnres_status want,
                    const std::vector<std::string>& needles) {
    SCOPED_TRACE("attnres_forward");
    ExpectFailure(attnres_forward(&p), want, needles);
  }
  void BackwardFails(const attnres_params& p, attnres_status want,
                     const std::vector<std::string>& needles) {
    SCOPED_TRACE("attnres_backward");
    ExpectFailure(attnres_backward(&p), want, needles);
  }

  // `edit` applied to a valid forward's and a valid backward's params: both fail alike.
  void BothFail(const std::function<void(attnres_params&)>& edit, attnres_status want,
                const std::vector<std::string>& needles) {
    attnres_params p = pb_.ForwardParams();
    edit(p);
    ForwardFails(p, want, needles);
    attnres_params b = pb_.BackwardParams();
    edit(b);
    BackwardFails(b, want, needles);
  }

  Problem pb_;
  int num_messages_ = 0;
};

constexpr auto kNull = ATTNRES_ERROR_NULL_POINTER;
constexpr auto kInvalid = ATTNRES_ERROR_INVALID_ARGUMENT;
constexpr auto kOverlap = ATTNRES_ERROR_OVERLAP;

TEST_F(AbiErrors, ValidCallsSucceed) {
  attnres_params f = pb_.ForwardParams();
  ASSERT_EQ(attnres_forward(&f), ATTNRES_OK) << attnres_last_error();
  attnres_params b = pb_.BackwardParams();
  b.rms_cache = b.alpha_cache = nullptr;
  ASSERT_EQ(attnres_backward(&b), ATTNRES_OK) << attnres_last_error();
}

TEST_F(AbiErrors, NullParams) {
  ExpectFailure(attnres_forward(nullptr), kNull, {"params"});
  ExpectFailure(attnres_backward(nullptr), kNull, {"params"});
}

TEST_F(AbiErrors, NullBlocksArray) {
  attnres_params p = pb_.ForwardParams();
  p.blocks = nullptr;
  ForwardFails(p, kNull, {"blocks"});
  attnres_params b = pb_.BackwardParams();
  b.blocks = nullptr;
  BackwardFails(b, kNull, {"blocks"});
}

TEST_F(AbiErrors, NullBlockPointer) {
  pb_.block_ptrs()[3] = nullptr;
  ForwardFails(pb_.ForwardParams(), kNull, {"blocks[3]"});
  BackwardFails(pb_.BackwardParams(), kNull, {"blocks[3]"});
}

TEST_F(AbiErrors, NullProjWeight) {
  attnres_params p = pb_.ForwardParams();
  p.proj_weight = nullptr;
  ForwardFails(p, kNull, {"proj_weight"});
  attnres_params b = pb_.BackwardParams();
  b.proj_weight = nullptr;
  BackwardFails(b, kNull, {"proj_weight"});
}

TEST_F(AbiErrors, NullOut) {
  attnres_params p = pb_.ForwardParams();
  p.out = nullptr;
  ForwardFails(p, kNull, {"out"});
}

TEST_F(AbiErrors, NullGradOut) {
  attnres_params b = pb_.BackwardParams();
  b.grad_out = nullptr;
  BackwardFails(b, kNull, {"grad_out"});
}

TEST_F(AbiErrors, DimZeroOrNegative) {
  BothFail([](attnres_params& p) { p.dim = 0; }, kInvalid, {"dim", "0"});
  attnres_params p = pb_.ForwardParams();
  p.dim = -2;
  ForwardFails(p, kInvalid, {"dim", "-2"});
}

TEST_F(AbiErrors, NegativeNumTokens) {
  BothFail([](attnres_params& p) { p.num_tokens = -3; }, kInvalid, {"num_tokens", "-3"});
}

TEST_F(AbiErrors, NoSources) {
  // The caches' and grad_partial's size would be 0 anyway.
  BothFail([](attnres_params& p) {
    p.num_blocks = 0;
    p.partial = p.grad_partial = nullptr;
    p.rms_cache = p.alpha_cache = nullptr;
  }, kInvalid, {"num_blocks"});
}

TEST_F(AbiErrors, NegativeNumBlocks) {
  attnres_params p = pb_.ForwardParams();
  p.num_blocks = -1;
  ForwardFails(p, kInvalid, {"num_blocks", "-1"});
}

TEST_F(AbiErrors, UnknownDType) {
  attnres_params p = pb_.ForwardParams();
  SetRawEnum(&p.dtype, 7);
  ForwardFails(p, ATTNRES_ERROR_UNSUPPORTED_DTYPE, {"dtype", "7"});
  attnres_params b = pb_.BackwardParams();
  SetRawEnum(&b.dtype, -1);
  BackwardFails(b, ATTNRES_ERROR_UNSUPPORTED_DTYPE, {"dtype", "-1"});
}

// Every stride field, one below dim: "name", the actual value 12 and dim 13.
TEST_F(AbiErrors, RowStridesBelowDim) {
  BothFail([](attnres_params& p) { p.source_row_stride = kDim - 1; }, kInvalid,
           {"source_row_stride", "12", "13"});
  attnres_params p = pb_.ForwardParams();
  p.out_row_stride = kDim - 1;
  ForwardFails(p, kInvalid, {"out_row_stride", "12", "13"});
  attnres_params b = pb_.BackwardParams();
  b.grad_out_row_stride = kDim - 1;
  BackwardFails(b, kInvalid, {"grad_out_row_stride", "12", "13"});
  b = pb_.BackwardParams();
  b.grad_source_row_stride = kDim - 1;
  BackwardFails(b, kInvalid, {"grad_source_row_stride", "12", "13"});
  // Also when only the partial block's gradient is requested.
  b.grad_blocks = nullptr;
  BackwardFails(b, kInvalid, {"grad_source_row_stride", "12", "13"});
}

TEST_F(AbiErrors, NegativeOrNonFiniteEps) {
  BothFail([](attnres_params& p) { p.eps = -0.5; }, kInvalid, {"eps", "-0.5"});
  BothFail([](attnres_params& p) { p.eps = std::numeric_limits<double>::quiet_NaN(); }, kInvalid,
           {"eps", "nan"});
  attnres_params p = pb_.ForwardParams();
  p.eps = std::numeric_limits<double>::infinity();
  ForwardFails(p, kInvalid, {"eps", "inf"});
}

TEST_F(AbiErrors, NonFiniteScale) {
  attnres_params p = pb_.ForwardParams();
  p.scale = std::numeric_limits<double>::quiet_NaN();
  ForwardFails(p, kInvalid, {"scale", "nan"});
  p.scale = -std::numeric_limits<double>::infinity();
  ForwardFails(p, kInvalid, {"scale", "inf"});
  BothFail([](attnres_params& p) { p.scale = std::numeric_limits<double>::infinity(); }, kInvalid,
           {"scale", "inf"});
}

TEST_F(AbiErrors, RmsCacheWithRmsnormOff) {
  attnres_params p = pb_.ForwardParams();
  p.rmsnorm = 0;
  ForwardFails(p, kInvalid, {"rms_cache", "rmsnorm"});
  attnres_params b = pb_.BackwardParams();
  b.rmsnorm = 0;
  b.grad_gamma = nullptr;
  BackwardFails(b, kInvalid, {"rms_cache", "rmsnorm"});
}

TEST_F(AbiErrors, GradGammaWithRmsnormOff) {
  attnres_params b = pb_.BackwardParams();
  b.rmsnorm = 0;
  b.rms_cache = nullptr;
  BackwardFails(b, kInvalid, {"grad_gamma", "rmsnorm"});
}

TEST_F(AbiErrors, OutOverlapsABlock) {
  attnres_params p = pb_.ForwardParams();
  p.out = pb_.block(2).data() + kDim + 3;  // from the middle of row 1 on
  ForwardFails(p, kOverlap, {"out", "blocks[2]"});
}

TEST_F(AbiErrors, OutOverlapsThePartialBlock) {
  attnres_params p = pb_.ForwardParams();
  p.out = pb_.partial().data() + 2 * kDim;
  ForwardFails(p, kOverlap, {"out", "partial"});
}

TEST_F(AbiErrors, OutOverlapsABlockByOneElement) {
  // One allocation holding out and then blocks[1], sharing exactly one element:
  // out's last element is the block's first.
  const int64_t n = kTokens * kDim;
  std::vector<float> scratch(2 * n - 1);
  std::memcpy(scratch.data() + n - 1, pb_.block(1).data(), n * 4);
  std::memset(scratch.data(), kOutputSentinel, (n - 1) * 4);
  pb_.block_ptrs()[1] = scratch.data() + n - 1;
  attnres_params p = pb_.ForwardParams();
  p.out = scratch.data();
  const std::vector<float> before = scratch;
  ForwardFails(p, kOverlap, {"out", "blocks[1]"});
  EXPECT_EQ(std::memcmp(before.data(), scratch.data(), scratch.size() * 4), 0)
      << "out or blocks[1] was written";
}

TEST_F(AbiErrors, CacheOverlapsOut) {
  attnres_params p = pb_.ForwardParams();
  p.alpha_cache = pb_.out().data() + 3;
  ForwardFails(p, kOverlap, {"alpha_cache", "out"});
}

TEST_F(AbiErrors, CacheOverlapsABlock) {
  attnres_params p = pb_.ForwardParams();
  p.rms_cache = pb_.block(0).data();
  ForwardFails(p, kOverlap, {"rms_cache", "blocks[0]"});
}

TEST_F(AbiErrors, GradBufferOverlapsABlock) {
  pb_.grad_ptrs()[1] = pb_.block(0).data() + 5;
  BackwardFails(pb_.BackwardParams(), kOverlap, {"grad_blocks[1]", "blocks[0]"});
}

TEST_F(AbiErrors, GradBufferOverlapsGradOut) {
  pb_.grad_ptrs()[2] = pb_.grad_out().data();
  BackwardFails(pb_.BackwardParams(), kOverlap, {"grad_blocks[2]", "grad_out"});
}

TEST_F(AbiErrors, GradProjWeightOverlapsProjWeight) {
  attnres_params b = pb_.BackwardParams();
  b.grad_proj_weight = pb_.proj_weight().data();
  BackwardFails(b, kOverlap, {"grad_proj_weight", "proj_weight"});
}

TEST_F(AbiErrors, TwoGradBuffersOverlap) {
  attnres_params b = pb_.BackwardParams();
  b.grad_partial = pb_.grad_block(0).data() + 2 * kDim;
  BackwardFails(b, kOverlap, {"grad_partial", "grad_blocks[0]"});
}

TEST_F(AbiErrors, TwoGradBlocksAlias) {
  pb_.grad_ptrs()[3] = pb_.grad_ptrs()[1];
  BackwardFails(pb_.BackwardParams(), kOverlap, {"grad_blocks[3]", "grad_blocks[1]"});
}

TEST_F(AbiErrors, GradProjWeightOverlapsAGradBlock) {
  attnres_params b = pb_.BackwardParams();
  b.grad_proj_weight = pb_.grad_block(3).data() + kDim;
  BackwardFails(b, kOverlap, {"grad_proj_weight", "grad_blocks[3]"});
}

TEST_F(AbiErrors, CudaDeviceWhenUnavailable) {
  if (attnres_cuda_available()) GTEST_SKIP() << "CUDA is available here";
  attnres_params p = pb_.ForwardParams();
  p.device = ATTNRES_DEVICE_CUDA;
  ForwardFails(p, ATTNRES_ERROR_UNSUPPORTED_DEVICE, {"device"});
  attnres_params b = pb_.BackwardParams();
  b.device = ATTNRES_DEVICE_CUDA;
  BackwardFails(b, ATTNRES_ERROR_UNSUPPORTED_DEVICE, {"device"});
}

TEST_F(AbiErrors, UnknownDevice) {
  attnres_params p = pb_.ForwardParams();
  SetRawEnum(&p.device, 5);
  const attnres_status s = attnres_forward(&p);
  EXPECT_TRUE(s == ATTNRES_ERROR_INVALID_ARGUMENT || s == ATTNRES_ERROR_UNSUPPORTED_DEVICE)
      << attnres_status_string(s);
  ExpectFailure(s, s, {"device", "5"});
}

TEST_F(AbiErrors, WrongAbiVersion) {
  attnres_params p = pb_.ForwardParams();
  p.abi_version = 999;
  ForwardFails(p, kInvalid, {"abi_version", "999", std::to_string(ATTNRES_ABI_VERSION)});
  p.abi_version = 0;  // a struct that never went through attnres_params_init
  ForwardFails(p, kInvalid, {"abi_version", "0"});
  attnres_params b = pb_.BackwardParams();
  b.abi_version = ATTNRES_ABI_VERSION + 1;
  BackwardFails(b, kInvalid, {"abi_version"});
}

// Not errors: the optional pieces may be absent.
TEST_F(AbiErrors, OptionalPointersMayBeNull) {
  // N = 0 with a partial block: the blocks array is not needed.
  attnres_params p = pb_.ForwardParams();
  p.num_blocks = 0;
  p.blocks = nullptr;
  p.rms_cache = p.alpha_cache = nullptr;
  EXPECT_EQ(attnres_forward(&p), ATTNRES_OK) << attnres_last_error();
  // Backward with no gradient requested at all is a valid (useless) call.
  pb_.ResetOutputs();
  attnres_params b = pb_.BackwardParams();
  b.rms_cache = b.alpha_cache = nullptr;
  b.grad_blocks = nullptr;
  b.grad_partial = b.grad_proj_weight = b.grad_gamma = nullptr;
  EXPECT_EQ(attnres_backward(&b), ATTNRES_OK) << attnres_last_error();
  EXPECT_TRUE(pb_.Untouched());
  // Zero tokens: nothing to read, every stride check still applies.
  attnres_params z = pb_.ForwardParams();
  z.num_tokens = 0;
  EXPECT_EQ(attnres_forward(&z), ATTNRES_OK) << attnres_last_error();
}

TEST_F(AbiErrors, SuccessAfterFailure) {
  const attnres::ref::Problem ref = pb_.Reference();
  const auto ref_f = attnres::ref::Forward(ref);
  std::vector<double> g(pb_.grad_out().begin(), pb_.grad_out().end());
  const auto ref_b = attnres::ref::Backward(ref, g);

  attnres_params bad = pb_.ForwardParams();
  bad.dim = 0;
  ForwardFails(bad, kInvalid, {"dim"});
  attnres_params p = pb_.ForwardParams();
  ASSERT_EQ(attnres_forward(&p), ATTNRES_OK) << attnres_last_error();
  EXPECT_TRUE(Close("out", ToDouble(pb_.out()), ref_f.out, 1e-5));
  EXPECT_TRUE(Close("alpha", ToDouble(pb_.alpha()), ref_f.alpha, 1e-5));

  attnres_params bad_b = pb_.BackwardParams();
  bad_b.grad_out = nullptr;
  bad_b.rms_cache = pb_.rms().data();
  bad_b.alpha_cache = pb_.alpha().data();
  {
    const std::vector<float> out_before = pb_.out();
    SCOPED_TRACE("backward with grad_out NULL");
    const attnres_status s = attnres_backward(&bad_b);
    EXPECT_EQ(s, kNull);
    EXPECT_NE(std::string(attnres_last_error()).find("grad_out"), std::string::npos);
    for (int i = 0; i < kBlocks; ++i) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(pb_.grad_block(i).data());
      EXPECT_EQ(bytes[0], kOutputSentinel);
    }
  }
  attnres_params b = pb_.BackwardParams();
  b.rms_cache = pb_.rms().data();  // as written by the forward above
  b.alpha_cache = pb_.alpha().data();
  ASSERT_EQ(attnres_backward(&b), ATTNRES_OK) << attnres_last_error();
  for (int i = 0; i < kBlocks; ++i) {
    EXPECT_TRUE(Close("grad_blocks[" + std::to_string(i) + "]", ToDouble(pb_.grad_block(i)),
                      ref_b.grad_sources[i], 1e-4));
  }
  EXPECT_TRUE(Close("grad_partial", ToDouble(pb_.grad_partial()), ref_b.grad_sources[kBlocks],
                    1e-4));
  EXPECT_TRUE(Close("grad_w", ToDouble(pb_.grad_w()), ref_b.grad_w, 1e-4));
}

// attnres_last_error() is per thread: a failure on one thread leaves another
// thread's message alone, and a new thread starts with "".
TEST(AbiErrorsThreads, LastErrorIsPerThread) {
  std::promise<void> a_failed, b_failed;
  std::shared_future<void> a_done = a_failed.get_future().share();
  std::shared_future<void> b_done = b_failed.get_future().share();
  std::string a_first, a_after, b_msg, fresh;

  std::thread a([&] {
    Problem pb;
    attnres_params p = pb.ForwardParams();
    p.dim = 0;
    EXPECT_EQ(attnres_forward(&p), ATTNRES_ERROR_INVALID_ARGUMENT);
    a_first = attnres_last_error();
    a_failed.set_value();
    b_done.wait();  // thread B fails with another message meanwhile
    a_after = attnres_last_error();
  });
  std::thread b([&] {
    Problem pb;
    a_done.wait();
    fresh = attnres_last_error();
    attnres_params p = pb.ForwardParams();
    p.eps = -1.0;
    EXPECT_EQ(attnres_forward(&p), ATTNRES_ERROR_INVALID_ARGUMENT);
    b_msg = attnres_last_error();
    b_failed.set_value();
  });
  a.join();
  b.join();
  EXPECT_EQ(fresh, "") << "a thread that never failed has no last error";
  EXPECT_NE(a_first.find("dim"), std::string::npos) << a_first;
  EXPECT_EQ(a_after, a_first) << "thread B's failure changed thread A's message";
  EXPECT_NE(b_msg.find("eps"), std::string::npos) << b_msg;
  EXPECT_EQ(b_msg.find("dim"), std::string::npos) << b_msg;
}

}  // namespace
}  // namespace attnres_test
