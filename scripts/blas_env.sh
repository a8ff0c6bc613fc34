# Sourced by the project's scripts (test.sh, run.sh): when the installed OpenBLAS does not know
# this CPU and falls back to narrower kernels (Debian's 0.3.21 runs Prescott SSE3 kernels on
# Sapphire Rapids), export OPENBLAS_CORETYPE for the widest units the CPU has; likewise
# BLIS_ARCH_TYPE when BLIS is installed and picks narrower kernels (below). A value the user
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

# The same for BLIS (TRELLIS_BLAS=blis builds; docs/kernels_host.md "Which BLAS"): BLIS 0.9.0 picks
# its AVX2 "haswell" sub-configuration on Sapphire Rapids; BLIS_ARCH_TYPE forces another. BLIS 0.9
# reads that variable as an integer arch_t id (a name parses as 0, whatever it says; an id out of
# range aborts every program), and the ids differ between BLIS versions, so the wanted
# sub-configuration's id is looked up in the installed library, and a run with it set must select
# it before it is exported. Set only where BLIS picked narrower kernels than the CPU has (as the
# first-GEMM warning, blis_arch_warning in blas_core.hpp, decides); nothing when BLIS is absent.
if [[ -z "${BLIS_ARCH_TYPE:-}" && -r /proc/cpuinfo ]] && command -v python3 >/dev/null; then
  _trellis_flags=" $(grep -m1 '^flags' /proc/cpuinfo) "
  _trellis_want=""
  case "$_trellis_flags" in
    *" avx512f "*) _trellis_want=skx ;;
    *" avx2 "*) _trellis_want=haswell ;;
  esac
  # Prints "<sub-configuration in use> <id of argv[1]>" (id -1: not in this BLIS); nothing without BLIS.
  _trellis_py='
import ctypes, ctypes.util, sys
for name in ("libblis.so.4", ctypes.util.find_library("blis")):
    try:
        lib = ctypes.CDLL(name)
        lib.bli_init()
        break
    except Exception:
        lib = None
if lib is not None:
    lib.bli_arch_string.restype = ctypes.c_char_p
    names = []
    for i in range(64):
        s = lib.bli_arch_string(i)
        if s is None:
            break
        names.append(s.decode())
        if names[-1] == "generic":
            break
    want = sys.argv[1]
    print(names[lib.bli_arch_query_id()], names.index(want) if want in names else -1)
'
  _trellis_blis=()
  [[ -n "$_trellis_want" ]] && read -r -a _trellis_blis <<<"$(python3 -c "$_trellis_py" "$_trellis_want" 2>/dev/null)"
  _trellis_id=""
  case "${_trellis_blis[0]:-}:$_trellis_want" in
    generic:*|penryn:*|sandybridge:*|bulldozer:*|piledriver:*|steamroller:*|excavator:*) _trellis_id=${_trellis_blis[1]} ;;
    haswell:skx|zen:skx|zen2:skx|zen3:skx) _trellis_id=${_trellis_blis[1]} ;;
  esac
  if [[ "$_trellis_id" =~ ^[0-9]+$ ]] &&
     [[ "$(BLIS_ARCH_TYPE=$_trellis_id BLIS_ARCH_DEBUG=0 python3 -c "$_trellis_py" "$_trellis_want" 2>/dev/null)" == "$_trellis_want "* ]]; then
    export BLIS_ARCH_TYPE=$_trellis_id
    echo "blas_env: BLIS picks its ${_trellis_blis[0]} kernels on this CPU; BLIS_ARCH_TYPE=$BLIS_ARCH_TYPE (its id of $_trellis_want)" >&2
  fi
  unset _trellis_flags _trellis_want _trellis_py _trellis_blis _trellis_id
fi
