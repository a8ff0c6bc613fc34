// train::DiskMoments: AdamW moments in a file (the disk tier of ZeRO-Infinity's optimizer offload),
// for state larger than host memory. One file per owner, created under `dir` with a unique name
// and unlinked at once: it is scratch for a running trainer, never a checkpoint (checkpoints are
// written by Trainer::save as always), and nothing is left behind by a crash. Its whole size
// (m then v, fp32) is written with zeros at construction, so a full disk, an unwritable directory
// or a size over the cap (a simulated full disk for tests) is an error before the first step,
// (the directory is created if missing)
// naming the directory and the bytes. Reads and writes are pread/pwrite of element ranges; every
// short or failed call is an error naming the file's directory, the range and errno.
// The file holds the tensors in order (all m, then all v), so consecutive tensors are adjacent:
// a chunk may run on from one tensor into the next ones (a coalesced chunk: a layer's biases and
// norms in one read and one write of m and v each, not one tiny transfer and thread hand-off
// apiece; OptimizerState builds them).
// An update streams chunks (stream()): each chunk's moments read into host buffers, the caller's
// function run on them, the moments written back. Read ahead by `readahead` = D chunks (>= 1;
// TrainerConfig::offload_disk_readahead, default 2), an I/O thread of this object (a
// train::UpdateWorker: jobs in order) reads chunks j+1 .. j+D and writes chunk j-1 back while
// the caller's thread updates chunk j, in a ring of D + 1 buffers of moments (the read of j+D
// goes into chunk j-1's buffer, whose write was queued before it, and one thread runs them in
// order). The reads run one after another on that thread; D bounds how far ahead of the updates
// they may run, so a slow read (or a long update) is absorbed by the chunks already read.
// An I/O error on that thread is rethrown on the caller's at its next wait (the read it waits
// for, or the end of the stream), the same Error, with the caller's rank; the stream then waits
// for every job it queued before it throws, so nothing runs behind the caller's back, and the
// thread is joined on destruction. Synchronous (readahead 0): the same calls, in turn, on the
// caller's thread, in one buffer of moments.
// Test and bench seam (set_probe): a function called before each streamed read and write (on the
// thread doing it) and before each chunk's update (on the caller's), which may block or sleep
// (tests: a rendezvous proving the overlap; benches: a simulated slow disk) or return an errno
// that fails the read or write as if pread/pwrite had (tests: an I/O error on the I/O thread).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/train/update_worker.hpp"

