#!/usr/bin/env bash
# Builds one fuzz harness (fuzz/TARGET.cpp) with libFuzzer + ASan + UBSan (clang++) and runs it for
# SECONDS, starting from the checked-in corpus fuzz/corpus/TARGET (only read). New interesting
# inputs go to build/fuzz/TARGET.corpus/, crashing ones to build/fuzz/TARGET.findings/ (libFuzzer
# prints the path). A finding then becomes a regression input: minimise it (build/fuzz/TARGET
# -minimize_crash=1 -runs=10000 FILE), fix the parser, copy the small file to
# fuzz/corpus/TARGET/regress-<what>, and `ctest --preset host -L fuzz` runs it from then on.
#
#   scripts/fuzz.sh TARGET [SECONDS] [extra libFuzzer flags...]   (default 300 seconds)
#   nice -n 15 scripts/fuzz.sh schedule 300                        (on a shared machine)
#   scripts/fuzz.sh TARGET coverage   line coverage (llvm-cov) of our headers by both corpora
#
# Targets: json checkpoint_index safetensors schedule flags data_shard. CXX overrides clang++.
# Limits: 10 s per input (-timeout, a hang), 64 MiB per allocation (-malloc_limit_mb: the inputs
# are small, so a bigger allocation means a size taken from the input without a bound).
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:?usage: scripts/fuzz.sh TARGET [SECONDS] [libFuzzer flags...]}"
seconds="${2:-300}"
shift $(( $# >= 2 ? 2 : 1 ))
[[ -f "fuzz/$target.cpp" && -d "fuzz/corpus/$target" ]] || { echo "fuzz.sh: no target '$target'" >&2; exit 2; }

out=build/fuzz
mkdir -p "$out/$target.corpus" "$out/$target.findings"
flags=(-std=c++20 -g -fno-omit-frame-pointer -DTRELLIS_FUZZ_LIBFUZZER -Iinclude -Iexamples)
if [[ "$seconds" == coverage ]]; then
  "${CXX:-clang++}" "${flags[@]}" -O0 -fsanitize=fuzzer -fprofile-instr-generate -fcoverage-mapping \
    "fuzz/$target.cpp" -o "$out/$target.cov"
  rm -f "$out/$target.profraw"
  LLVM_PROFILE_FILE="$out/$target.profraw" "$out/$target.cov" -runs=0 "$out/$target.corpus" "fuzz/corpus/$target" \
    2>&1 | grep -E "INITED|DONE" || true
  llvm-profdata merge -o "$out/$target.profdata" "$out/$target.profraw"
  exec llvm-cov report "$out/$target.cov" -instr-profile="$out/$target.profdata" \
    -ignore-filename-regex='^/usr/|/fuzz/[^/]*\.(cpp|hpp)$'
fi
bin="$out/$target"
if [[ ! -x "$bin" || -n "$(find fuzz include examples/train_gpt -newer "$bin" -name '*.?pp' -print -quit)" ]]; then
  echo "fuzz.sh: building $bin" >&2
  "${CXX:-clang++}" "${flags[@]}" -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "fuzz/$target.cpp" -o "$bin"
fi
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
exec "$bin" -max_total_time="$seconds" -timeout=10 -malloc_limit_mb=64 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$out/$target.findings/" "$@" "$out/$target.corpus" "fuzz/corpus/$target"
