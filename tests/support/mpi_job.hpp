// An mpirun job started by a test: its output in a file, its exit waited for with a deadline, its
// ranks found by process id (children of mpirun whose OMPI_COMM_WORLD_RANK says which rank), and
// nothing left behind: on destruction a job still running gets SIGTERM, then SIGKILL, and every
// rank process it was seen with gets SIGKILL (a SIGSTOPped rank outlives a killed mpirun).
// Linux only (/proc).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace test_support {

// Nanoseconds of the system-wide monotonic clock (CLOCK_MONOTONIC: the same in every process of
// this machine), so a rank can print when it did something and the test can time the job from it.
inline long long monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class MpiJob {
 public:
  // Starts `argv` (argv[0]: an absolute path) with `env` added, stdout and stderr into `log`.
  MpiJob(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env,
         std::filesystem::path log)
      : log_(std::move(log)) {
    if (argv.empty()) throw std::runtime_error("MpiJob: no command");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("MpiJob: fork failed");
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd < 0) ::_exit(126);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    started_ = std::chrono::steady_clock::now();
  }

  MpiJob(const MpiJob&) = delete;
  MpiJob& operator=(const MpiJob&) = delete;

  ~MpiJob() {
    if (running()) {
      ::kill(pid_, SIGTERM);
      if (!wait_for(std::chrono::seconds(5))) {
        ::kill(pid_, SIGKILL);
        wait_for(std::chrono::seconds(5));
      }
    }
    for (const auto& [rank, pid] : ranks_seen_)
      if (::kill(pid, 0) == 0) ::kill(pid, SIGKILL);  // ours: a rank of this job
  }

  pid_t pid() const { return pid_; }
  bool running() const { return !status_; }

  // Waits up to `limit` for mpirun to exit; true if it did. Ranks seen meanwhile are remembered.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!status_) {
      ranks();
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        status_ = status;
        exited_ns_ = monotonic_ns();
        break;
      }
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }

  // mpirun's exit code (128 + signal if a signal ended it); only once it has exited.
  int exit_code() const {
    if (!status_) throw std::runtime_error("MpiJob: still running");
    return WIFEXITED(*status_) ? WEXITSTATUS(*status_) : 128 + WTERMSIG(*status_);
  }
  // When mpirun exited (monotonic_ns), and seconds since start.
  long long exited_ns() const { return exited_ns_; }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  }

  std::string output() const {
    std::ifstream in(log_);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
  }

  // The rank processes now alive (children of mpirun), by world rank.
  std::map<int, pid_t> ranks() {
    std::map<int, pid_t> now;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
      const std::string name = entry.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(entry.path() / "stat");
      std::string line;
      std::getline(stat, line);
      const auto close = line.rfind(')');  // "pid (comm) state ppid ..."
      if (close == std::string::npos) continue;
      std::istringstream rest(line.substr(close + 1));
      char state = 0;
      long ppid = 0;
      rest >> state >> ppid;
      if (ppid != pid_) continue;
      std::ifstream environ(entry.path() / "environ");
      std::string var;
      while (std::getline(environ, var, '\0')) {
        if (var.rfind("OMPI_COMM_WORLD_RANK=", 0) == 0) {
          const int rank = std::atoi(var.c_str() + 21);
          const auto pid = static_cast<pid_t>(std::atol(name.c_str()));
          now[rank] = pid;
          ranks_seen_[rank] = pid;
        }
      }
    }
    return now;
  }

  // True once the process that was rank `rank` has ended (gone, or a zombie left for its new
  // parent to reap), waiting up to `limit`: mpirun may exit a moment before its last rank does.
  template <class Rep, class Period>
  bool rank_ended_within(int rank, std::chrono::duration<Rep, Period> limit) const {
    const auto it = ranks_seen_.find(rank);
    if (it == ranks_seen_.end()) return false;  // never seen: cannot tell
    const auto until = std::chrono::steady_clock::now() + limit;
    for (;;) {
      std::ifstream stat("/proc/" + std::to_string(it->second) + "/stat");
      std::string line;
      if (!std::getline(stat, line)) return true;
      const auto close = line.rfind(')');
      if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z') return true;
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

 private:
  std::filesystem::path log_;
  pid_t pid_ = -1;
  std::optional<int> status_;
  long long exited_ns_ = 0;
  std::chrono::steady_clock::time_point started_;
  std::map<int, pid_t> ranks_seen_;
};

// Counts the (non-overlapping) occurrences of `what` in `text`.
inline int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

}  // namespace test_support
