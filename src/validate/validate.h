// The validator of each entry point of the C ABI (src/abi.cc calls these before
// any memory is touched): every argument checked, with the first failure's message
// recorded for attnres_last_error(); the backends trust what passes. One file per
// op: block_attn_res.cc (the single op), phase1.cc, phase2.cc; the checks they
// share are in validator.h.
#ifndef ATTNRES_SRC_VALIDATE_VALIDATE_H_
#define ATTNRES_SRC_VALIDATE_VALIDATE_H_

#include "attnres/attnres.h"

namespace attnres::validate {

attnres_status Forward(const attnres_params* p);   // attnres_forward
attnres_status Backward(const attnres_params* p);  // attnres_backward
attnres_status Phase1Forward(const attnres_params* p);
attnres_status Phase1Backward(const attnres_params* p);
attnres_status Phase2Forward(const attnres_params* p);
attnres_status Phase2Backward(const attnres_params* p);

}  // namespace attnres::validate

#endif  // ATTNRES_SRC_VALIDATE_VALIDATE_H_
