// Block AttnRes from C++: forward and backward with the thin C++ layer, then the
// two-phase schedule, which gives the same h as the single op, and phase 2 with the
// partial-block update fused.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "attnres/attnres.hpp"

int main() {
  const int64_t tokens = 4, dim = 8;
  std::vector<std::vector<float>> blocks(3, std::vector<float>(tokens * dim));
  for (size_t i = 0; i < blocks.size(); ++i)
    for (int64_t k = 0; k < tokens * dim; ++k) blocks[i][k] = float((i + 1) * (k % 7)) - 3.0f;
  std::vector<float> w(dim, 0.05f), out(tokens * dim), grad_out(tokens * dim, 1.0f);

  attnres::Inputs<float> in;
  in.num_tokens = tokens;
  in.dim = dim;
  for (const auto& b : blocks) in.blocks.push_back(b.data());
  in.proj_weight = w.data();  // gamma = nullptr: ones
  attnres::Forward(in, out.data());

  std::vector<std::vector<float>> grads(3, std::vector<float>(tokens * dim));
  std::vector<float> grad_w(dim), grad_gamma(dim);
  attnres::Gradients<float> g;
  for (auto& b : grads) g.blocks.push_back(b.data());
  g.proj_weight = grad_w.data();
  g.gamma = grad_gamma.data();
  attnres::Backward(in, grad_out.data(), g);
  std::printf("h[0] = %.4f, dw[0] = %.4f\n", out[0], grad_w[0]);

  // Two phases: phase 1 mixes the 3 blocks for 2 queries (the 2 sub-layers of a
  // block) at once; phase 2 merges query 1's result with the partial block.
  std::vector<float> w2(2 * dim, 0.05f), partial(tokens * dim, 0.5f);
  attnres::Inputs<float> p1 = in;
  p1.num_queries = 2;
  p1.proj_weight = w2.data();
  std::vector<std::vector<float>> o(2, std::vector<float>(tokens * dim));
  std::vector<std::vector<float>> lse(2, std::vector<float>(tokens));
  attnres::Phase1Forward<float>(p1, {o[0].data(), o[1].data()}, {lse[0].data(), lse[1].data()});
  attnres::Phase2Inputs<float> p2;
  p2.in = in;
  p2.in.blocks.clear();
  p2.in.partial = partial.data();
  p2.in.proj_weight = w2.data() + dim;
  p2.query_out = o[1].data();
  p2.query_lse = lse[1].data();
  std::vector<float> h_two_phase(tokens * dim), h_single(tokens * dim);
  attnres::Phase2Forward(p2, h_two_phase.data());
  attnres::Inputs<float> single = in;
  single.partial = partial.data();
  single.proj_weight = w2.data() + dim;
  attnres::Forward(single, h_single.data());
  float max_diff = 0;
  for (int64_t k = 0; k < tokens * dim; ++k) {
    max_diff = std::max(max_diff, std::fabs(h_two_phase[k] - h_single[k]));
  }
  std::printf("two phases vs the single op: max |difference| = %.2g\n", max_diff);

  // The fused update: phase 2 first adds a sub-layer's output y into the partial
  // block (p' = partial + y, written to p_new) and merges p', in one pass; the bits
  // are those of a separate addition followed by phase 2.
  std::vector<float> y(tokens * dim, 0.25f), p_new(tokens * dim), h_fused(tokens * dim);
  p2.partial_update = y.data();
  attnres::Phase2Forward(p2, h_fused.data(), p_new.data());
  std::vector<float> p_sum(tokens * dim);
  for (int64_t k = 0; k < tokens * dim; ++k) p_sum[k] = partial[k] + y[k];
  p2.partial_update = nullptr;
  p2.in.partial = p_sum.data();
  attnres::Phase2Forward(p2, h_two_phase.data());
  const bool same = p_new == p_sum && h_fused == h_two_phase;
  std::printf("fused partial-block update vs a separate add: %s\n", same ? "identical" : "DIFFERENT");

  try {
    in.eps = -1;
    attnres::Forward(in, out.data());
  } catch (const attnres::Error& e) {
    std::printf("expected error (%s): %s\n", attnres_status_string(e.status()), e.what());
  }
  return 0;
}
