#!/usr/bin/env bash
# conan create, offline, with a private CONAN_HOME so the user's own Conan setup is untouched.
set -euo pipefail
src="$1"; work="$2"
mkdir -p "$work"
export CONAN_HOME="$work/home"
conan profile detect --exist-ok >/dev/null 2>&1
conan remote disable "*" >/dev/null 2>&1 || true   # offline: nothing may come from a remote
# Offline, nlohmann_json cannot come from ConanCenter: a stand-in recipe packages the system's
# headers (nlohmann-json3-dev) under ConanCenter's name and target.
[[ -f /usr/share/cmake/nlohmann_json/nlohmann_jsonConfigVersion.cmake ]] \
  || { echo "conan_create.sh: nlohmann-json3-dev is not installed" >&2; exit 1; }
conan create "$(dirname "$0")/conan_nlohmann_json" >/dev/null
conan create "$src" --build=missing -c tools.cmake.cmaketoolchain:generator=Ninja
