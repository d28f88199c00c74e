// Block AttnRes from C++: forward and backward with the thin C++ layer.
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

  try {
    in.eps = -1;
    attnres::Forward(in, out.data());
  } catch (const attnres::Error& e) {
    std::printf("expected error (%s): %s\n", attnres_status_string(e.status()), e.what());
  }
  return 0;
}
