#!/usr/bin/env bash
# The examples, run as a user runs them. Usage: examples.sh TWINKLE_BINARY SOURCE_ROOT BUILD_EXAMPLES CASE
TWK=$1
SRC=$2
EX=$3
source "$SRC/tests/integration/lib.sh"
export TMPDIR="$TMP/run"
mkdir -p "$TMPDIR"

case $4 in
  digits)
    run 0 "$TWK" run --quiet "$EX/digits/job.toml"
    four=$(sed -n 's/^final loss: //p' "$TMP/out")
    acc=$(sed -n 's/^accuracy: //p' "$TMP/out")
    [ -n "$four" ] && [ -n "$acc" ] || { cat "$TMP/out"; fail "no final loss or accuracy line"; }
    python3 -c "import sys; sys.exit(0 if float('$acc') >= 0.95 else 1)" || fail "held-out accuracy $acc < 0.95"
    # Data parallelism must not change the result: one worker, same seed and global batch.
    run 0 "$TWK" run --quiet --set group.model.ranks=1 "$EX/digits/job.toml"
    one=$(sed -n 's/^final loss: //p' "$TMP/out")
    python3 -c "import sys; sys.exit(0 if abs(float('$four') - float('$one')) <= 1e-4 else 1)" ||
      fail "final loss with 4 workers ($four) differs from 1 worker ($one) by more than 1e-4"
    # The default backend for one host is shared memory; Gloo must train to the same accuracy.
    TWINKLE_COLLECTIVES=gloo run 0 "$TWK" run --quiet "$EX/digits/job.toml"
    gloo=$(sed -n 's/^final loss: //p' "$TMP/out")
    gacc=$(sed -n 's/^accuracy: //p' "$TMP/out")
    [ "$gacc" = "$acc" ] || fail "accuracy with Gloo ($gacc) differs from shared memory ($acc)"
    python3 -c "import sys; sys.exit(0 if abs(float('$four') - float('$gloo')) <= 1e-4 else 1)" ||
      fail "final loss with Gloo ($gloo) differs from shared memory ($four) by more than 1e-4"
    # A device as the data file is refused, not read forever.
    run 1 "$TWK" run --quiet --set args.data=/dev/zero "$EX/digits/job.toml"
    expect_err "root cause: /dev/zero is not a regular file; set args.data to the digits.csv.gz file"
    echo "4 workers: loss $four accuracy $acc (Gloo: $gloo $gacc); 1 worker: loss $one"
    ;;
  hello)
    run 0 "$TWK" run "$EX/hello/job.toml"
    expect_out 'collect flatten (by_data_rank, slice_dp):     ["a", "b", "c", "d", "e"]'
    expect_out 'collect last_pp (processor stage):            pp stage 1'
    expect_out '[model:3] Model up: rank 3 of 4, dp rank 1, tp rank 1'
    ;;
  pipeline)
    run 0 "$TWK" run --quiet "$EX/pipeline/job.toml"
    grep -qE '^overlap: sequential [0-9.]+ s, pipelined [0-9.]+ s, saved -?[0-9.]+%$' "$TMP/out" ||
      { cat "$TMP/out"; fail "no overlap summary line"; }
    ;;
  rl)
    # Three groups that call each other: the policy learns (the mean reward of the last 5 steps
    # reaches the job's threshold, from about 0.25 for the untrained policy) and the sampler's
    # weights are bit-identical to the trainer's after every step (the run fails otherwise).
    run 0 "$TWK" run --quiet "$EX/rl/job.toml"
    [ "$(grep -c '^step ' "$TMP/out")" -eq 30 ] || { cat "$TMP/out"; fail "not 30 steps"; }
    expect_out "weights in sync after every step: yes"
    python3 - "$TMP/out" <<'PY' || fail "the rl example did not learn"
import re, sys
out = open(sys.argv[1]).read()
first = float(re.search(r"^step  1  reward ([0-9.]+)", out, re.M).group(1))
mean, threshold = map(float, re.search(
    r"^mean reward of the last 5 steps: ([0-9.]+) \(threshold ([0-9.]+)\)$", out, re.M).groups())
print(f"first step {first}, last 5 steps {mean}, threshold {threshold}")
sys.exit(0 if first < 0.5 and threshold >= 0.9 and mean >= threshold else 1)
PY
    ;;
  *) fail "unknown case $4" ;;
esac
[ -z "$(ls -A "$TMPDIR")" ] || fail "a run directory was left behind"
echo "ok: $4"
