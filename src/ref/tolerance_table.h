// SPEC §3's tolerance table, the one copy for both languages: how close every
// backend must come to the float64 reference, as each output's max error relative
// to the reference tensor's max-abs. Columns: h (and phase 1's o); every gradient
// (dw and dgamma included); the accumulation-type outputs (the rms/alpha caches,
// phase 1's lse). 16-bit inputs are compared with the reference fed the same
// 16-bit values.
//
// An X-macro list: src/ref/reference.h expands it into ref::SpecTolerance, and
// tests/python/torch_reference.py reads the ATTNRES_TOLERANCE lines into TOLERANCE
// (dtype names as torch spells them in lower case), so keep one entry per line.
// No include guard: every includer defines ATTNRES_TOLERANCE first.
//
//                dtype     h      gradients  caches/lse
ATTNRES_TOLERANCE(FLOAT32,  1e-5,  1e-4,      1e-5)
ATTNRES_TOLERANCE(FLOAT64,  1e-10, 1e-10,     1e-10)
ATTNRES_TOLERANCE(BFLOAT16, 8e-3,  1e-2,      1e-5)
ATTNRES_TOLERANCE(FLOAT16,  1e-3,  1e-2,      1e-5)
