#include <trellis/trellis.hpp>

#include <cstdio>

int main() {
  trellis::Tensor<float, 1> t({4});
  t(3) = 2.5f;
  trellis::half h(t(3));
  std::printf("trellis %s from conan: half(2.5) = %g\n", trellis::version_string, static_cast<float>(h));
  return static_cast<float>(h) == 2.5f ? 0 : 1;
}
