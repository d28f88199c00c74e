// Thread safety of the C ABI: calls from several threads at once, each on its
// own buffers, give bitwise the results of the same calls made one after
// another, on every backend; attnres_last_error() is per thread under
// concurrent failures (the two-thread handshake test is
// AbiErrorsThreads.LastErrorIsPerThread in test_abi_errors.cc; this one
// hammers it).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "attnres/attnres.h"
#include "test_util.h"

namespace attnres_test {
namespace {

constexpr int kThreads = 6;

struct Result {
  std::vector<double> out, rms, alpha, grad_w, grad_gamma;
  std::vector<std::vector<double>> grad_sources;
};

// Forward with both caches, then backward from the caches and without them.
std::vector<Result> RunCalls(AbiProblem* abi, const std::vector<double>& grad_out) {
  std::vector<Result> results;
  const ForwardOutput f = abi->Forward(abi->config().rmsnorm, true);
  EXPECT_EQ(f.status, ATTNRES_OK) << f.error;
  for (bool caches : {true, false}) {
    BackwardOptions o;
    o.use_rms_cache = abi->config().rmsnorm && caches;
    o.use_alpha_cache = caches;
    const BackwardOutput b = abi->Backward(grad_out, o);
    EXPECT_EQ(b.status, ATTNRES_OK) << b.error;
    results.push_back({f.out, f.rms, f.alpha, b.grad_w, b.grad_gamma, b.grad_sources});
  }
  return results;
}

bool SameResults(const std::vector<Result>& a, const std::vector<Result>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (!BitwiseEqual(a[k].out, b[k].out) || !BitwiseEqual(a[k].rms, b[k].rms) ||
        !BitwiseEqual(a[k].alpha, b[k].alpha) || !BitwiseEqual(a[k].grad_w, b[k].grad_w) ||
        !BitwiseEqual(a[k].grad_gamma, b[k].grad_gamma) ||
        a[k].grad_sources.size() != b[k].grad_sources.size()) {
      return false;
    }
    for (size_t i = 0; i < a[k].grad_sources.size(); ++i) {
      if (!BitwiseEqual(a[k].grad_sources[i], b[k].grad_sources[i])) return false;
    }
  }
  return true;
}

// A different problem per thread: every dtype, with and without RMSNorm and a
// partial block, strided rows, enough tokens for several chunks.
Case ThreadCase(int k) {
  const attnres_dtype dtypes[] = {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_BFLOAT16,
                                  ATTNRES_DTYPE_FLOAT16, ATTNRES_DTYPE_FLOAT64};
  Case c;
  c.tokens = 300 + 37 * k;
  c.dim = 48 + 8 * k + (k % 3);
  c.num_blocks = 2 + k % 4;
  c.has_partial = k % 2 == 0;
  c.rmsnorm = k % 3 != 2;
  c.has_gamma = k != 1;
  c.scale = 0.5 + 0.25 * k;
  c.dtype = dtypes[k % 4];
  c.source_pad = k % 2 ? 5 : 0;
  c.out_pad = k % 3;
  c.grad_source_pad = 1;
  c.seed = 9000 + k;
  return c;
}

// The library's thread count (an OpenMP team per call) only matters on the CPU.
void CheckConcurrentMatchesSerial(int library_threads) {
  attnres_set_num_threads(library_threads);
  std::vector<Case> cases;
  std::vector<attnres::ref::Problem> problems;
  std::vector<std::vector<double>> grads;
  for (int k = 0; k < kThreads; ++k) {
    cases.push_back(ThreadCase(k));
    problems.push_back(MakeProblem(cases[k]));
    grads.push_back(MakeGradOut(cases[k]));
  }
  ForEachBackend([&](const Backend& backend) {
    std::vector<std::vector<Result>> serial;
    for (int k = 0; k < kThreads; ++k) {
      AbiProblem abi(cases[k], problems[k], backend.device);
      serial.push_back(RunCalls(&abi, grads[k]));
    }

    constexpr int kRounds = 4;
    std::atomic<int> ready{0};
    std::vector<int> mismatches(kThreads, 0);
    std::vector<std::thread> threads;
    for (int k = 0; k < kThreads; ++k) {
      threads.emplace_back([&, k] {
        AbiProblem abi(cases[k], problems[k], backend.device);  // this thread's own buffers
        ready.fetch_add(1);
        while (ready.load() < kThreads) std::this_thread::yield();  // start together
        for (int round = 0; round < kRounds; ++round) {
          if (!SameResults(RunCalls(&abi, grads[k]), serial[k])) ++mismatches[k];
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (int k = 0; k < kThreads; ++k) {
      EXPECT_EQ(mismatches[k], 0) << "thread " << k << " (" << cases[k].Describe()
                                  << ") differs from the serial run";
    }
  });
  attnres_set_num_threads(0);
}

TEST(Threads, ConcurrentCallsMatchSerialOneLibraryThread) { CheckConcurrentMatchesSerial(1); }

// Each caller's call also forks its own OpenMP team.
TEST(Threads, ConcurrentCallsMatchSerialTwoLibraryThreads) { CheckConcurrentMatchesSerial(2); }

// Every thread alternates its own failure (a different argument per thread)
// with successful calls: attnres_last_error() always shows this thread's last
// failure, never another thread's, and a success does not change it. CPU only:
// the arguments are checked before a call reaches any backend.
TEST(Threads, LastErrorIsPerThreadUnderConcurrency) {
  struct Breaker {
    const char* name;
    void (*apply)(attnres_params*);
  };
  const Breaker breakers[] = {
      {"dim", [](attnres_params* p) { p->dim = 0; }},
      {"eps", [](attnres_params* p) { p->eps = -1; }},
      {"num_tokens", [](attnres_params* p) { p->num_tokens = -3; }},
      {"scale", [](attnres_params* p) { p->scale = std::numeric_limits<double>::infinity(); }},
      {"out_row_stride", [](attnres_params* p) { p->out_row_stride = 1; }},
      {"proj_weight", [](attnres_params* p) { p->proj_weight = nullptr; }},
  };
  constexpr int kIterations = 300;
  std::atomic<int> ready{0};
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&, k] {
      const Breaker& breaker = breakers[k];
      Case c;
      c.tokens = 3;
      c.dim = 8 + k;
      c.seed = 70 + k;
      std::vector<float> out(c.tokens * c.dim);
      AbiProblem abi(c, MakeProblem(c));
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      const std::string fresh = attnres_last_error();
      if (!fresh.empty()) failures[k] = "a new thread starts with \"" + fresh + "\"";
      for (int it = 0; it < kIterations && failures[k].empty(); ++it) {
        attnres_params p = abi.InputParams();
        p.out = out.data();
        p.out_row_stride = c.dim;
        breaker.apply(&p);
        if (attnres_forward(&p) == ATTNRES_OK) {
          failures[k] = std::string("breaking ") + breaker.name + " did not fail";
          break;
        }
        const std::string msg = attnres_last_error();
        if (msg.find(breaker.name) == std::string::npos) {
          failures[k] = "message \"" + msg + "\" does not name " + breaker.name;
          break;
        }
        p = abi.InputParams();
        p.out = out.data();
        p.out_row_stride = c.dim;
        if (attnres_forward(&p) != ATTNRES_OK) {
          failures[k] = "a valid call failed: " + std::string(attnres_last_error());
          break;
        }
        if (msg != attnres_last_error()) {
          failures[k] = "message changed to \"" + std::string(attnres_last_error()) + "\"";
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int k = 0; k < kThreads; ++k) EXPECT_EQ(failures[k], "") << "thread " << k;
}

}  // namespace
}  // namespace attnres_test
