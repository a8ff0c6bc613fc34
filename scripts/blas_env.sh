# Sourced by the project's scripts (test.sh, run.sh): when the installed OpenBLAS does not know
# this CPU and falls back to narrower kernels (Debian's 0.3.21 runs Prescott SSE3 kernels on
# Sapphire Rapids), export OPENBLAS_CORETYPE for the widest units the CPU has. A value the user
# set is kept. The same check warns at run time in every trellis program
# (include/trellis/kernels/blas_core.hpp); docs/kernels_host.md has the figures.
if [[ -z "${OPENBLAS_CORETYPE:-}" && -r /proc/cpuinfo ]] && command -v python3 >/dev/null; then
  _trellis_flags=" $(grep -m1 '^flags' /proc/cpuinfo) "
  _trellis_want=""
  case "$_trellis_flags" in
    *" avx512_bf16 "*) _trellis_want=Cooperlake ;;
    *" avx512f "*) _trellis_want=SkylakeX ;;
    *" avx2 "*) _trellis_want=Haswell ;;
  esac
  _trellis_core=$(python3 -c '
import ctypes, ctypes.util
for name in ("libopenblas.so.0", ctypes.util.find_library("openblas")):
    try:
        lib = ctypes.CDLL(name)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        print(lib.openblas_get_corename().decode())
        break
    except Exception:
        pass
' 2>/dev/null || true)
  case "$_trellis_core" in
    Prescott|Core2|Penryn|Dunnington|Nehalem|Atom|Sandybridge|Unknown)
      [[ -n "$_trellis_want" ]] && export OPENBLAS_CORETYPE="$_trellis_want" ;;
    Haswell|Zen)
      [[ "$_trellis_want" == SkylakeX || "$_trellis_want" == Cooperlake ]] && export OPENBLAS_CORETYPE="$_trellis_want" ;;
    SkylakeX)
      [[ "$_trellis_want" == Cooperlake ]] && export OPENBLAS_CORETYPE="$_trellis_want" ;;
  esac
  [[ -n "${OPENBLAS_CORETYPE:-}" ]] &&
    echo "blas_env: OpenBLAS reports $_trellis_core kernels on this CPU; OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE" >&2
  unset _trellis_flags _trellis_want _trellis_core
fi
