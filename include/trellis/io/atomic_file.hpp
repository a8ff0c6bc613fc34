// Crash-safe file writes (POSIX): data goes to a temporary name beside the target, is fsync'd,
// renamed over the target and the directory is fsync'd, so a reader sees the old file or the
// complete new one, never a torn one. Also whole-file reads and a directory fsync.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "trellis/core/error.hpp"

namespace trellis::io {

namespace detail {
inline std::string errno_text(int err) { return std::strerror(err); }
}  // namespace detail

// Called at the named points of a multi-step write ("before rename", ...), so tests can stop a
// save there (throw, or end the process) and check what a crash at that point leaves.
using StepHook = std::function<void(std::string_view point)>;

// fsync on a directory makes a rename or a newly created entry in it durable.
inline void fsync_directory(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) TRELLIS_THROW("cannot open directory ", dir, " to fsync it: ", detail::errno_text(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) TRELLIS_THROW("fsync of directory ", dir, " failed: ", detail::errno_text(err));
}

// Writes `target` atomically: write()..., then commit(). Destroyed without commit(), the
// temporary file is removed and the target is untouched.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path target)
      : target_(std::move(target)),
        temp_(target_.string() + ".tmp." + std::to_string(::getpid())) {
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) TRELLIS_THROW("cannot create ", temp_, ": ", detail::errno_text(errno));
  }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(temp_.c_str());
    }
  }

  void write(const void* data, std::size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      ssize_t n = ::write(fd_, p, bytes);
      if (n < 0) {
        if (errno == EINTR) continue;
        TRELLIS_THROW("write to ", temp_, " failed: ", detail::errno_text(errno));
      }
      p += n;
      bytes -= static_cast<std::size_t>(n);
      written_ += static_cast<std::size_t>(n);
    }
  }
  void write(std::string_view s) { write(s.data(), s.size()); }
  std::size_t bytes_written() const { return written_; }

  // fsync the data, rename over the target, fsync the directory. `hook` (tests) is called before
  // the fsync, before the rename, after the rename and after the directory fsync.
  void commit(const StepHook& hook = {}) {
    TRELLIS_CHECK(fd_ >= 0, "AtomicFileWriter for ", target_, " committed twice");
    auto at = [&](std::string_view point) {
      if (hook) hook(point);
    };
    at("before fsync");
    if (::fsync(fd_) != 0) TRELLIS_THROW("fsync of ", temp_, " failed: ", detail::errno_text(errno));
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) {
      ::unlink(temp_.c_str());
      TRELLIS_THROW("close of ", temp_, " failed: ", detail::errno_text(errno));
    }
    at("before rename");
    if (::rename(temp_.c_str(), target_.c_str()) != 0) {
      int err = errno;
      ::unlink(temp_.c_str());
      TRELLIS_THROW("rename ", temp_, " -> ", target_, " failed: ", detail::errno_text(err));
    }
    at("after rename");
    fsync_directory(target_.has_parent_path() ? target_.parent_path() : std::filesystem::path("."));
    at("after directory fsync");
  }

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
  std::size_t written_ = 0;
};

inline void write_file_atomically(const std::filesystem::path& target, std::string_view content,
                                  const StepHook& hook = {}) {
  AtomicFileWriter w(target);
  w.write(content);
  w.commit(hook);
}

// A read-only file descriptor with positioned reads that report short reads as errors. Only
// regular files: a FIFO, socket, device or directory is refused (opened non-blocking, so a FIFO
// with no writer does not hang the open; its "size" would mean nothing anyway).
class ReadOnlyFile {
 public:
  ReadOnlyFile() = default;
  explicit ReadOnlyFile(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) TRELLIS_THROW("cannot open ", path_, ": ", detail::errno_text(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      int err = errno;
      ::close(fd_);
      fd_ = -1;
      TRELLIS_THROW("cannot stat ", path_, ": ", detail::errno_text(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      fd_ = -1;
      TRELLIS_THROW(path_, " is not a regular file (",
                    S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISDIR(st.st_mode) ? "a directory" : "a device or socket",
                    "): give a file");
    }
    const int flags = ::fcntl(fd_, F_GETFL);  // reads block as usual on the regular file
    if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
    size_ = static_cast<std::size_t>(st.st_size);
  }
  ReadOnlyFile(ReadOnlyFile&& o) noexcept
      : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), size_(o.size_) {}
  ReadOnlyFile& operator=(ReadOnlyFile&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      path_ = std::move(o.path_);
      fd_ = std::exchange(o.fd_, -1);
      size_ = o.size_;
    }
    return *this;
  }
  ~ReadOnlyFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  std::size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

  void read_at(std::size_t offset, void* out, std::size_t bytes) const {
    TRELLIS_CHECK(offset <= size_ && bytes <= size_ - offset, "read of ", bytes, " bytes at offset ",
                  offset, " runs past the end of ", path_, " (", size_, " bytes): file truncated?");
    char* p = static_cast<char*>(out);
    while (bytes > 0) {
      ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) TRELLIS_THROW("read of ", path_, " at offset ", offset, " failed: ",
                                n == 0 ? std::string("unexpected end of file") : detail::errno_text(errno));
      p += n;
      offset += static_cast<std::size_t>(n);
      bytes -= static_cast<std::size_t>(n);
    }
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::size_t size_ = 0;
};

inline std::string read_whole_file(const std::filesystem::path& path) {
  ReadOnlyFile f(path);
  std::string s(f.size(), '\0');
  if (!s.empty()) f.read_at(0, s.data(), s.size());
  return s;
}

}  // namespace trellis::io
