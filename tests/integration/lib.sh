# Helpers for integration tests that run the real `twinkle` binary. Source it; set TWK to the binary.
set -uo pipefail

TMP=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-test.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

# run EXPECTED_RC CMD...: runs CMD, keeps stdout in $TMP/out and stderr in $TMP/err.
run() {
  local want=$1; shift
  "$@" >"$TMP/out" 2>"$TMP/err"
  local got=$?
  if [ "$got" -ne "$want" ]; then
    echo "--- stdout"; cat "$TMP/out"; echo "--- stderr"; cat "$TMP/err"
    fail "'$*' exited $got, expected $want"
  fi
}

# wait_for FILE TEXT SECONDS: until FILE has TEXT (a deadline, never a fixed sleep).
wait_for() {
  local deadline=$((SECONDS + $3))
  until grep -qF -- "$2" "$1" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || { cat "$1"; fail "no \"$2\" in $1 within $3 s"; }
    sleep 0.05
  done
}

expect_out() { grep -qF -- "$1" "$TMP/out" || { cat "$TMP/out"; fail "stdout lacks: $1"; }; }
expect_err() { grep -qF -- "$1" "$TMP/err" || { cat "$TMP/err"; fail "stderr lacks: $1"; }; }

# Every line of stdout at most 80 columns (characters, not bytes).
expect_width_80() {
  python3 - "$TMP/out" <<'PY' || fail "a line of stdout is wider than 80 columns"
import sys
lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
bad = [l for l in lines if len(l) > 80]
for l in bad:
    print(len(l), l)
sys.exit(1 if bad or not lines else 0)
PY
}