namespace trellis::train {

// One chunk of a stream: n elements of the moments from element `at` of tensor `tensor` on, in the
// file's order: within that tensor, or (coalesced, `tensors` > 1) running on through the tensors
// after it, up to tensor `tensor + tensors - 1`. One contiguous range of the file for m and one for v.
struct DiskChunk {
  std::size_t tensor = 0, at = 0, n = 0, tensors = 1;
};

// What the probe (DiskMoments::set_probe, a test and bench seam) is told.
struct DiskEvent {
  enum class Kind { read, write, update };
  Kind kind = Kind::read;
  std::uint64_t chunk = 0;    // the chunk's number among all this object has streamed (0, 1, ...)
  bool first = false, last = false;  // the first / the last chunk of its stream
  DiskChunk range;            // its tensor and elements (a read or write: m and v both)
};
// Returns 0, or (a read or write) an errno that fails the call as if pread/pwrite had failed.
using DiskProbe = std::function<int(const DiskEvent&)>;

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
      fd_ = std::exchange(o.fd_, -1);
      m_ = std::move(o.m_);
      v_ = std::move(o.v_);
      probe_ = std::move(o.probe_);
      streamed_ = o.streamed_;
      io_ = std::move(o.io_);  // idle: a stream waits for its jobs before it returns
    }
    return *this;
  }
  DiskMoments(const DiskMoments&) = delete;
  DiskMoments& operator=(const DiskMoments&) = delete;
  ~DiskMoments() { close(); }

  std::size_t tensors() const { return sizes_.size(); }
  std::size_t size(std::size_t i) const { return sizes_.at(i); }
  // Tensor i's first element in the file's order (m's; v's is total elements later).
  std::size_t offset(std::size_t i) const { return offsets_.at(i); }
  std::uint64_t bytes() const { return 2ull * total_ * sizeof(float); }
  const std::filesystem::path& dir() const { return dir_; }
  // The host buffers of moments streams used: one chunk's m and v, (readahead + 1) times when
  // read ahead (the most chunks and the largest chunk streamed so far).
  std::size_t buffer_bytes() const {
    std::size_t n = 0;
    for (std::size_t s = 0; s < m_.size(); ++s) n += m_[s].size() + v_[s].size();
    return n * sizeof(float);
  }
  // Sizes the buffers ahead of the first stream: `buffers` of m and v of `elements` each (an
  // owner that knows its largest chunk and read-ahead, so a memory report counts them at start).
  void reserve_buffers(std::size_t buffers, std::size_t elements) {
    if (m_.size() < buffers) m_.resize(buffers), v_.resize(buffers);
    for (std::size_t s = 0; s < buffers; ++s)
      for (auto* b : {&m_[s], &v_[s]}) b->resize(std::max(b->size(), elements));
  }
  // The test and bench seam (see the file's header); set it while no stream runs. Called on the
  // I/O thread and the caller's at once when prefetched: it must be thread-safe.
  void set_probe(DiskProbe probe) { probe_ = std::move(probe); }
  // Chunks streamed so far (the next chunk's number in DiskEvent::chunk).
  std::uint64_t chunks_streamed() const { return streamed_; }

  // Elements [at, at + n) of tensor i's m (or v) to / from host memory (checkpoints; synchronous).
  void read(std::size_t i, bool m, std::size_t at, std::size_t n, float* dst) const {
    pread_all(dst, n, element(i, m, at, n), {i, m, at});
  }
  void write(std::size_t i, bool m, std::size_t at, std::size_t n, const float* src) {
    pwrite_all(src, n, element(i, m, at, n), {i, m, at});
  }
  // Every moment zero.
  void zero() {
    std::vector<float> zeros(std::min<std::size_t>(2 * total_, std::size_t{1} << 20), 0.0f);
    for (std::size_t at = 0; at < 2 * total_; at += zeros.size())
      pwrite_all(zeros.data(), std::min(zeros.size(), 2 * total_ - at), at, {});
  }

  // Streams `chunks` in order: each chunk's moments read into a host buffer, fn(j, m, v) run on the
  // calling thread (m and v: chunk j's n elements, updated in place), the moments written back.
  // readahead D > 0: chunks j + 1 .. j + D read and chunk j - 1 written on the I/O thread while fn
  // runs on chunk j; an error on either thread is thrown here once every job queued has finished.
  // 0: synchronous, on the calling thread.
  template <class Fn>
  void stream(std::span<const DiskChunk> chunks, std::size_t readahead, Fn&& fn) {
    if (chunks.empty()) return;
    std::size_t c = 0;
    for (const DiskChunk& ch : chunks) {
      (void)element(ch, true);  // checks the range
      c = std::max(c, ch.n);
    }
    const std::size_t ring = readahead + 1;  // buffers: the chunk updating and the D read ahead
    reserve_buffers(ring, c);
    const bool prefetch = readahead > 0;
    const std::uint64_t base = std::exchange(streamed_, streamed_ + chunks.size());
    auto event = [&](DiskEvent::Kind k, std::size_t j) {
      return DiskEvent{k, base + j, j == 0, j + 1 == chunks.size(), chunks[j]};
    };
    using K = DiskEvent::Kind;
    if (!prefetch) {
      for (std::size_t j = 0; j < chunks.size(); ++j) {
        read_chunk(event(K::read, j), m_[0].data(), v_[0].data());
        if (probe_) probe_(event(K::update, j));
        fn(j, m_[0].data(), v_[0].data());
        write_chunk(event(K::write, j), m_[0].data(), v_[0].data());
      }
      return;
    }
    if (!io_) io_ = std::make_unique<UpdateWorker>();
    UpdateWorker& io = *io_;
    const int rank = current_rank();  // the I/O thread's errors name the caller's rank
    auto submit = [&](K k, std::size_t j) {
      return io.submit([this, rank, e = event(k, j), m = m_[j % ring].data(), v = v_[j % ring].data()] {
        RankScope scope(rank);
        e.kind == K::read ? read_chunk(e, m, v) : write_chunk(e, m, v);
      });
    };
    try {
      std::vector<std::size_t> read_job(chunks.size());  // each chunk's read, to wait for
      for (std::size_t j = 0; j < std::min(readahead, chunks.size()); ++j) read_job[j] = submit(K::read, j);
      std::size_t last = 0;
      for (std::size_t j = 0; j < chunks.size(); ++j) {
        io.wait(read_job[j]);  // chunk j's moments are in (a job's error before it: rethrown here)
        // Into the buffers of chunk j - 1, whose write was queued before: the thread runs it first.
        if (j + readahead < chunks.size()) read_job[j + readahead] = submit(K::read, j + readahead);
        if (probe_) probe_(event(K::update, j));
        fn(j, m_[j % ring].data(), v_[j % ring].data());
        last = submit(K::write, j);
      }
      io.wait(last);  // the last write: in the file before the update returns
    } catch (...) {
      // Nothing left running behind the caller (the buffers are this object's; the next stream,
      // a checkpoint read or the destructor follows), then the first error goes on.
      const std::size_t jobs = io.submitted();
      for (bool done = jobs == 0; !done;) {
        try {
          io.wait(jobs - 1);
          done = true;
        } catch (...) {  // a later job's error: the first one is being thrown
        }
      }
      throw;
    }
  }

 private:
  // A range's place for error messages (tensor npos: no tensor's, the whole file's zeros).
  struct Where {
    std::size_t tensor = static_cast<std::size_t>(-1);
    bool m = true;
    std::size_t at = 0;
  };
  std::size_t element(std::size_t i, bool m, std::size_t at, std::size_t n) const {
    TRELLIS_CHECK(i < sizes_.size() && at + n <= sizes_[i], "optimizer disk tier: elements [", at, ", ", at + n,
                  ") of tensor ", i, " (", i < sizes_.size() ? sizes_[i] : 0, " elements, ", sizes_.size(), " tensors)");
    return (m ? 0 : total_) + offsets_[i] + at;
  }
  // A streamed chunk's first element: its range must start in its first tensor and end in its last.
  std::size_t element(const DiskChunk& c, bool m) const {
    const std::size_t last = c.tensor + c.tensors - 1;
    const bool ok = c.tensors >= 1 && last < sizes_.size() && c.at + c.n <= offsets_[last] + sizes_[last] - offsets_[c.tensor] &&
                    (c.tensors == 1 || (c.at < sizes_[c.tensor] && c.at + c.n > offsets_[last] - offsets_[c.tensor]));
    TRELLIS_CHECK(ok, "optimizer disk tier: a chunk of ", c.n, " elements from element ", c.at, " of tensor ", c.tensor,
                  " over ", c.tensors, " tensors (", sizes_.size(), " tensors)");
    return (m ? 0 : total_) + offsets_[c.tensor] + c.at;
  }
  // A streamed chunk's m and v, the probe asked first (an errno it returns fails the call).
  void read_chunk(const DiskEvent& e, float* m, float* v) const {
    const int injected = probe_ ? probe_(e) : 0;
    const DiskChunk& r = e.range;
    pread_all(m, r.n, element(r, true), {r.tensor, true, r.at}, injected);
    pread_all(v, r.n, element(r, false), {r.tensor, false, r.at});
  }
  void write_chunk(const DiskEvent& e, const float* m, const float* v) {
    const int injected = probe_ ? probe_(e) : 0;
    const DiskChunk& r = e.range;
    pwrite_all(m, r.n, element(r, true), {r.tensor, true, r.at}, injected);
    pwrite_all(v, r.n, element(r, false), {r.tensor, false, r.at});
  }
  // One tensor's range, or a coalesced chunk's: its first and last tensor and its elements counted
  // from the first tensor's start.
  std::string describe(const Where& w, std::size_t n) const {
    if (w.tensor == static_cast<std::size_t>(-1)) return "";
    const std::size_t end = offsets_[w.tensor] + w.at + n;  // past the range, in m's order
    std::size_t last = w.tensor;
    while (last + 1 < sizes_.size() && offsets_[last + 1] < end) ++last;
    if (last == w.tensor)
      return trellis::detail::concat(" (", w.m ? "m" : "v", " of tensor ", w.tensor, ", elements [", w.at, ", ", w.at + n, "))");
    return trellis::detail::concat(" (", w.m ? "m" : "v", " of tensors ", w.tensor, " to ", last, ": elements [", w.at, ", ",
                                   w.at + n, ") counted from tensor ", w.tensor, "'s first)");
  }
  void pwrite_all(const float* src, std::size_t n, std::size_t element, Where where, int injected = 0) {
    const char* p = reinterpret_cast<const char*>(src);
    std::size_t left = n * sizeof(float);
    auto off = static_cast<off_t>(element * sizeof(float));
    while (left > 0) {
      ssize_t w = -1;
      if (injected != 0)
        errno = std::exchange(injected, 0);  // the probe's simulated failure
      else
        w = ::pwrite(fd_, p, left, off);
      if (w < 0 && errno == EINTR) continue;
      TRELLIS_CHECK(w > 0, "optimizer disk tier (", dir_.string(), "): writing ", left, " bytes at ", off,
                    describe(where, n), " failed: ", w < 0 ? std::strerror(errno) : "nothing written (disk full?)");
      p += w;
      left -= static_cast<std::size_t>(w);
      off += w;
    }
  }
  void pread_all(float* dst, std::size_t n, std::size_t element, Where where, int injected = 0) const {
    char* p = reinterpret_cast<char*>(dst);
    std::size_t left = n * sizeof(float);
    auto off = static_cast<off_t>(element * sizeof(float));
    while (left > 0) {
      ssize_t r = -1;
      if (injected != 0)
        errno = std::exchange(injected, 0);  // the probe's simulated failure
      else
        r = ::pread(fd_, p, left, off);
      if (r < 0 && errno == EINTR) continue;
      TRELLIS_CHECK(r > 0, "optimizer disk tier (", dir_.string(), "): reading ", left, " bytes at ", off,
                    describe(where, n), " failed: ", r < 0 ? std::strerror(errno) : "end of file");
      p += r;
      left -= static_cast<std::size_t>(r);
      off += r;
    }
  }
  void close() {
    io_.reset();  // joined first: no job of it touches the file after this
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  std::filesystem::path dir_;
  std::vector<std::size_t> offsets_, sizes_;
  std::size_t total_ = 0;
  int fd_ = -1;
  std::vector<std::vector<float>> m_, v_;  // a chunk's moments, in a ring of readahead + 1 buffers
  DiskProbe probe_;
  std::uint64_t streamed_ = 0;
  std::unique_ptr<UpdateWorker> io_;  // the I/O thread (prefetched streams), started by the first
};

}  // namespace trellis::train
