#!/usr/bin/env bash
# conan create, offline, with a private CONAN_HOME so the user's own Conan setup is untouched.
set -euo pipefail
src="$1"; work="$2"
mkdir -p "$work"
export CONAN_HOME="$work/home"
conan profile detect --exist-ok >/dev/null 2>&1
conan remote disable "*" >/dev/null 2>&1 || true   # offline: nothing may come from a remote
conan create "$src" --build=missing -c tools.cmake.cmaketoolchain:generator=Ninja
