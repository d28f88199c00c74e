// The rows every op's dispatcher prepares and finishes (kernel_table.h:
// WeightRowFn, WeightGradFn), on every CPU variant, bit for bit against the
// straightforward scalar loops they replaced: element d of a kernel row sits at
// KernelRowIndex(d) below, w * gamma is one product rounded to the accumulation
// type, and the weight gradient sums the chunk rows in order from zero before
// one product and one rounding to the dtype. The forward and backward tests only
// see these rows through tolerances; a wrong lane order on one ISA or a padding
// entry left unwritten would otherwise show as a small error or none at all.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attnres/attnres.h"
#include "cpu/kernel_table.h"
#include "test_util.h"

namespace attnres_test {
namespace {

using attnres::cpu::KernelTable;

const attnres_dtype kDtypes[] = {ATTNRES_DTYPE_FLOAT32, ATTNRES_DTYPE_FLOAT64,
                                  ATTNRES_DTYPE_BFLOAT16, ATTNRES_DTYPE_FLOAT16};
const int64_t kDims[] = {1, 7, 8, 9, 63, 64, 65, 7168, 7169};

std::vector<std::string> RunnableIsas() {
  std::vector<std::string> names;
  std::istringstream list(attnres_cpu_isas());
  for (std::string name; list >> name;) names.push_back(name);
  return names;
}

bool IsF64(attnres_dtype dtype) { return dtype == ATTNRES_DTYPE_FLOAT64; }

// Where element d of a row sits in the kernels' rows: bf16 pairs of vectors wider
// than 16 bytes are in "unpack" order (simd-inl.h, Elem<Bf16>): words 0-3 of every
// 16-byte lane of the pair's 2 * lanes values in the first vector, words 4-7 in
// the second.
int64_t KernelRowIndex(const KernelTable& table, attnres_dtype dtype, int64_t d) {
  if (dtype != ATTNRES_DTYPE_BFLOAT16 || table.vector_bytes <= 16) return d;
  const int64_t lanes = table.vector_bytes / 4;
  const int64_t e = d % (2 * lanes), word = e % 8;
  return d - e + (word / 4) * lanes + (e / 8) * 4 + word % 4;
}

// Rows of A padded to two of the widest (64-byte) vectors, as the dispatcher does.
int64_t PaddedDim(int64_t dim, attnres_dtype dtype) {
  const int64_t lanes = 128 / (IsF64(dtype) ? 8 : 4);
  return (dim + lanes - 1) / lanes * lanes;
}

// Binary exponents that reach the dtype's subnormals (of A for products of two)
// and its overflow.
std::uniform_int_distribution<int> MagnitudeRange(attnres_dtype dtype) {
  return dtype == ATTNRES_DTYPE_FLOAT16 ? std::uniform_int_distribution<int>(-16, 8)
                                       : std::uniform_int_distribution<int>(-70, 20);
}

// A row of `dim` values of the dtype: a spread of magnitudes and signs, with zeros
// of both signs, infinities, a NaN, and values whose products are subnormal.
std::vector<double> Values(std::mt19937_64& rng, int64_t dim, attnres_dtype dtype, bool nan) {
  std::uniform_real_distribution<double> mantissa(-2, 2);
  std::uniform_int_distribution<int> exponent = MagnitudeRange(dtype);
  std::vector<double> v(dim);
  for (int64_t d = 0; d < dim; ++d) {
    double x = std::ldexp(mantissa(rng), exponent(rng));
    switch (rng() % 64) {
      case 0: x = 0.0; break;
      case 1: x = -0.0; break;
      case 2: x = -INFINITY; break;
      case 3: x = nan ? NAN : 1.0; break;
      default: break;
    }
    v[d] = RoundToDType(x, dtype);
  }
  return v;
}

// Values stored in the dtype.
std::vector<uint8_t> Store(const std::vector<double>& values, attnres_dtype dtype) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  for (size_t k = 0; k < values.size(); ++k) {
    uint8_t* p = bytes.data() + k * DTypeSize(dtype);
    const double x = values[k];
    const float f = float(x);
    uint16_t half = 0;
    switch (dtype) {
      case ATTNRES_DTYPE_FLOAT64: std::memcpy(p, &x, 8); break;
      case ATTNRES_DTYPE_FLOAT32: std::memcpy(p, &f, 4); break;
      case ATTNRES_DTYPE_BFLOAT16: half = DoubleToBf16(x); std::memcpy(p, &half, 2); break;
      case ATTNRES_DTYPE_FLOAT16: half = DoubleToF16(x); std::memcpy(p, &half, 2); break;
      default: break;
    }
  }
  return bytes;
}

double Load(const uint8_t* p, attnres_dtype dtype) {
  double d = 0;
  float f = 0;
  uint16_t h = 0;
  switch (dtype) {
    case ATTNRES_DTYPE_FLOAT64: std::memcpy(&d, p, 8); return d;
    case ATTNRES_DTYPE_FLOAT32: std::memcpy(&f, p, 4); return f;
    case ATTNRES_DTYPE_BFLOAT16: std::memcpy(&h, p, 2); return Bf16ToDouble(h);
    case ATTNRES_DTYPE_FLOAT16: std::memcpy(&h, p, 2); return F16ToDouble(h);
    default: return 0;
  }
}

// Bitwise equal, or both NaN (which NaN a product of NaNs returns is the
// hardware's choice, and no kernel depends on the payload).
template <typename A>
bool SameBits(A got, A want) {
  if (std::isnan(want)) return std::isnan(got);
  return std::memcmp(&got, &want, sizeof(A)) == 0;
}

template <typename A>
void CheckWeightRow(const KernelTable& table, attnres_dtype dtype, int64_t dim, bool has_w,
                    bool has_gamma, std::mt19937_64& rng) {
  const int64_t padded = PaddedDim(dim, dtype);
  const std::vector<double> w = Values(rng, dim, dtype, true);
  const std::vector<double> gamma = Values(rng, dim, dtype, true);
  const std::vector<uint8_t> w_bytes = Store(w, dtype), gamma_bytes = Store(gamma, dtype);
  std::vector<A> row(padded);
  std::memset(row.data(), 0x7F, padded * sizeof(A));  // every entry must be written
  table.weight_row[dtype](has_w ? w_bytes.data() : nullptr,
                          has_gamma ? gamma_bytes.data() : nullptr, dim, padded, row.data());
  for (int64_t d = 0; d < padded; ++d) {
    A want = 0;
    if (d < dim) {
      want = has_w ? A(w[d]) : A(1);
      if (has_gamma) want = want * A(gamma[d]);
    }
    const int64_t k = KernelRowIndex(table, dtype, d);
    ASSERT_TRUE(SameBits(row[k], want))
        << table.name << " " << DTypeName(dtype) << " dim " << dim << (has_w ? "" : " w=NULL")
        << (has_gamma ? " gamma" : "") << ": element " << d << " (row entry " << k << ") is "
        << row[k] << ", want " << want;
  }
}

template <typename A>
void CheckWeightGrad(const KernelTable& table, attnres_dtype dtype, int64_t dim, int64_t rows,
                     bool has_factor, std::mt19937_64& rng) {
  const int64_t padded = PaddedDim(dim, dtype);
  const int64_t stride = padded + 32;  // chunk rows need not be adjacent
  std::vector<A> u(rows * stride);
  // Finite partial sums: a NaN's payload would differ between the library's
  // conversion to fp16 and the test's (the NaN cases are in CheckWeightRow).
  std::uniform_real_distribution<double> mantissa(-2, 2);
  std::uniform_int_distribution<int> exponent = MagnitudeRange(dtype);
  for (A& x : u) x = rng() % 32 == 0 ? A(-0.0) : A(std::ldexp(mantissa(rng), exponent(rng)));
  const std::vector<double> factor = Values(rng, dim, dtype, false);
  const std::vector<uint8_t> factor_bytes = Store(factor, dtype);
  const size_t elem = DTypeSize(dtype);
  std::vector<uint8_t> out((dim + 8) * elem, 0xA5);  // nothing past dim is written
  table.weight_grad[dtype](u.data(), rows, stride, has_factor ? factor_bytes.data() : nullptr,
                           out.data(), dim);
  for (int64_t d = 0; d < dim; ++d) {
    const int64_t k = KernelRowIndex(table, dtype, d);
    A sum = 0;
    for (int64_t r = 0; r < rows; ++r) sum += u[r * stride + k];
    if (has_factor) sum = sum * A(factor[d]);
    // One rounding of the A result to the dtype (Store's conversions round to
    // nearest even; from a float, DoubleToBf16's round-to-odd step is exact).
    // A NaN (inf * 0) only needs to stay a NaN: DoubleToF16 drops its sign.
    const std::vector<uint8_t> want = Store({double(sum)}, dtype);
    const bool same = std::isnan(sum) ? std::isnan(Load(out.data() + d * elem, dtype))
                                      : std::memcmp(out.data() + d * elem, want.data(), elem) == 0;
    ASSERT_TRUE(same)
        << table.name << " " << DTypeName(dtype) << " dim " << dim << " rows " << rows
        << (has_factor ? " with factor" : "") << ": element " << d << " differs (want "
        << double(sum) << ")";
  }
  for (size_t b = dim * elem; b < out.size(); ++b) {
    ASSERT_EQ(out[b], 0xA5) << table.name << " " << DTypeName(dtype) << " dim " << dim
                            << ": wrote past the row";
  }
}

TEST(WeightRows, WeightTimesGammaIsTheScalarProductInKernelOrder) {
  std::mt19937_64 rng(17);
  for (const std::string& isa : RunnableIsas()) {
    const KernelTable* table = attnres::cpu::KernelTableForTesting(isa.c_str());
    ASSERT_NE(table, nullptr) << isa;
    for (attnres_dtype dtype : kDtypes) {
      for (int64_t dim : kDims) {
        for (bool has_w : {true, false}) {
          for (bool has_gamma : {true, false}) {
            if (IsF64(dtype)) {
              CheckWeightRow<double>(*table, dtype, dim, has_w, has_gamma, rng);
            } else {
              CheckWeightRow<float>(*table, dtype, dim, has_w, has_gamma, rng);
            }
          }
        }
      }
    }
  }
}

TEST(WeightRows, WeightGradientIsTheChunkOrderSumTimesTheFactor) {
  std::mt19937_64 rng(1717);
  for (const std::string& isa : RunnableIsas()) {
    const KernelTable* table = attnres::cpu::KernelTableForTesting(isa.c_str());
    ASSERT_NE(table, nullptr) << isa;
    for (attnres_dtype dtype : kDtypes) {
      for (int64_t dim : kDims) {
        for (int64_t rows : {1, 3}) {
          for (bool has_factor : {true, false}) {
            if (IsF64(dtype)) {
              CheckWeightGrad<double>(*table, dtype, dim, rows, has_factor, rng);
            } else {
              CheckWeightGrad<float>(*table, dtype, dim, rows, has_factor, rng);
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attnres_test
