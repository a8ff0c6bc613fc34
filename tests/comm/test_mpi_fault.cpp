// Faults under mpirun, as a user meets them: a rank stopped (SIGSTOP), killed (SIGKILL) or throwing
// mid-collective, a rank stopped instead of constructing a communicator (its MPI_Comm_dup) or
// inside split (its MPI_Comm_split), a timeout caught and ignored, and train_gpt with a rank
// stopped mid-training.
// Each case starts a 2-process mpirun job (tests/support/mpi_job.hpp) and requires: the job ends
// on its own, non-zero, within the communication timeout plus a few seconds of the fault; the
// output holds one clear error naming the operation, the ranks and the timeout (or the injected
// error, or mpirun's report of the signal); no rank crashed (no segfault report) or was left
// behind. Paths come from the environment ctest sets: TRELLIS_MPIEXEC, TRELLIS_FAULT_WORKER,
// TRELLIS_TRAIN_GPT ([.train_gpt] only).
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "support/mpi_job.hpp"
#include "train/temp_dir.hpp"

using namespace std::chrono_literals;
using test_support::count_of;
using test_support::MpiJob;

namespace {

std::string env_path(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) FAIL(name << " is not set: run this test through ctest (it names the programs to start)");
  return v;
}

std::vector<std::string> mpirun(int np) {
  return {env_path("TRELLIS_MPIEXEC"), "-np", std::to_string(np), "--oversubscribe", "--allow-run-as-root",
          "--mca", "btl", "self,vader", "--bind-to", "none"};
}

const std::vector<std::pair<std::string, std::string>> kRootEnv = {
    {"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
    {"OMPI_MCA_rmaps_base_oversubscribe", "1"}};

// Seconds from the `fault <scenario> at <ns>` line a rank printed to mpirun's exit.
double seconds_after_fault(const MpiJob& job, const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("fault [a-z_]+ at ([0-9]+) ns"))) return -1;
  return static_cast<double>(job.exited_ns() - std::stoll(m[1].str())) * 1e-9;
}

// Runs the worker with `scenario` on 2 ranks and waits for the job (at most `limit`).
struct WorkerRun {
  TempDir dir{"mpi-fault"};
  MpiJob job;
  bool ended;
  std::string out;
  WorkerRun(const std::string& scenario, int timeout_ms, std::chrono::seconds limit)
      : job(
            [&] {
              auto argv = mpirun(2);
              argv.push_back(env_path("TRELLIS_FAULT_WORKER"));
              argv.push_back(scenario);
              return argv;
            }(),
            [&] {
              auto env = kRootEnv;
              env.emplace_back("TRELLIS_COMM_TIMEOUT_MS", std::to_string(timeout_ms));
              return env;
            }(),
            dir.path / "out.txt"),
        ended(job.wait_for(limit)),
        out(job.output()) {}
};

void check_no_crash(const std::string& out) {
  CHECK(out.find("Segmentation fault") == std::string::npos);
  CHECK(out.find("AddressSanitizer") == std::string::npos);
  CHECK(out.find("terminate called") == std::string::npos);
}

}  // namespace

TEST_CASE("without a fault the worker job finishes and exits 0", "[mpi_fault][none]") {
  WorkerRun run("none", 3000, 20s);
  INFO(run.out);
  REQUIRE(run.ended);
  CHECK(run.job.exit_code() == 0);
  CHECK(count_of(run.out, ": done") == 2);
}

namespace {

// A job whose rank 1 stopped (SIGSTOP) while rank 0 waited in a collective with a 2 s timeout:
// it ends on its own, non-zero, after the timeout and within a few seconds more, with one error
// from rank 0 (`error`, naming the call) and the abort.
void check_stopped_job(const WorkerRun& run, const std::string& error) {
  REQUIRE(run.ended);
  const double after = seconds_after_fault(run.job, run.out);
  INFO("mpirun exited " << after << " s after rank 1 stopped");
  CHECK(run.job.exit_code() != 0);
  CHECK(after > 2.0 - 0.5);  // rank 0 waited the timeout (from its own wait, which may start first)
  CHECK(after < 2.0 + 5.0);
  CHECK(count_of(run.out, "trellis: [rank 0]") == 1);
  CHECK(run.out.find(error) != std::string::npos);
  CHECK(run.out.find("MPI_Abort") != std::string::npos);
  check_no_crash(run.out);
}

}  // namespace

TEST_CASE("a rank stopped mid-collective: the other names it and the job ends within the timeout",
          "[mpi_fault][stop]") {
  WorkerRun run("stop", 2000, 20s);
  INFO(run.out);
  check_stopped_job(run, "trellis: [rank 0] #3 all_reduce(float, count=1048576, op=sum) timed out after 2000 ms on "
                         "rank 0 of 2 of communicator 'world': rank 1 did not arrive");
  CHECK(run.job.rank_ended_within(1, 3s));
}

TEST_CASE("a rank stopped instead of constructing a communicator: the dup times out and the job ends",
          "[mpi_fault][stop]") {
  WorkerRun run("late_dup", 2000, 20s);
  INFO(run.out);
  check_stopped_job(run, "trellis: [rank 0] MPI_Comm_dup of communicator 'second' (collective over 2 ranks) timed "
                         "out after 2000 ms on rank 0: a rank did not arrive");
  CHECK(run.out.find("FAILED") == std::string::npos);
}

