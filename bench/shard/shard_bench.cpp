// redistribute vs the bare collective it resolves to, side by side in one run:
//   S(0) -> R   vs  Tensor out + comm.all_gather
//   P    -> R   vs  Tensor out + comm.all_reduce(sum)
//   P    -> S(0) vs Tensor out + comm.reduce_scatter(sum)
// Both variants allocate their output tensor, as a caller of the collective must.
//
//   shard_bench [--ranks N] [--json FILE]          timing table (min / median of repeats)
//   shard_bench --callgrind OP VARIANT [--elements N] [--iters K]
//       one rank; runs only OP (all_gather | all_reduce | reduce_scatter) as VARIANT (direct |
//       redistribute) inside CALLGRIND_START/STOP_INSTRUMENTATION, for callgrind_compare.sh
//       (one rank: the thread backend spins while waiting for peers, which would make multi-rank
//       instruction counts depend on scheduling).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#endif

#include "support/report.hpp"
#include "trellis/comm/mesh.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/shard.hpp"

using namespace trellis;
using namespace trellis::shard;

namespace {

using trellis::bench::int_flag;

// One op, both variants, on one mesh axis of `n` ranks; rows of `cols` floats, `rows` = n * k.
template <class Mesh>
struct Case {
  Mesh& mesh;
  index_t rows, cols;

  template <class From>
  Sharded<float, 2, Mesh, From> input() {
    const auto shape = local_shape<2>({rows, cols}, From::codes, mesh_sizes(mesh), mesh_coords(mesh));
    Tensor<float, 2> local(shape);
    for (index_t i = 0; i < local.size(); ++i) local.data()[i] = static_cast<float>(i % 97);
    return Sharded<float, 2, Mesh, From>::from_local(mesh, std::move(local), {rows, cols});
  }

  // Returns a checksum element so the work cannot be optimised away.
  float run(const std::string& op, bool direct, int iters, bool instrument) {
    auto& c = mesh.template comm<tp>();
    const int n = c.size();
    float sink = 0;
    if (op == "all_gather") {
      auto x = input<Placements<Shard<0>>>();
      if (instrument) CALLGRIND_START_INSTRUMENTATION;
      for (int i = 0; i < iters; ++i) {
        if (direct) {
          Tensor<float, 2> out({rows, cols});
          c.all_gather(x.local().data(), out.data(), static_cast<std::size_t>(x.local().size()));
          sink += out.data()[out.size() - 1];
        } else {
          auto y = redistribute<Replicate>(x);
          sink += y.local().data()[y.local().size() - 1];
        }
      }
      if (instrument) CALLGRIND_STOP_INSTRUMENTATION;
    } else if (op == "all_reduce") {
      auto x = input<Placements<Partial<>>>();
      if (instrument) CALLGRIND_START_INSTRUMENTATION;
      for (int i = 0; i < iters; ++i) {
        if (direct) {
          Tensor<float, 2> out({rows, cols});
          c.all_reduce(x.local().data(), out.data(), static_cast<std::size_t>(x.local().size()), ReduceOp::sum);
          sink += out.data()[out.size() - 1];
        } else {
          auto y = redistribute<Replicate>(x);
          sink += y.local().data()[y.local().size() - 1];
        }
      }
      if (instrument) CALLGRIND_STOP_INSTRUMENTATION;
    } else if (op == "reduce_scatter") {
      auto x = input<Placements<Partial<>>>();
      if (instrument) CALLGRIND_START_INSTRUMENTATION;
      for (int i = 0; i < iters; ++i) {
        if (direct) {
          Tensor<float, 2> out({rows / n, cols});
          c.reduce_scatter(x.local().data(), out.data(), static_cast<std::size_t>(out.size()), ReduceOp::sum);
          sink += out.data()[out.size() - 1];
        } else {
          auto y = redistribute<Shard<0>>(x);
          sink += y.local().data()[y.local().size() - 1];
        }
      }
      if (instrument) CALLGRIND_STOP_INSTRUMENTATION;
    } else {
      std::fprintf(stderr, "unknown op %s\n", op.c_str());
      std::exit(2);
    }
    return sink;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> ops{"all_gather", "all_reduce", "reduce_scatter"};
  if (bench::has_flag(argc, argv, "--callgrind")) {
    int at = 0;
    for (int i = 1; i < argc; ++i)
      if (std::strcmp(argv[i], "--callgrind") == 0) at = i;
    if (at + 2 >= argc) {
      std::fprintf(stderr, "usage: shard_bench --callgrind OP direct|redistribute [--elements N] [--iters K]\n");
      return 2;
    }
    const std::string op = argv[at + 1], variant = argv[at + 2];
    const long elements = static_cast<long>(int_flag(argc, argv, "--elements", 262144));
    const int iters = static_cast<int>(int_flag(argc, argv, "--iters", 4));
    float sink = 0;
    comm::ThreadWorld(1).run([&](auto& world) {
      auto mesh = make_mesh<tp>(world, {1});
      Case<decltype(mesh)> c{mesh, elements / 256, 256};
      sink = c.run(op, variant == "direct", iters, true);
    });
    std::printf("%s %s elements=%ld iters=%d checksum=%g\n", op.c_str(), variant.c_str(), elements, iters, sink);
    return 0;
  }

  const int ranks = static_cast<int>(int_flag(argc, argv, "--ranks", 2));
  bench::JsonReport report("shard_redistribute");
  std::printf("redistribute vs the bare collective, %d thread ranks, fp32 (time per call, us)\n", ranks);
  std::printf("%-15s %10s %12s %12s %12s %12s %9s\n", "op", "elements", "direct_min", "redist_min", "direct_med",
              "redist_med", "overhead");
  for (const auto& op : ops) {
    for (long elements : {4096L, 65536L, 1048576L}) {
      double t[2][2] = {};
      comm::ThreadWorld(ranks).run([&](auto& world) {
        auto mesh = make_mesh<tp>(world, {ranks});
        Case<decltype(mesh)> c{mesh, static_cast<index_t>(elements / 256 / ranks * ranks), 256};
        const int iters = elements >= 1048576 ? 20 : 200;
        // Interleaved (direct, redistribute, direct, ...) so both see the same machine load.
        std::vector<double> times[2];
        for (int i = 0; i < 5 + iters; ++i) {
          for (int v = 0; v < 2; ++v) {
            c.mesh.template comm<tp>().barrier();
            const double t0 = bench::now_seconds();
            c.run(op, v == 0, 1, false);
            if (i >= 5) times[v].push_back(bench::now_seconds() - t0);
          }
        }
        if (world.rank() == 0) {
          for (int v = 0; v < 2; ++v) {
            std::sort(times[v].begin(), times[v].end());
            t[v][0] = times[v].front();
            t[v][1] = times[v][times[v].size() / 2];
          }
        }
      });
      const double overhead = 100.0 * (t[1][0] - t[0][0]) / t[0][0];
      std::printf("%-15s %10ld %12.2f %12.2f %12.2f %12.2f %8.1f%%\n", op.c_str(), elements, t[0][0] * 1e6,
                  t[1][0] * 1e6, t[0][1] * 1e6, t[1][1] * 1e6, overhead);
      bench::Row row;
      row.add_text("op", op).add("elements", static_cast<long long>(elements)).add("ranks", static_cast<long long>(ranks));
      row.add("direct_min_us", t[0][0] * 1e6).add("redistribute_min_us", t[1][0] * 1e6);
      row.add("direct_median_us", t[0][1] * 1e6).add("redistribute_median_us", t[1][1] * 1e6);
      report.add(row);
    }
  }
  report.write(bench::json_path(argc, argv));
  return 0;
}
