#!/usr/bin/env bash
# Installs what trellis' build, tests and examples need on a fresh Debian 12 machine, and nothing
# when it is all there already. Called by scripts/run.sh and scripts/test.sh.
set -euo pipefail

apt_packages=(cmake ninja-build g++ catch2 nlohmann-json3-dev libopenblas-dev libdnnl-dev ocl-icd-opencl-dev libopenmpi-dev openmpi-bin ccache valgrind)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python tools: conan (packaging test), safetensors + numpy (checkpoint interop test).
py_missing=()
python3 -c "import conans" 2>/dev/null || py_missing+=(conan)
python3 -c "import safetensors, numpy" 2>/dev/null || py_missing+=(safetensors numpy)
if ((${#py_missing[@]})); then
  echo "setup: pip installing ${py_missing[*]}"
  python3 -m pip install -q --disable-pip-version-check "${py_missing[@]}" 2>&1 | grep -v "as the 'root' user" || true
fi
command -v conan >/dev/null || { echo "setup: conan not on PATH after pip install" >&2; exit 1; }
