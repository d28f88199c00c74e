// The kernel table of one variant: the rows every op's dispatcher shares
// (kernel_table.h: WeightRowFn, WeightGradFn), defined here, and a pointer to each
// op's kernels (ATTNRES_CPU_OPS). Compiled once per ISA with the ops' sources
// (CMakeLists.txt: ATTNRES_CPU_KERNEL_SOURCES); compiled_isas.cc, generated from
// ATTNRES_ISAS, lists every variant's Kernels() for backend.cc to choose from.
#include "cpu/kernel_table.h"
#include "cpu/simd-inl.h"

namespace attnres::cpu {
namespace {

template <typename T>
void WeightRow(const void* w, const void* gamma, int64_t dim, int64_t padded, void* row) {
  Row<T>::WeightRow(static_cast<const T*>(w), static_cast<const T*>(gamma), dim, padded,
                    static_cast<typename Row<T>::A*>(row));
}

template <typename T>
void WeightGrad(const void* u, int64_t rows, int64_t row_stride, const void* factor, void* out,
                int64_t dim) {
  Row<T>::WeightGrad(static_cast<const typename Row<T>::A*>(u), rows, row_stride,
                     static_cast<const T*>(factor), static_cast<T*>(out), dim);
}

#define ATTNRES_STRINGIFY_(x) #x
#define ATTNRES_STRINGIFY(x) ATTNRES_STRINGIFY_(x)
#define ATTNRES_CPU_OP_ENTRY(Type, member, symbol) &ATTNRES_ISA::symbol,

const KernelTable kTable = {
    ATTNRES_STRINGIFY(ATTNRES_ISA),
    kVectorBytes,
    ATTNRES_BY_DTYPE(WeightRow),
    ATTNRES_BY_DTYPE(WeightGrad),
    ATTNRES_CPU_OPS(ATTNRES_CPU_OP_ENTRY)
};

}  // namespace

const KernelTable* ATTNRES_ISA::Kernels() { return &kTable; }

}  // namespace attnres::cpu
