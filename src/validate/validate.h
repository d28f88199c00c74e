// The validation of each entry point of the C ABI (src/abi.cc runs it before any
// memory is touched): every argument checked, with the first failure's message
// recorded for attnres_last_error(); the backends trust what passes. One file per
// op (block_attn_res.cc for the single op, phase1.cc, phase2.cc) defines its
// OpRules; the checks they share are in validator.h.
#ifndef ATTNRES_SRC_VALIDATE_VALIDATE_H_
#define ATTNRES_SRC_VALIDATE_VALIDATE_H_

#include "attnres/attnres.h"

namespace attnres::validate {

class Validator;

// The rules of one op's inputs, or of one entry point's outputs (and the inputs
// only it reads); each returns early once the validator has failed.
using Rules = void (*)(Validator& v, const attnres_params* p);

// One op's rules: its inputs, and what its forward and its backward add. Each
// op's file defines its table.
struct OpRules {
  Rules inputs, forward, backward;
};
extern const OpRules kBlockAttnRes;  // block_attn_res.cc: attnres_forward/backward
extern const OpRules kPhase1;        // phase1.cc: attnres_phase1_forward/backward
extern const OpRules kPhase2;        // phase2.cc: attnres_phase2_forward/backward

// One entry point's validation (`function` names it in messages): the op's
// inputs, then its forward's or backward's rules if they passed, then the overlap
// sweep over every span recorded. Returns the status (and records the message) of
// the first failure.
attnres_status Run(const char* function, const attnres_params* p, const OpRules& op,
                   bool backward);

}  // namespace attnres::validate

#endif  // ATTNRES_SRC_VALIDATE_VALIDATE_H_
