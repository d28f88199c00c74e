// The attnres command-line tool.
//   attnres check [--cases N] [--seed S]   random cases of every option vs the reference
//   attnres run --tokens N --dim D --blocks N [--partial] [--dtype bf16|f16|f32|f64]
//               [--no-rmsnorm] [--threads N] [--repeat N] [--queries S]
//                                          time one call (or phase 1 with S queries)
//   attnres bench [--json] [...]            see bench/bench.h
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "bench.h"
#include "ref/harness.h"

namespace {

using attnres::harness::Case;
using attnres::harness::CaseSpec;

void Usage() {
  std::fprintf(stderr,
               "usage:\n"
               "  attnres check [--cases N] [--seed S]\n"
               "  attnres run --tokens N --dim D --blocks N [--partial] [--dtype bf16|f16|f32|f64]\n"
               "              [--no-rmsnorm] [--scale X] [--eps X] [--threads N] [--repeat N]\n"
               "              [--no-check] [--queries S]   (S >= 1: phase 1 of the two-phase schedule,\n"
               "              S queries over the blocks, instead of the single op)\n"
               "  attnres bench [--json] [--quick | --headline] [--no-baseline] [--threads N] [--repeat N]\n"
               "  attnres isas      (the CPU kernel variants this CPU runs, best first)\n"
               "  attnres --version\n");
}

// Flag parsing: "--name value" and "--flag".
class Args {
 public:
  Args(int argc, char** argv) : args_(argv, argv + argc) {}
  bool Flag(const char* name) {
    auto it = std::find(args_.begin(), args_.end(), name);
    if (it == args_.end()) return false;
    args_.erase(it);
    return true;
  }
  std::string Value(const char* name, const std::string& fallback) {
    auto it = std::find(args_.begin(), args_.end(), name);
    if (it == args_.end()) return fallback;
    if (it + 1 == args_.end()) Die(std::string(name) + " needs a value");
    std::string v = *(it + 1);
    args_.erase(it, it + 2);
    return v;
  }
  int64_t Int(const char* name, int64_t fallback) {
    const std::string v = Value(name, std::to_string(fallback));
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0') Die(std::string(name) + ": not an integer: " + v);
    return n;
  }
  double Double(const char* name, double fallback) {
    const std::string v = Value(name, std::to_string(fallback));
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0') Die(std::string(name) + ": not a number: " + v);
    return x;
  }
  void ExpectEmpty() {
    if (!args_.empty()) Die("unknown argument: " + args_.front());
  }
  static void Die(const std::string& message) {
    std::fprintf(stderr, "attnres: %s\n", message.c_str());
    Usage();
    std::exit(2);
  }

