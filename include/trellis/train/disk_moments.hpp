// train::DiskMoments: AdamW moments in a file (the disk tier of ZeRO-Infinity's optimizer offload),
// for state larger than host memory. One file per owner, created under `dir` with a unique name
// and unlinked at once: it is scratch for a running trainer, never a checkpoint (checkpoints are
// written by Trainer::save as always), and nothing is left behind by a crash. Its whole size
// (m then v, fp32) is written with zeros at construction, so a full disk, an unwritable directory
// or a size over the cap (a simulated full disk for tests) is an error before the first step,
// (the directory is created if missing)
// naming the directory and the bytes. Reads and writes are pread/pwrite of element ranges; every
// short or failed call is an error naming the file's directory, the range and errno.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"

namespace trellis::train {

class DiskMoments {
 public:
  DiskMoments() = default;
  // sizes: elements of each tensor; cap_bytes: 0 none, else the most bytes the file may take.
  DiskMoments(const std::filesystem::path& dir, std::span<const index_t> sizes, std::uint64_t cap_bytes) : dir_(dir) {
    for (index_t n : sizes) {
      offsets_.push_back(total_);
      sizes_.push_back(static_cast<std::size_t>(n));
      total_ += static_cast<std::size_t>(n);
    }
    const std::uint64_t bytes = 2ull * total_ * sizeof(float);
    TRELLIS_CHECK(cap_bytes == 0 || bytes <= cap_bytes, "optimizer disk tier (", dir.string(), "): the AdamW moments need ",
                  bytes, " bytes, more than the ", cap_bytes, " bytes the directory may take (no space left)");
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    TRELLIS_CHECK(std::filesystem::is_directory(dir, ec), "optimizer disk tier: ", dir.string(),
                  " is not a directory and cannot be created (give a writable one)");
    std::string name = (dir / "trellis-moments-XXXXXX").string();
    std::vector<char> buf(name.begin(), name.end());
    buf.push_back('\0');
    fd_ = ::mkstemp(buf.data());
    TRELLIS_CHECK(fd_ >= 0, "optimizer disk tier: cannot create a file in ", dir.string(), ": ", std::strerror(errno));
    ::unlink(buf.data());  // scratch: gone when closed, whatever happens to the process
    zero();  // the whole size written now: a full disk shows here, before the first step
  }
  DiskMoments(DiskMoments&& o) noexcept { *this = std::move(o); }
  DiskMoments& operator=(DiskMoments&& o) noexcept {
    if (this != &o) {
      close();
      dir_ = std::move(o.dir_);
      offsets_ = std::move(o.offsets_);
      sizes_ = std::move(o.sizes_);
      total_ = o.total_;
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  DiskMoments(const DiskMoments&) = delete;
  DiskMoments& operator=(const DiskMoments&) = delete;
  ~DiskMoments() { close(); }

  std::size_t tensors() const { return sizes_.size(); }
  std::size_t size(std::size_t i) const { return sizes_.at(i); }
  std::uint64_t bytes() const { return 2ull * total_ * sizeof(float); }
  const std::filesystem::path& dir() const { return dir_; }

  // Elements [at, at + n) of tensor i's m (or v) to / from host memory.
  void read(std::size_t i, bool m, std::size_t at, std::size_t n, float* dst) const {
    pread_all(dst, n, element(i, m, at, n));
  }
  void write(std::size_t i, bool m, std::size_t at, std::size_t n, const float* src) {
    pwrite_all(src, n, element(i, m, at, n));
  }
  // Every moment zero.
  void zero() {
    std::vector<float> zeros(std::min<std::size_t>(2 * total_, std::size_t{1} << 20), 0.0f);
    for (std::size_t at = 0; at < 2 * total_; at += zeros.size())
      pwrite_all(zeros.data(), std::min(zeros.size(), 2 * total_ - at), at);
  }

 private:
  std::size_t element(std::size_t i, bool m, std::size_t at, std::size_t n) const {
    TRELLIS_CHECK(i < sizes_.size() && at + n <= sizes_[i], "optimizer disk tier: elements [", at, ", ", at + n,
                  ") of tensor ", i, " (", i < sizes_.size() ? sizes_[i] : 0, " elements, ", sizes_.size(), " tensors)");
    return (m ? 0 : total_) + offsets_[i] + at;
  }
  void pwrite_all(const float* src, std::size_t n, std::size_t element) {
    const char* p = reinterpret_cast<const char*>(src);
    std::size_t left = n * sizeof(float);
    auto off = static_cast<off_t>(element * sizeof(float));
    while (left > 0) {
      const ssize_t w = ::pwrite(fd_, p, left, off);
      if (w < 0 && errno == EINTR) continue;
      TRELLIS_CHECK(w > 0, "optimizer disk tier (", dir_.string(), "): writing ", left, " bytes at ", off,
                    " failed: ", w < 0 ? std::strerror(errno) : "nothing written (disk full?)");
      p += w;
      left -= static_cast<std::size_t>(w);
      off += w;
    }
  }
  void pread_all(float* dst, std::size_t n, std::size_t element) const {
    char* p = reinterpret_cast<char*>(dst);
    std::size_t left = n * sizeof(float);
    auto off = static_cast<off_t>(element * sizeof(float));
    while (left > 0) {
      const ssize_t r = ::pread(fd_, p, left, off);
      if (r < 0 && errno == EINTR) continue;
      TRELLIS_CHECK(r > 0, "optimizer disk tier (", dir_.string(), "): reading ", left, " bytes at ", off,
                    " failed: ", r < 0 ? std::strerror(errno) : "end of file");
      p += r;
      left -= static_cast<std::size_t>(r);
      off += r;
    }
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  std::filesystem::path dir_;
  std::vector<std::size_t> offsets_, sizes_;
  std::size_t total_ = 0;
  int fd_ = -1;
};

}  // namespace trellis::train
