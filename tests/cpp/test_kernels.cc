// Every backend (each CPU kernel variant; CUDA when a device is present)
// against the float64 oracle (SPEC §3), on a sampled case list: every dtype
// meets every L in {1, 2, 31, 32, 33, 127, 128, 300} and every D in
// {1, 7, 123, 512, 1536, 4096}; flags, scale, eps, row strides, caches and NULL
// gradient pointers are drawn from a fixed-seed generator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "ref/reference.h"
#include "test_util.h"

namespace attnres_test {
namespace {

enum class CacheMode { kNone, kBoth, kAlphaOnly, kRmsOnly };

const char* CacheModeName(CacheMode m) {
  switch (m) {
    case CacheMode::kNone: return "no caches";
    case CacheMode::kBoth: return "both caches";
    case CacheMode::kAlphaOnly: return "alpha cache only";
    case CacheMode::kRmsOnly: return "rms cache only";
  }
  return "?";
}

struct KernelCase {
  std::string name;
  Case c;
  CacheMode caches = CacheMode::kNone;
  BackwardOptions backward;
};

void PrintTo(const KernelCase& k, std::ostream* os) { *os << k.name << ": " << k.c.Describe(); }

// Elements T*L*D per case: keeps the float64 oracle, which dominates the run
// time, near 10 ms per case.
constexpr int64_t kElementBudget = 1500000;

KernelCase Draw(std::mt19937_64& rng, int64_t L, int64_t D, attnres_dtype dtype,
                int64_t tokens) {
  auto pick = [&](auto const& options) { return options[rng() % options.size()]; };
  KernelCase k;
  Case& c = k.c;
  c.dtype = dtype;
  c.dim = D;
  c.has_partial = rng() % 2 == 0;
  c.num_blocks = L - (c.has_partial ? 1 : 0);
  c.tokens = tokens;
  c.rmsnorm = rng() % 4 != 0;
  c.has_gamma = rng() % 4 != 0;
  c.scale = pick(std::vector<double>{1.0, 1.0, 0.5, 2.0, -1.5, 0.125});
  c.eps = pick(std::vector<double>{1e-6, 1e-6, 1e-5, 1e-3, 0.5, 0.0});
  const std::vector<int64_t> pads{0, 0, 0, 1, 3, 16, 64};
  c.source_pad = pick(pads);
  c.out_pad = pick(pads);
  c.grad_out_pad = pick(pads);
  c.grad_source_pad = pick(pads);
  c.seed = rng();
  std::vector<CacheMode> modes{CacheMode::kNone, CacheMode::kBoth, CacheMode::kAlphaOnly};
  if (c.rmsnorm) modes.push_back(CacheMode::kRmsOnly);
  k.caches = pick(modes);
  BackwardOptions& o = k.backward;
  o.use_alpha_cache = k.caches == CacheMode::kBoth || k.caches == CacheMode::kAlphaOnly;
  o.use_rms_cache = k.caches == CacheMode::kBoth || k.caches == CacheMode::kRmsOnly;
  o.grad_blocks_null = c.num_blocks > 0 && rng() % 10 == 0;
  o.skip_source.resize(L);
  for (int64_t i = 0; i < L; ++i) o.skip_source[i] = rng() % 5 == 0;
  o.skip_w = rng() % 5 == 0;
  o.skip_gamma = rng() % 3 == 0;
  return k;
}

int64_t DrawTokens(std::mt19937_64& rng, int64_t L, int64_t D) {
  const int64_t max_tokens = std::clamp<int64_t>(kElementBudget / (L * D), 1, 700);
  if (rng() % 6 == 0) return 1;
  int64_t t = max_tokens / 2 + static_cast<int64_t>(rng() % (max_tokens / 2 + 1));
  if (rng() % 2 == 0) t |= 1;  // odd counts exercise the SIMD/chunk tails
  return std::max<int64_t>(t, 1);
}

std::vector<KernelCase> BuildCases() {
  const int64_t kLs[] = {1, 2, 31, 32, 33, 127, 128, 300};
  const int64_t kDs[] = {1, 7, 123, 512, 1536, 4096};
  const attnres_dtype kDTypes[] = {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_BFLOAT16,
                                   ATTNRES_DTYPE_FLOAT16, ATTNRES_DTYPE_FLOAT64};
  std::mt19937_64 rng(20260315);
  std::vector<KernelCase> cases;
  // Every (L, D) once; the dtype cycles so that, for each dtype, every L and
  // every D appear.
  for (int iL = 0; iL < 8; ++iL) {
    for (int iD = 0; iD < 6; ++iD) {
      const int64_t L = kLs[iL], D = kDs[iD];
      cases.push_back(Draw(rng, L, D, kDTypes[(iL + iD) % 4], DrawTokens(rng, L, D)));
    }
  }
  // Many tokens on small rows: crosses the token-chunk boundaries of the
  // dw/dgamma reduction and the threading split.
  for (attnres_dtype dtype : kDTypes) {
    for (int64_t tokens : {257, 1031, 2049}) {
      const int64_t L = 1 + static_cast<int64_t>(rng() % 9);
      const int64_t D = 1 + static_cast<int64_t>(rng() % 40);
      cases.push_back(Draw(rng, L, D, dtype, tokens));
    }
  }
  // Zero tokens: a valid no-op, except that dw/dgamma are overwritten with 0.
  for (attnres_dtype dtype : kDTypes) {
    KernelCase k = Draw(rng, 3, 16, dtype, 0);
    k.backward.skip_w = false;
    k.backward.skip_gamma = false;
    cases.push_back(k);
  }
  // Every gradient requested, both caches, no padding: the common training call.
  for (attnres_dtype dtype : kDTypes) {
    for (int64_t D : {7, 123, 512}) {
      KernelCase k = Draw(rng, 9, D, dtype, 33);
      k.c.rmsnorm = true;
      k.c.source_pad = k.c.out_pad = k.c.grad_out_pad = k.c.grad_source_pad = 0;
      k.caches = CacheMode::kBoth;
      k.backward = BackwardOptions();
      k.backward.use_alpha_cache = k.backward.use_rms_cache = true;
      cases.push_back(k);
    }
  }
  // Rows longer than pass 1 reads at once (kernel_table.h: PassOneSpan) in both
  // ops and every dtype, the last span short: the sums carried between spans.
  for (attnres_dtype dtype : kDTypes) {
    KernelCase k = Draw(rng, 5, 4100, dtype, 7);
    k.c.rmsnorm = true;
    cases.push_back(k);
  }
  // The same with two tokens per backward tile (fp32, L = 2; the last tile has
  // one) and the rms cache given, so the backward's pass 1 skips sum(v^2).
  {
    KernelCase k = Draw(rng, 2, 4100, ATTNRES_DTYPE_FLOAT32, 9);
    k.c.rmsnorm = true;
    k.caches = CacheMode::kRmsOnly;
    k.backward.use_rms_cache = true;
    k.backward.use_alpha_cache = false;
    cases.push_back(k);
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i].c;
    cases[i].name = "c" + std::to_string(i) + "_" + DTypeName(c.dtype) + "_L" +
                    std::to_string(c.num_sources()) + "_D" + std::to_string(c.dim) + "_T" +
                    std::to_string(c.tokens);
  }
  return cases;
}

class KernelTest : public ::testing::TestWithParam<KernelCase> {};

TEST_P(KernelTest, MatchesReference) {
  const KernelCase& k = GetParam();
  const Case& c = k.c;
  SCOPED_TRACE(c.Describe());
  SCOPED_TRACE(CacheModeName(k.caches));
  const int64_t L = c.num_sources();
  const attnres::ref::Problem problem = MakeProblem(c);
  const std::vector<double> grad_out = MakeGradOut(c);
  const attnres::ref::ForwardResult ref_f = attnres::ref::Forward(problem);
  const attnres::ref::BackwardResult ref_b = attnres::ref::Backward(problem, grad_out);
  const Tolerance tol = ToleranceFor(c.dtype);

  ForEachBackend([&](const Backend& backend) {
    AbiProblem abi(c, problem, backend.device);

    const ForwardOutput plain = abi.Forward(false, false);
    ASSERT_EQ(plain.status, ATTNRES_OK) << plain.error;
    EXPECT_EQ(plain.layout_error, "");
    EXPECT_TRUE(Close("out", plain.out, ref_f.out, tol.out));

    const ForwardOutput cached = abi.Forward(c.rmsnorm, true);
    ASSERT_EQ(cached.status, ATTNRES_OK) << cached.error;
    EXPECT_EQ(cached.layout_error, "");
    EXPECT_TRUE(Close("out (with caches)", cached.out, ref_f.out, tol.out));
    EXPECT_TRUE(Close("alpha_cache", cached.alpha, ref_f.alpha, tol.cache));
    if (c.rmsnorm) {
      EXPECT_TRUE(Close("rms_cache", cached.rms, ref_f.rms, tol.cache));
    }

    const BackwardOutput b = abi.Backward(grad_out, k.backward);
    ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
    EXPECT_EQ(b.layout_error, "");
    ASSERT_EQ(static_cast<int64_t>(b.grad_sources.size()), L);
    for (int64_t i = 0; i < L; ++i) {
      const bool skipped =
          (i < c.num_blocks && k.backward.grad_blocks_null) ||
          (i < static_cast<int64_t>(k.backward.skip_source.size()) && k.backward.skip_source[i]);
      const std::string what = "grad_source[" + std::to_string(i) + "]";
      if (skipped) {
        EXPECT_TRUE(b.grad_sources[i].empty()) << what;
      } else {
        EXPECT_TRUE(Close(what, b.grad_sources[i], ref_b.grad_sources[i], tol.grad));
      }
    }
    if (!k.backward.skip_w) {
      EXPECT_TRUE(Close("grad_w", b.grad_w, ref_b.grad_w, tol.grad));
    }
    if (c.rmsnorm && !k.backward.skip_gamma) {
      EXPECT_TRUE(Close("grad_gamma", b.grad_gamma, ref_b.grad_gamma, tol.grad));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Sampled, KernelTest, ::testing::ValuesIn(BuildCases()),
                         [](const ::testing::TestParamInfo<KernelCase>& info) {
                           return info.param.name;
                         });

TEST(KernelCases, CoverEveryDTypeWithEveryLAndD) {
  std::set<std::pair<int, int64_t>> dtype_L, dtype_D;
  for (const KernelCase& k : BuildCases()) {
    dtype_L.insert({k.c.dtype, k.c.num_sources()});
    dtype_D.insert({k.c.dtype, k.c.dim});
  }
  for (int dtype = 0; dtype < 4; ++dtype) {
    for (int64_t L : {1, 2, 31, 32, 33, 127, 128, 300}) {
      EXPECT_TRUE(dtype_L.count({dtype, L})) << "dtype " << dtype << " L " << L;
    }
    for (int64_t D : {1, 7, 123, 512, 1536, 4096}) {
      EXPECT_TRUE(dtype_D.count({dtype, D})) << "dtype " << dtype << " D " << D;
    }
  }
}

// Rows of 20,000 elements, wider than the CUDA fused kernels' registers (the
// generic kernels take them).
TEST(Kernels, WideRowsMatchReference) {
  for (attnres_dtype dtype : {ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT32}) {
    for (int64_t D : {20000, 20001}) {
      Case c;
      c.dtype = dtype;
      c.dim = D;
      c.num_blocks = 3;
      c.tokens = 5;
      SCOPED_TRACE(c.Describe());
      const attnres::ref::Problem problem = MakeProblem(c);
      const std::vector<double> grad_out = MakeGradOut(c);
      const attnres::ref::ForwardResult ref_f = attnres::ref::Forward(problem);
      const attnres::ref::BackwardResult ref_b = attnres::ref::Backward(problem, grad_out);
      ForEachBackend([&](const Backend& backend) {
        AbiProblem abi(c, problem, backend.device);
        ExpectForwardClose(c, abi.Forward(c.rmsnorm, true), ref_f, true);
        ExpectBackwardClose(c, abi.Backward(grad_out, BackwardOptions()), ref_b,
                            BackwardOptions());
      });
    }
  }
}

// A forced ISA changes nothing but speed: the same case on every variant. CPU
// ISAs only: CUDA is held to SPEC §3's tolerance against the oracle
// (KernelTest), which comparing it with a CPU ISA could only loosen.
TEST(Kernels, AllIsasAgreeWithEachOther) {
  Case c;
  c.tokens = 65;
  c.dim = 777;
  c.num_blocks = 8;
  c.dtype = ATTNRES_DTYPE_FLOAT32;
  c.seed = 7;
  const auto problem = MakeProblem(c);
  const auto grad_out = MakeGradOut(c);
  std::vector<std::vector<double>> outs, dws;
  ForEachIsa([&](const std::string&) {
    AbiProblem abi(c, problem);
    const ForwardOutput f = abi.Forward(false, false);
    ASSERT_EQ(f.status, ATTNRES_OK) << f.error;
    outs.push_back(f.out);
    const BackwardOutput b = abi.Backward(grad_out, BackwardOptions());
    ASSERT_EQ(b.status, ATTNRES_OK) << b.error;
    dws.push_back(b.grad_w);
  });
  for (size_t i = 1; i < outs.size(); ++i) {
    EXPECT_TRUE(Close("out vs first isa", outs[i], outs[0], ToleranceFor(c.dtype).out));
    EXPECT_TRUE(Close("grad_w vs first isa", dws[i], dws[0], ToleranceFor(c.dtype).grad));
  }
}

TEST(CpuIsa, SelectionAndRestore) {
  const char* automatic = attnres_cpu_isa();
  ASSERT_NE(automatic, nullptr);
  const std::string auto_name = automatic;
  const std::vector<std::string> isas = AvailableIsas();
  ASSERT_FALSE(isas.empty()) << attnres_cpu_isas();
  EXPECT_NE(std::find(isas.begin(), isas.end(), auto_name), isas.end())
      << auto_name << " is not in attnres_cpu_isas(): " << attnres_cpu_isas();
  EXPECT_EQ(isas.back(), "baseline") << "every CPU runs the baseline, listed last";
  for (const std::string& isa : isas) {  // each listed name is accepted and then in use
    EXPECT_EQ(attnres_set_cpu_isa(isa.c_str()), ATTNRES_OK) << isa << ": " << attnres_last_error();
    EXPECT_EQ(isa, attnres_cpu_isa());
  }
  EXPECT_EQ(attnres_set_cpu_isa("no-such-isa"), ATTNRES_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(attnres_last_error()).find("no-such-isa"), std::string::npos)
      << attnres_last_error();
  EXPECT_EQ(attnres_set_cpu_isa(nullptr), ATTNRES_OK);
  EXPECT_EQ(auto_name, attnres_cpu_isa());
  if (std::getenv("ATTNRES_CPU_ISA") == nullptr) {
    EXPECT_EQ(isas.front(), auto_name) << "the automatic choice should be the best one";
  }
  EXPECT_EQ(auto_name, attnres_cpu_isa());
}

TEST(Library, VersionAndStatusStrings) {
  const std::string expected = std::to_string(ATTNRES_VERSION_MAJOR) + "." +
                               std::to_string(ATTNRES_VERSION_MINOR) + "." +
                               std::to_string(ATTNRES_VERSION_PATCH);
  ASSERT_NE(attnres_version(), nullptr);
  EXPECT_EQ(expected, attnres_version());
  std::set<std::string> names;
  for (int s = ATTNRES_OK; s <= ATTNRES_ERROR_UNSUPPORTED_DEVICE; ++s) {
    const char* name = attnres_status_string(static_cast<attnres_status>(s));
    ASSERT_NE(name, nullptr);
    EXPECT_STRNE(name, "");
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 7u) << "status names should be distinct";
}

TEST(Library, ThreadCountControl) {
  const int initial = attnres_get_num_threads();
  EXPECT_GE(initial, 1);
  attnres_set_num_threads(3);
  EXPECT_EQ(attnres_get_num_threads(), 3);
  attnres_set_num_threads(1);
  EXPECT_EQ(attnres_get_num_threads(), 1);
  attnres_set_num_threads(0);
  EXPECT_EQ(attnres_get_num_threads(), initial);
  attnres_set_num_threads(-5);
  EXPECT_EQ(attnres_get_num_threads(), initial);
}

// The test helpers themselves: storage conversions round to nearest even.
TEST(TestUtil, Bf16RoundsToNearestEven) {
  EXPECT_EQ(DoubleToBf16(1.0), 0x3F80);
  EXPECT_EQ(DoubleToBf16(-2.0), 0xC000);
  // 1 + 2^-8 is exactly half way between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(DoubleToBf16(1.0 + std::ldexp(1.0, -8)), 0x3F80);
  // 1 + 3 * 2^-8 is half way between 1 + 2^-7 (odd) and 1 + 2^-6: up.
  EXPECT_EQ(DoubleToBf16(1.0 + 3 * std::ldexp(1.0, -8)), 0x3F82);
  // Just above the tie in double but a tie once rounded to float: a naive
  // double -> float -> bf16 path rounds down here; round-to-odd does not.
  EXPECT_EQ(DoubleToBf16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)), 0x3F81);
  EXPECT_EQ(DoubleToBf16(1e39), 0x7F80);
  EXPECT_TRUE(std::isnan(Bf16ToDouble(DoubleToBf16(NAN))));
  EXPECT_EQ(Bf16ToDouble(0x3F81), 1.0 + std::ldexp(1.0, -7));
}

TEST(TestUtil, F16RoundsToNearestEven) {
  EXPECT_EQ(DoubleToF16(1.0), 0x3C00);
  EXPECT_EQ(DoubleToF16(-2.0), 0xC000);
  EXPECT_EQ(DoubleToF16(65504.0), 0x7BFF);
  EXPECT_EQ(DoubleToF16(65519.99), 0x7BFF);
  EXPECT_EQ(DoubleToF16(65520.0), 0x7C00);
  EXPECT_EQ(DoubleToF16(std::ldexp(1.0, -24)), 0x0001);
  EXPECT_EQ(DoubleToF16(std::ldexp(1.0, -25)), 0x0000);  // tie to even (0)
  EXPECT_EQ(DoubleToF16(1.0 + std::ldexp(1.0, -11)), 0x3C00);      // tie to even
  EXPECT_EQ(DoubleToF16(1.0 + 3 * std::ldexp(1.0, -11)), 0x3C02);  // tie to even
  EXPECT_EQ(F16ToDouble(0x3C01), 1.0 + std::ldexp(1.0, -10));
  EXPECT_EQ(F16ToDouble(0x0400), std::ldexp(1.0, -14));
#if defined(__FLT16_MAX__)
  // Against the compiler's binary16 conversion on a sweep of values: _Float16, or
  // __fp16 on aarch64 (g++ 12 defines __FLT16_MAX__ there but has no _Float16 in C++).
#if defined(__aarch64__)
  using Half = __fp16;
#else
  using Half = _Float16;
#endif
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> exponent(-26, 17);
  for (int i = 0; i < 20000; ++i) {
    const double x = (i % 2 ? -1 : 1) * std::exp2(exponent(rng));
    const Half h = static_cast<Half>(x);
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    ASSERT_EQ(DoubleToF16(x), bits) << x;
    ASSERT_EQ(F16ToDouble(bits), static_cast<double>(h)) << x;
  }
#endif
}

}  // namespace
}  // namespace attnres_test
