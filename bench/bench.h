// The benchmark harness behind `attnres bench` (see bench.cc).
#ifndef ATTNRES_BENCH_BENCH_H_
#define ATTNRES_BENCH_BENCH_H_

namespace attnres::bench {

// Runs the SPEC §4 table; `quick` runs a subset. threads <= 0: the default.
int Main(bool json, bool quick, int threads, int repeat);

}  // namespace attnres::bench

#endif  // ATTNRES_BENCH_BENCH_H_
