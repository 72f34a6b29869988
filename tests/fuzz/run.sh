#!/usr/bin/env bash
# Builds one libFuzzer target with clang (the project itself builds with g++) and runs it for a
# short fixed budget over its checked-in corpus and regression inputs. Exit 77 (skipped) without
# a clang that can link -fsanitize=fuzzer. The binary is cached in the build folder and rebuilt
# when a source it may use changed.
# Usage: run.sh SOURCE_ROOT BUILD_ROOT TARGET [SECONDS [MAX_RUNS]]
# Longer by hand: build/fuzz/TARGET tests/fuzz/corpus/TARGET -max_total_time=300 (see README).
set -uo pipefail
SRC=$1
BUILD=$2
TARGET=$3
SECONDS_BUDGET=${4:-5}
MAX_RUNS=${5:-500000}

CXX=
for c in clang++-14 clang++; do
  command -v "$c" >/dev/null 2>&1 && { CXX=$c; break; }
done
[ -n "$CXX" ] || { echo "skip: no clang++ (apt-get install clang-14 libclang-rt-14-dev)"; exit 77; }

OUT="$BUILD/fuzz"
mkdir -p "$OUT"
BIN="$OUT/$TARGET"

case $TARGET in
  fuzz_job) sources=(core/job/job.cpp core/job/mesh.cpp core/job/size.cpp); libs=(-ltomlplusplus -lfmt) ;;
  fuzz_message) sources=(transports/zmq/message.cpp transports/zmq/protocol.cpp transports/shm/segment.cpp); libs=(-lzmq -lfmt) ;;
  fuzz_value) sources=(); libs=() ;;
  fuzz_plugin_file) sources=(plugins/loader.cpp); libs=(-lfmt -ldl) ;;
  *) echo "unknown fuzz target $TARGET" >&2; exit 1 ;;
esac

stale() {
  [ -x "$BIN" ] || return 0
  [ -n "$(find "$SRC/core" "$SRC/plugins" "$SRC/transports" "$SRC/tests/fuzz" \
            \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' -o -name run.sh \) \
            -newer "$BIN" -print -quit)" ]
}

if stale; then
  tmp=$(mktemp "$OUT/.$TARGET.XXXXXX")
  srcs=()
  for s in "${sources[@]}"; do srcs+=("$SRC/$s"); done
  # shellcheck disable=SC2086
  if ! "$CXX" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
      -DMSGPACK_NO_BOOST -DTOML_HEADER_ONLY=0 -DTOML_SHARED_LIB=1 \
      -I"$SRC" -I"$SRC/plugins/include" -I"$BUILD" \
      "$SRC/tests/fuzz/$TARGET.cpp" "${srcs[@]}" "${libs[@]}" -o "$tmp" 2>"$tmp.log"; then
    if grep -q "libclang_rt.fuzzer\|unsupported option '-fsanitize=fuzzer" "$tmp.log"; then
      rm -f "$tmp" "$tmp.log"
      echo "skip: $CXX cannot link -fsanitize=fuzzer (apt-get install libclang-rt-14-dev)"
      exit 77
    fi
    cat "$tmp.log" >&2
    rm -f "$tmp" "$tmp.log"
    echo "FAIL: $TARGET does not build" >&2
    exit 1
  fi
  rm -f "$tmp.log"
  mv -f "$tmp" "$BIN"
fi

# New inputs go to a scratch corpus; the checked-in ones are only read.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-fuzz.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT/artifacts"
dirs=("$WORK")
for d in "$SRC/tests/fuzz/corpus/$TARGET" "$SRC/tests/fuzz/regressions/$TARGET"; do
  [ -d "$d" ] && dirs+=("$d")
done
"$BIN" -max_total_time="$SECONDS_BUDGET" -runs="$MAX_RUNS" -timeout=10 -rss_limit_mb=2048 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$OUT/artifacts/$TARGET-" "${dirs[@]}" \
  >"$WORK/log" 2>&1
rc=$?
grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|#[0-9]+ +DONE)" "$WORK/log"
if [ $rc -ne 0 ]; then
  tail -60 "$WORK/log" >&2
  echo "FAIL: $TARGET found a crash; the input is in $OUT/artifacts/ (add it to tests/fuzz/regressions/$TARGET once fixed)" >&2
  exit 1
fi
echo "ok: $TARGET"
