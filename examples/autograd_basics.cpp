// The README's first example: a differentiable computation on CPU tensors, backward, and the memory
// it took. Kept compiling so that the README stays true.
#include <iostream>

#include "core/ops.h"

int main() {
  using namespace microbatch;
  manual_seed(0);
  Tensor x = randn({64, 784});                                   // a batch of inputs
  Tensor w = (randn({128, 784}) * 0.05).detach().requires_grad_();  // (out, in)
  Tensor b = zeros({128}, {.requires_grad = true});

  reset_peak_memory_stats(kCPU);
  Tensor hidden = gelu(linear(x, w, b));                         // (64, 128)
  Tensor loss = mean(sum(hidden * hidden, {1}));
  loss.backward();

  std::cout << "loss " << loss.item() << "\n";
  std::cout << "dw " << w.grad().shape()[0] << "x" << w.grad().shape()[1]
            << ", |db|_1 = " << sum(abs(b.grad())).item() << "\n";
  std::cout << "peak allocated " << format_bytes(memory_stats(kCPU).allocated.peak) << "\n";
  return 0;
}