 private:
  std::vector<std::string> args_;
};

bool Ok(attnres_status status, const char* what) {
  if (status == ATTNRES_OK) return true;
  std::fprintf(stderr, "%s failed: %s: %s\n", what, attnres_status_string(status),
               attnres_last_error());
  return false;
}

int Check(Args& args) {
  const int64_t num_cases = args.Int("--cases", 300);
  std::mt19937_64 rng(args.Int("--seed", 2026));
  args.ExpectEmpty();
  const attnres_dtype dtypes[] = {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_FLOAT64,
                                  ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT16};
  const int64_t dims[] = {1, 7, 64, 123, 512, 1536, 4096};
  const int64_t blocks[] = {0, 1, 2, 8, 31, 32, 127, 300};
  auto pick = [&](int64_t n) { return int64_t(rng() % uint64_t(n)); };
  int failures = 0;
  double worst_fwd = 0, worst_bwd = 0;
  for (int64_t c = 0; c < num_cases; ++c) {
    CaseSpec spec;
    spec.dtype = dtypes[pick(4)];
    spec.dim = dims[pick(7)];
    spec.num_blocks = blocks[pick(8)];
    spec.partial = spec.num_blocks == 0 || pick(2) == 0;
    // Keep each case around a million source elements so that all 300 run in seconds.
    const int64_t budget = std::max<int64_t>(1, 400000 / (spec.dim * spec.num_sources()));
    spec.tokens = pick(std::min<int64_t>(budget, 300)) + (pick(8) == 0 ? 0 : 1);
    // With D = 1, RMSNorm maps every source to about +-gamma: logits tie and dw is
    // pure cancellation, so relative error means nothing there (the unit tests
    // cover D = 1 with absolute bounds).
    spec.rmsnorm = spec.dim > 1 && pick(4) != 0;
    spec.scale = (const double[]){1.0, 0.25, 3.0, -1.0}[pick(4)];
    // eps = 0 only with enough elements: with D < 8 the keys are nearly sign(v),
    // logits tie exactly and dw is pure cancellation (reference ~ 0).
    spec.eps = (const double[]){1e-6, 1e-5, 1e-2, 0.0}[pick(spec.dim < 8 ? 3 : 4)];
    spec.row_padding = pick(3) == 0 ? pick(17) : 0;
    spec.backward_caches = pick(2) == 0;
    spec.logit_magnitude = (const double[]){1.0, 5.0, 1e4}[pick(3)];
    spec.seed = rng();
    Case one(spec);
    if (!Ok(one.Forward(), "forward") || !Ok(one.Backward(), "backward")) {
      ++failures;
      continue;
    }
    const attnres::harness::Errors e = one.Compare();
    // With logits of 1e4 the softmax saturates and the backward is ill-conditioned
    // (an fp32 logit carries ~1e-3 absolute error, which near-ties amplify):
    // SPEC §3 asks for exact forward and finite gradients there.
    const bool huge_logits = spec.logit_magnitude > 100;
    // A logit of size |z| is only known to |z| * (unit roundoff) in the accumulation
    // type, and alpha inherits that error near ties.
    const double roundoff = spec.dtype == ATTNRES_DTYPE_FLOAT64 ? 1.1e-16 : 6e-8;
    const double tol_fwd =
        std::max(attnres::harness::ForwardTolerance(spec.dtype),
                 4 * std::fabs(spec.scale) * spec.logit_magnitude * roundoff);
    const double tol_bwd = attnres::harness::BackwardTolerance(spec.dtype);
    worst_fwd = std::max(worst_fwd, e.WorstForward() / tol_fwd);
    if (!huge_logits) worst_bwd = std::max(worst_bwd, e.WorstBackward() / tol_bwd);
    const bool backward_ok = huge_logits ? std::isfinite(e.WorstBackward())
                                         : e.WorstBackward() <= tol_bwd;
    if (!(e.WorstForward() <= tol_fwd) || !backward_ok) {
      ++failures;
      std::printf("FAIL %s: out %.2e rms %.2e alpha %.2e | grad_v %.2e dw %.2e dgamma %.2e\n",
                  spec.Describe().c_str(), e.out, e.rms, e.alpha, e.grad_sources, e.grad_w,
                  e.grad_gamma);
    }
  }
  std::printf("attnres check: %lld cases, %d failed (isa %s, %d threads); worst error / tolerance: "
              "forward %.3f, backward %.3f\n",
              static_cast<long long>(num_cases), failures, attnres_cpu_isa(),
              attnres_get_num_threads(), worst_fwd, worst_bwd);
  return failures == 0 ? 0 : 1;
}

// The median of `repeat` timed calls after one warm-up, in milliseconds.
template <typename Call>
double MedianMs(int64_t repeat, Call call) {
  std::vector<double> ms;
  for (int64_t r = 0; r < repeat + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!Ok(call(), "call")) std::exit(1);
    const auto t1 = std::chrono::steady_clock::now();
    if (r > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Times the forward and backward of `one` and checks a slice of the same shape
// (`make_slice(tokens)`) against the float64 reference. Bytes moved are what each
// direction must read and write once: `fwd_rows` and `bwd_rows` rows of dim
// elements per token.
template <typename Case, typename MakeSlice>
int TimeAndCheck(Case& one, const char* what, double fwd_rows, double bwd_rows, int64_t repeat,
                 bool check, MakeSlice make_slice) {
  const CaseSpec& spec = one.spec();
  attnres_params fwd = one.ForwardParams(), bwd = one.BackwardParams();
  fwd.rms_cache = fwd.alpha_cache = nullptr;  // time the plain call; caches are optional
  bwd.rms_cache = bwd.alpha_cache = nullptr;
  const bool phase1 = fwd.num_queries > 0 && fwd.query_outs != nullptr;
  const double fwd_ms = MedianMs(repeat, [&] { return phase1 ? attnres_phase1_forward(&fwd) : attnres_forward(&fwd); });
  const double bwd_ms = MedianMs(repeat, [&] { return phase1 ? attnres_phase1_backward(&bwd) : attnres_backward(&bwd); });
  const double row_bytes = double(spec.tokens) * double(spec.dim) *
                           double(attnres::harness::ElementBytes(spec.dtype));
  std::printf("attnres run: %s%s, isa %s, %d threads, median of %lld\n", what,
              spec.Describe().c_str(), attnres_cpu_isa(), attnres_get_num_threads(),
              static_cast<long long>(repeat));
  std::printf("  forward : %9.3f ms  %7.1f GB/s  (%.1f MB moved)\n", fwd_ms,
              fwd_rows * row_bytes / fwd_ms / 1e6, fwd_rows * row_bytes / 1e6);
  std::printf("  backward: %9.3f ms  %7.1f GB/s  (%.1f MB moved)\n", bwd_ms,
              bwd_rows * row_bytes / bwd_ms / 1e6, bwd_rows * row_bytes / 1e6);
  if (!check) return 0;
  // The float64 reference of a large case takes a while: compare a slice of it.
  const int64_t tokens = std::min<int64_t>(
      spec.tokens, std::max<int64_t>(1, int64_t(2000000 / (double(spec.dim) * bwd_rows))));
  auto slice = make_slice(tokens);
  if (!Ok(slice.Forward(), "forward") || !Ok(slice.Backward(), "backward")) return 1;
  const attnres::harness::Errors e = slice.Compare();
  const bool pass = e.WorstForward() <= attnres::harness::ForwardTolerance(spec.dtype) &&
                    e.WorstBackward() <= attnres::harness::BackwardTolerance(spec.dtype);
  char caches[64];
  if (phase1) {
    std::snprintf(caches, sizeof caches, "lse %.2e", e.lse);
  } else {
    std::snprintf(caches, sizeof caches, "alpha %.2e, rms %.2e", e.alpha, e.rms);
  }
  std::printf("  max error vs float64 reference (%lld tokens): out %.2e, %s | "
              "grad sources %.2e, dw %.2e, dgamma %.2e  %s\n",
              static_cast<long long>(tokens), e.out, caches, e.grad_sources, e.grad_w,
              e.grad_gamma, pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

int Run(Args& args) {
  CaseSpec spec;
  spec.tokens = args.Int("--tokens", 65536);
  spec.dim = args.Int("--dim", 1536);
  spec.num_blocks = args.Int("--blocks", 16);
  spec.partial = args.Flag("--partial");
  spec.rmsnorm = !args.Flag("--no-rmsnorm");
  spec.scale = args.Double("--scale", 1.0);
  spec.eps = args.Double("--eps", 1e-6);
  const std::string dtype = args.Value("--dtype", "bf16");
  if (!attnres::harness::ParseDtype(dtype, &spec.dtype)) Args::Die("unknown dtype " + dtype);
  const int64_t threads = args.Int("--threads", 0);
  const int64_t repeat = std::max<int64_t>(1, args.Int("--repeat", 5));
  const int64_t queries = args.Int("--queries", 0);
  const bool check = !args.Flag("--no-check");
  args.ExpectEmpty();
  if (spec.tokens < 0 || spec.dim < 1 || spec.num_sources() < 1) {
    Args::Die("need --tokens >= 0, --dim >= 1 and at least one source");
  }
  if (queries < 0) Args::Die("need --queries >= 1 (phase 1), or 0 for the single op");
  if (queries > 0 && (spec.partial || spec.num_blocks < 1)) {
    Args::Die("--queries: phase 1 reads only completed blocks: need --blocks >= 1 and no --partial");
  }
  if (threads > 0) attnres_set_num_threads(int(threads));
  if (queries > 0) spec.backward_caches = false;  // phase 1 has none

  auto with_tokens = [&](int64_t tokens) {
    CaseSpec s = spec;
    s.tokens = tokens;
    return s;
  };
  if (queries > 0) {
    // Phase 1 reads N blocks and writes S outputs; its backward reads the N blocks
    // and S output gradients and writes N block gradients.
    const double N = double(spec.num_blocks), S = double(queries);
    attnres::harness::Phase1Case one(spec, queries);
    const std::string what = "phase 1, " + std::to_string(queries) + " queries, ";
    return TimeAndCheck(one, what.c_str(), N + S, 2 * N + S, repeat, check, [&](int64_t tokens) {
      return attnres::harness::Phase1Case(with_tokens(tokens), queries);
    });
  }
  // The single op reads L sources and writes 1 row; its backward reads L sources and
  // the output gradient and writes L source gradients.
  const double L = double(spec.num_sources());
  Case one(spec);
  return TimeAndCheck(one, "", L + 1, 2 * L + 1, repeat, check,
                      [&](int64_t tokens) { return Case(with_tokens(tokens)); });
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    Usage();
    return 2;
  }
  const std::string command = argv[1];
  Args args(argc - 2, argv + 2);
  if (command == "check") return Check(args);
  if (command == "run") return Run(args);
  if (command == "bench") {
    attnres::bench::Options options;
    options.json = args.Flag("--json");
    options.quick = args.Flag("--quick");
    options.headline = args.Flag("--headline");
    options.baseline = !args.Flag("--no-baseline");
    options.threads = int(args.Int("--threads", 0));
    options.repeat = int(args.Int("--repeat", 5));
    args.ExpectEmpty();
    return attnres::bench::Main(options);
  }
  if (command == "--version" || command == "version") {
    std::printf("attnres %s (cpu isa %s)\n", attnres_version(), attnres_cpu_isa());
    return 0;
  }
  if (command == "isas") {
    std::printf("%s\n", attnres_cpu_isas());
    return 0;
  }
  Usage();
  return 2;
}
