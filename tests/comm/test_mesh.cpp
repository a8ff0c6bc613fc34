// Device meshes over the thread backend: coordinates, sub-communicators along one or several
// axes (checked by reducing world ranks over each group and comparing with the members computed
// here from the row-major rule), and size errors.
#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "trellis/comm/mesh.hpp"
#include "trellis/comm/threads.hpp"

using trellis::Error;
using trellis::comm::ReduceOp;
using trellis::comm::ThreadComm;
using trellis::comm::ThreadWorld;
using trellis::dp;
using trellis::pp;
using trellis::tp;

namespace {
struct replica {};  // a user-defined axis without a name
struct expert { static constexpr const char* name = "expert"; };

// The world ranks sharing `rank`'s coordinates except along the axes in `varying` (row-major
// over `shape`), in key order (row-major over `varying` in the order given).
std::vector<int> expected_members(const std::vector<int>& shape, int rank, const std::vector<int>& varying) {
  const int nd = static_cast<int>(shape.size());
  auto coords_of = [&](int r) {
    std::vector<int> c(nd);
    for (int i = nd - 1; i >= 0; --i) {
      c[i] = r % shape[i];
      r /= shape[i];
    }
    return c;
  };
  int total = 1;
  for (int s : shape) total *= s;
  auto mine = coords_of(rank);
  std::vector<std::pair<int, int>> members;  // (key, rank)
  for (int r = 0; r < total; ++r) {
    auto c = coords_of(r);
    bool same = true;
    for (int i = 0; i < nd; ++i) {
      bool is_varying = std::find(varying.begin(), varying.end(), i) != varying.end();
      if (!is_varying && c[i] != mine[i]) same = false;
    }
    if (!same) continue;
    int key = 0;
    for (int a : varying) key = key * shape[a] + c[a];
    members.emplace_back(key, r);
  }
  std::sort(members.begin(), members.end());
  std::vector<int> out;
  for (auto& m : members) out.push_back(m.second);
  return out;
}

template <class Comm>
std::vector<int> gather_world_ranks(Comm& sub, int world_rank) {
  std::vector<int> all(static_cast<std::size_t>(sub.size()));
  sub.all_gather(&world_rank, all.data(), 1);
  return all;
}
}  // namespace

TEST_CASE("3-D mesh: coordinates are row-major and sub-communicators hold the right ranks", "[comm][mesh]") {
  std::mutex mutex;
  std::vector<std::string> failures;
  ThreadWorld(8).run([&](ThreadComm& comm) {
    auto mesh = trellis::make_mesh<pp, dp, tp>(comm, {2, 2, 2});
    const int r = comm.rank();
    std::vector<std::string> local;
    auto expect = [&](bool ok, const std::string& what) {
      if (!ok) local.push_back("rank " + std::to_string(r) + ": " + what);
    };
    expect(mesh.coord<pp>() == r / 4 && mesh.coord<dp>() == (r / 2) % 2 && mesh.coord<tp>() == r % 2, "coordinates");
    expect(mesh.size<pp>() == 2 && mesh.size<dp>() == 2 && mesh.size<tp>() == 2 && mesh.size() == 8, "sizes");
    expect(mesh.rank_of(mesh.coords()) == r, "rank_of(coords)");
    expect(mesh.coords_of(5) == std::array<int, 3>{1, 0, 1}, "coords_of(5)");
    const std::vector<int> shape{2, 2, 2};
    expect(gather_world_ranks(mesh.comm<tp>(), r) == expected_members(shape, r, {2}), "comm<tp> members");
    expect(gather_world_ranks(mesh.comm<dp>(), r) == expected_members(shape, r, {1}), "comm<dp> members");
    expect(gather_world_ranks(mesh.comm<pp>(), r) == expected_members(shape, r, {0}), "comm<pp> members");
    expect(mesh.comm<tp>().rank() == mesh.coord<tp>(), "rank in comm<tp> equals coord<tp>");
    auto& dptp = mesh.comm<dp, tp>();
    expect(dptp.size() == 4 && gather_world_ranks(dptp, r) == expected_members(shape, r, {1, 2}), "comm<dp, tp>");
    auto& tpdp = mesh.comm<tp, dp>();
    expect(gather_world_ranks(tpdp, r) == expected_members(shape, r, {2, 1}), "comm<tp, dp> (tp-major order)");
    expect(&mesh.comm<dp, tp>() == &dptp, "sub-communicators are cached");
    auto& all = mesh.comm<pp, dp, tp>();
    expect(all.size() == 8 && all.rank() == r, "all axes = the world");
    // Reductions along one axis: sum of world ranks over the tp group.
    int mine = r, sum = 0;
    mesh.comm<tp>().all_reduce(&mine, &sum, 1, ReduceOp::sum);
    expect(sum == 2 * (r - r % 2) + 1, "all_reduce over tp");
    std::lock_guard lock(mutex);
    failures.insert(failures.end(), local.begin(), local.end());
  });
  for (auto& f : failures) UNSCOPED_INFO(f);
  CHECK(failures.empty());
}

TEST_CASE("meshes of other shapes, user-defined axes", "[comm][mesh]") {
  std::atomic<int> wrong{0};
  ThreadWorld(6).run([&](ThreadComm& comm) {
    auto mesh = trellis::make_mesh<replica, expert>(comm, {3, 2});
    const int r = comm.rank();
    if (mesh.coord<replica>() != r / 2 || mesh.coord<expert>() != r % 2) ++wrong;
    if (gather_world_ranks(mesh.comm<replica>(), r) != expected_members({3, 2}, r, {0})) ++wrong;
    if (gather_world_ranks(mesh.comm<expert>(), r) != expected_members({3, 2}, r, {1})) ++wrong;
    auto line = trellis::make_mesh<dp>(comm, {6});
    if (line.coord<dp>() != r || line.comm<dp>().size() != 6) ++wrong;
    auto degenerate = trellis::make_mesh<pp, dp, tp>(comm, {1, 6, 1});
    if (degenerate.comm<tp>().size() != 1 || degenerate.comm<dp>().rank() != r) ++wrong;
  });
  CHECK(wrong.load() == 0);
}

TEST_CASE("a mesh whose sizes do not multiply to the rank count is an Error", "[comm][mesh]") {
  std::atomic<int> errors{0};
  std::mutex mutex;
  std::string message;
  ThreadWorld(4).run([&](ThreadComm& comm) {
    try {
      auto mesh = trellis::make_mesh<pp, dp, tp>(comm, {2, 2, 2});
    } catch (const Error& e) {
      ++errors;
      std::lock_guard lock(mutex);
      message = e.what();
    }
    try {
      auto mesh = trellis::make_mesh<dp, tp>(comm, {0, 4});
    } catch (const Error&) {
      ++errors;
    }
  });
  CHECK(errors.load() == 8);
  CHECK(message.find("make_mesh<pp, dp, tp>: sizes 2 x 2 x 2 = 8 but the communicator has 4 ranks") != std::string::npos);
}
