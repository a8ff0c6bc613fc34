#!/usr/bin/env bash
# Prepares build/gpu-deps/: what bench/gpu/run.sh needs on a bare GPU machine whose image lacks
# it (no downloads there). Today: Catch2 2.x (the single header from this machine's install and a
# relocatable Catch2Config.cmake). Run it here, then hand build/gpu-deps to the device run
# (`carry`); run.sh puts it on CMAKE_PREFIX_PATH when it exists.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
deps="$repo/build/gpu-deps"
header=""
for candidate in /usr/include/catch2/catch.hpp /usr/local/include/catch2/catch.hpp; do
  [[ -f "$candidate" ]] && header="$candidate" && break
done
if [[ -z "$header" ]]; then
  echo "prepare_carry: catch2/catch.hpp not found (install catch2 here first)" >&2
  exit 1
fi
mkdir -p "$deps/include/catch2" "$deps/lib/cmake/Catch2"
cp "$header" "$deps/include/catch2/catch.hpp"
cat >"$deps/lib/cmake/Catch2/Catch2Config.cmake" <<'CMAKE'
# Relocatable stand-in for Catch2 2.x's package config (header-only library).
if(NOT TARGET Catch2::Catch2)
  add_library(Catch2::Catch2 INTERFACE IMPORTED)
  get_filename_component(_catch2_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
  set_target_properties(Catch2::Catch2 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_catch2_prefix}/include")
endif()
set(Catch2_FOUND TRUE)
CMAKE
echo "prepared $deps ($(du -sh "$deps" | cut -f1)); carry it as build/gpu-deps"
