// A fresh directory under the system temp dir, removed when the test ends.
#pragma once

#include <filesystem>
#include <random>
#include <string>

#include <unistd.h>

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() /
           ("trellis-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};