TEST_CASE("a rank stopped inside split, after the gather: the others' MPI_Comm_split ends the job",
          "[mpi_fault][stop_in_split]") {
  WorkerRun run("stop_in_split", 2000, 20s);
  INFO(run.out);
  // No arrival query (MPI_Comm_split blocks): the job ends within about the timeout of the stop.
  check_stopped_job(run, "trellis: [rank 0] MPI_Comm_split of split(0) timed out after 2000 ms on rank 0 of 2 of "
                         "communicator 'world': a rank stopped or died after the colors were gathered");
  CHECK(seconds_after_fault(run.job, run.out) < 2.0 + 3.0);
  CHECK(run.out.find("FAILED") == std::string::npos);
  CHECK(run.job.rank_ended_within(1, 3s));
}

TEST_CASE("a rank killed mid-collective: the job ends at once, naming it", "[mpi_fault][kill]") {
  WorkerRun run("kill", 2000, 20s);
  INFO(run.out);
  REQUIRE(run.ended);
  const double after = seconds_after_fault(run.job, run.out);
  INFO("mpirun exited " << after << " s after rank 1 was killed");
  CHECK(run.job.exit_code() != 0);
  CHECK(after >= 0);
  CHECK(after < 2.0 + 5.0);
  CHECK(run.out.find("rank 1") != std::string::npos);
  CHECK(run.out.find("signal 9") != std::string::npos);  // mpirun's report
  check_no_crash(run.out);
}

TEST_CASE("a rank that throws ends the job at once with its error, without waiting for the timeout",
          "[mpi_fault][throw]") {
  // A 20 s timeout: the job must end long before it, on the throwing rank's abort.
  WorkerRun run("throw", 20000, 15s);
  INFO(run.out);
  REQUIRE(run.ended);
  const double after = seconds_after_fault(run.job, run.out);
  INFO("mpirun exited " << after << " s after rank 1 threw");
  CHECK(run.job.exit_code() != 0);
  CHECK(after >= 0);
  CHECK(after < 5.0);
  CHECK(count_of(run.out, "trellis: [rank 1] injected fault at step 3") == 1);
  CHECK(run.out.find("timed out") == std::string::npos);  // nobody waited for the timeout
  check_no_crash(run.out);
}

TEST_CASE("a timeout caught inside run(): MpiWorld ends the job instead of finalising", "[mpi_fault][caught]") {
  WorkerRun run("caught", 2000, 20s);
  INFO(run.out);
  REQUIRE(run.ended);
  const double after = seconds_after_fault(run.job, run.out);
  INFO("mpirun exited " << after << " s after rank 1 left without joining");
  CHECK(run.job.exit_code() != 0);
  CHECK(after < 2.0 + 5.0);
  CHECK(run.out.find("rank 0: caught: trellis: [rank 0] #0 all_reduce(float, count=1048576, op=sum) timed out after "
                     "2000 ms") != std::string::npos);
  CHECK(run.out.find("rank 1 did not arrive") != std::string::npos);
  // Said once, before the abort: why MPI is not finalised.
  CHECK(count_of(run.out, "not finalising MPI") == 1);
  check_no_crash(run.out);
}

TEST_CASE("train_gpt --mpi with a rank stopped mid-training exits within the timeout naming it",
          "[.train_gpt]") {
  TempDir dir("train-gpt-stop");
  auto argv = mpirun(2);
  argv.push_back(env_path("TRELLIS_TRAIN_GPT"));
  for (const char* a : {"--mpi", "--dp", "2", "--layers", "1", "--width", "32", "--heads", "2", "--context", "16",
                        "--batch", "4", "--steps", "100000", "--eval-every", "100000", "--peak-gflops", "10",
                        "--log", "", "--sample-tokens", "0"})
    argv.emplace_back(a);
  argv.emplace_back("--ckpt-dir");
  argv.push_back((dir.path / "ck").string());
  auto env = kRootEnv;
  env.emplace_back("TRELLIS_COMM_TIMEOUT_MS", "2000");
  MpiJob job(argv, env, dir.path / "out.txt");
  // Let it train a few steps (the lead rank's progress line says `<step>/100000`), then stop rank 1.
  const std::regex progress("([0-9]+)/100000");
  int step = 0;
  for (auto until = std::chrono::steady_clock::now() + 30s; step < 5 && std::chrono::steady_clock::now() < until;) {
    REQUIRE_FALSE(job.wait_for(100ms));  // it must not end by itself
    const std::string out = job.output();
    for (std::sregex_iterator it(out.begin(), out.end(), progress), end; it != end; ++it)
      step = std::max(step, std::stoi((*it)[1].str()));
  }
  INFO(job.output());
  REQUIRE(step >= 5);
  const auto ranks = job.ranks();
  REQUIRE(ranks.count(1) == 1);
  const long long stopped_ns = test_support::monotonic_ns();
  REQUIRE(::kill(ranks.at(1), SIGSTOP) == 0);
  const bool ended = job.wait_for(20s);
  const std::string out = job.output();
  INFO(out);
  REQUIRE(ended);
  const double after = static_cast<double>(job.exited_ns() - stopped_ns) * 1e-9;
  INFO("mpirun exited " << after << " s after rank 1 was stopped");
  CHECK(job.exit_code() != 0);
  CHECK(after > 2.0 - 0.5);
  CHECK(after < 2.0 + 5.0);
  CHECK(count_of(out, "trellis: [rank 0]") == 1);
  CHECK(std::regex_search(out, std::regex(R"(trellis: \[rank 0\] #[0-9]+ [a-z_]+\(.*\) timed out after 2000 ms )"
                                          R"(on rank 0 of 2 of communicator '[^']+': rank 1 did not arrive)")));
  check_no_crash(out);
  CHECK(job.rank_ended_within(1, 3s));
}
