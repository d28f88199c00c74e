// Outputs above 16 MB are written with non-temporal stores (src/cpu/backend.cc):
// check that path, with aligned and unaligned rows, on every CPU variant.
#include <gtest/gtest.h>

#include <utility>

#include "attnres/attnres.h"
#include "ref/harness.h"
#include "test_util.h"

namespace {

using attnres::harness::Case;
using attnres::harness::CaseSpec;

TEST(StreamingStores, LargeOutputsMatchTheReference) {
  attnres_test::ForEachIsa([](const std::string& isa) {
    // Aligned rows stream both outputs; bf16 rows padded by one element are not
    // all aligned to the store width and fall back to normal stores row by row.
    for (auto [dtype, padding] : {std::pair{ATTNRES_DTYPE_FLOAT32, 0},
                                  std::pair{ATTNRES_DTYPE_BFLOAT16, 0},
                                  std::pair{ATTNRES_DTYPE_BFLOAT16, 1}}) {
      CaseSpec spec;
      spec.dtype = dtype;
      spec.tokens = 4608;  // f32: a 28 MB output; bf16: 4 x 14 MB of gradients
      spec.dim = 1536;
      spec.num_blocks = 3;
      spec.partial = true;
      spec.row_padding = padding;
      spec.backward_caches = false;
      Case one(spec);
      ASSERT_EQ(one.Forward(), ATTNRES_OK) << attnres_last_error();
      ASSERT_EQ(one.Backward(), ATTNRES_OK) << attnres_last_error();
      const attnres::harness::Errors e = one.Compare();
      EXPECT_LE(e.WorstForward(), attnres::harness::ForwardTolerance(dtype))
          << isa << " " << spec.Describe();
      EXPECT_LE(e.WorstBackward(), attnres::harness::BackwardTolerance(dtype))
          << isa << " " << spec.Describe();
    }
  });
}

}  // namespace
