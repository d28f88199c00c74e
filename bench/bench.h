// The benchmark harness behind `attnres bench` (see bench.cc).
#ifndef ATTNRES_BENCH_BENCH_H_
#define ATTNRES_BENCH_BENCH_H_

namespace attnres::bench {

struct Options {
  bool json = false;      // machine-readable output
  bool quick = false;     // bf16/fp32, D = 1536, L in {4, 17, 33}, 65536 tokens
  bool headline = false;  // only bf16, D = 1536, L = 17, 65536 tokens
  bool baseline = true;   // time the seed-structure C++ baseline (slow)
  int threads = 0;        // <= 0: the library's default
  int repeat = 5;         // timed runs per kernel, after one warm-up
};

// Runs the SPEC §4 table (or the subset `options` asks for) and the thread scaling.
int Main(const Options& options);

}  // namespace attnres::bench

#endif  // ATTNRES_BENCH_BENCH_H_
