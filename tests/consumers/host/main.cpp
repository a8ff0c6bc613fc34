// Consumes trellis from outside the source tree: includes the umbrella header and uses it.
#include <trellis/trellis.hpp>

#include <cstdio>

int main() {
  trellis::Tensor<float, 2> t({3, 4});
  for (trellis::index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(i);
  float corner = t(2, 3);
  trellis::bfloat16 b(corner);
  std::printf("trellis %s: t(2,3) = %g, as bfloat16 %g\n", trellis::version_string, corner,
              static_cast<float>(b));
  return corner == 11.0f && static_cast<float>(b) == 11.0f ? 0 : 1;
}
