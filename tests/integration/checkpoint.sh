#!/usr/bin/env bash
# Checkpoints, --resume, stopping on request and restarts, with the digits example (the real
# binary): a run stopped or killed at any point resumes to the same final loss, bit for bit, as a
# run that was never stopped, and a run whose worker is lost restarts its group and ends the same.
# Usage: checkpoint.sh TWINKLE_BINARY SOURCE_ROOT EXAMPLES_BUILD_DIR CASE
TWK=$1
SRC=$2
EXAMPLES=$3
CASE=$4
source "$SRC/tests/integration/lib.sh"

export TMPDIR="$TMP/run"  # where runs make their private directories
mkdir -p "$TMPDIR"
CK="$TMP/ck"

# digits.toml: the example's job with its plugin and data here; checkpoints in $CK (ck.toml).
sed -e "s|^plugin *=.*|plugin = \"$EXAMPLES/digits/libdigits.so\"|" \
  "$SRC/examples/digits/job.toml" >"$TMP/digits.toml"
cp "$SRC/examples/digits/digits.csv.gz" "$TMP/"
sed -e 's|^timeout_s = 120|timeout_s = 120\ncheckpoint_dir = "ck"|' "$TMP/digits.toml" >"$TMP/ck.toml"
grep -q '^checkpoint_dir = "ck"' "$TMP/ck.toml" || fail "could not add checkpoint_dir to the job"

# The reference: 30 epochs, never stopped, no checkpoints. Every epoch's loss line and the final
# loss (printed with every digit they have: fmt's shortest round trip).
run 0 "$TWK" run --quiet "$TMP/digits.toml"
grep -E '^epoch [0-9]+  loss ' "$TMP/out" >"$TMP/ref-epochs"
REF_FINAL=$(grep '^final loss:' "$TMP/out")
[ "$(wc -l <"$TMP/ref-epochs")" -eq 30 ] || { cat "$TMP/out"; fail "the reference has no 30 epochs"; }

# Nothing of a run left: no worker, no run folder.
expect_clean() {
  local deadline=$((SECONDS + 5))
  while pgrep -f -- "$TMPDIR" >/dev/null; do
    [ $SECONDS -lt $deadline ] || { pgrep -af -- "$TMPDIR"; fail "worker processes left behind"; }
    sleep 0.05
  done
  [ -z "$(ls -A "$TMPDIR")" ] || { ls -la "$TMPDIR"; fail "a run folder was left behind"; }
}

# resume_matches: `twinkle run --resume` of ck.toml continues from the newest checkpoint and
# ends as the reference: the same loss in every epoch after the one it resumed from, the same
# final loss. No temporary checkpoint folder is left.
resume_matches() {
  run 0 "$TWK" run --quiet --resume "$TMP/ck.toml"
  expect_out "twinkle: resuming from the checkpoint of step"
  local step
  step=$(sed -n 's/^resumed after epoch \([0-9]*\)$/\1/p' "$TMP/out")
  [ -n "$step" ] || { cat "$TMP/out"; fail "the driver did not say where it resumed"; }
  grep -E '^epoch [0-9]+  loss ' "$TMP/out" >"$TMP/got-epochs"
  tail -n +$((step + 1)) "$TMP/ref-epochs" >"$TMP/want-epochs"
  diff "$TMP/want-epochs" "$TMP/got-epochs" ||
    fail "resumed after epoch $step, the losses differ from the run that was never stopped"
  [ "$(grep '^final loss:' "$TMP/out")" = "$REF_FINAL" ] ||
    fail "final loss $(grep '^final loss:' "$TMP/out") after resuming from $step, uninterrupted $REF_FINAL"
  if ls -A "$CK" | grep -q '^\.'; then ls -la "$CK"; fail "a temporary checkpoint folder is left"; fi
  RESUMED_FROM=$step
}

# Starts ck.toml in the background (DRIVER_PID), stdout in $TMP/bg.out, stderr in $TMP/bg.err.
start_bg() {
  # The last run's output goes first: a wait for one of its lines must not find the old one
  # before the new driver's shell truncated the file (a signal sent then found a driver that had
  # not set up its signal handling yet).
  rm -f "$TMP/bg.out" "$TMP/bg.err"
  env "$@" "$TWK" run --quiet "$TMP/ck.toml" >"$TMP/bg.out" 2>"$TMP/bg.err" &
  DRIVER_PID=$!
}

# restarts.toml: ${3:-ck.toml} whose model group restarts (max_restarts = $1), with the group's
# keys $2 ('restart = "group"'; the defaults: restart = "worker", recover = "peer").
restart_job() {
  sed -e "s|^ranks  = 4 .*|ranks  = 4\nmax_restarts = $1\n${2:-}|" "$TMP/${3:-ck.toml}" >"$TMP/restarts.toml"
  grep -q "^max_restarts = $1" "$TMP/restarts.toml" || fail "could not add max_restarts"
}

# The losses of every epoch and the final loss of $TMP/out are the reference's.
losses_match() {
  grep -E '^epoch [0-9]+  loss ' "$TMP/out" | awk '!seen[$2]++' >"$TMP/got-epochs"
  diff "$TMP/ref-epochs" "$TMP/got-epochs" || fail "$1: the losses differ from the run that was never stopped"
  [ "$(grep '^final loss:' "$TMP/out")" = "$REF_FINAL" ] ||
    fail "$1: final loss $(grep '^final loss:' "$TMP/out"), uninterrupted $REF_FINAL"
}

case "$CASE" in
  restart_worker)
    # Rank 2 aborts in epoch 12; only it is replaced (restart = "worker"), the replacement copies
    # the state of a surviving replica (recover = "peer"), every replica rolls back to the end of
    # epoch 11 and the driver goes on from there: the reference's losses, bit for bit. No
    # checkpoint_dir: nothing is read from disk.
    for backend in shm gloo; do
      restart_job 1 "" digits.toml
      TWINKLE_COLLECTIVES=$backend run 0 "$TWK" run "$TMP/restarts.toml" --set args.fail_at=model:2:12
      expect_err "twinkle: restarting group model (restart 1 of 1 in 600 s): worker model:2"
      expect_err "was killed by signal 6 (Aborted)"
      expect_err "s after the loss; model:2 replaced, state copied model:2 from model:0 (0.1 MiB in "
      expect_err "twinkle: 1 restart(s) in this run:"
      expect_err "  group model, rank 2: worker model:2 (host "
      expect_out "a model worker was lost in epoch 12; the group is back at epoch 11"
      # The survivors kept their processes: one more model constructor (rank 2's), no more.
      [ "$(grep -c 'MLP 64-64-10 on rank' "$TMP/out")" -eq 5 ] ||
        { grep 'MLP 64-64-10 on rank' "$TMP/out"; fail "$backend: more than rank 2 was replaced"; }
      [ "$(grep -c '^\[model:2\] MLP 64-64-10 on rank 2' "$TMP/out")" -eq 2 ] ||
        fail "$backend: rank 2 was not replaced"
      [ "$(grep -c '^epoch 12  loss' "$TMP/out")" -eq 1 ] || fail "$backend: epoch 12 ran twice"
      losses_match "a worker restart with its state from a replica ($backend)"
    done
    # The same with checkpoints written: the copy still comes from the replica.
    restart_job 1
    run 0 "$TWK" run "$TMP/restarts.toml" --set args.fail_at=model:1:20
    expect_err "state copied model:1 from model:0 (0.1 MiB in "
    losses_match "a worker restart beside checkpoints"
    # restart = "worker" with recover = "checkpoint": the replacement takes its part of the
    # newest checkpoint (epoch 11), the survivors roll back to theirs: the same losses.
    restart_job 1 'recover = "checkpoint"'
    run 0 "$TWK" run "$TMP/restarts.toml" --set args.fail_at=model:3:12
    expect_err "s after the loss; model:3 replaced, from the checkpoint of step 11)"
    losses_match "a worker restart from a checkpoint"
    expect_clean
    ;;
  restart_group)
    # Rank 2 aborts in epoch 12; its group restarts from the checkpoint of epoch 11 and the
    # driver goes on from there: the run succeeds with the reference's losses, and says so.
    restart_job 1 'restart = "group"'
    run 0 "$TWK" run "$TMP/restarts.toml" --set args.fail_at=model:2:12
    expect_err "twinkle: restarting group model (restart 1 of 1 in 600 s): worker model:2"
    expect_err "was killed by signal 6 (Aborted)"
    expect_err "twinkle: group model is back (restart 1,"
    expect_err "model:0, model:1, model:2, model:3 replaced, from the checkpoint of step 11)"
    expect_err "twinkle: 1 restart(s) in this run:"
    expect_out "a model worker was lost in epoch 12; the group is back at epoch 11"
    [ "$(grep -c 'MLP 64-64-10 on rank' "$TMP/out")" -eq 8 ] || fail "the group was not replaced whole"
    # Epochs 12 onwards once each after the restart: the losses are the reference's, in order.
    [ "$(grep -c '^epoch 12  loss' "$TMP/out")" -eq 1 ] || fail "epoch 12 ran twice"
    losses_match "restart from a checkpoint"
    # Without checkpoints (recover = "none"), the group starts fresh and the driver from epoch 0.
    sed -e '/^checkpoint_dir/d' "$TMP/restarts.toml" >"$TMP/fresh.toml"
    run 0 "$TWK" run --quiet "$TMP/fresh.toml" --set args.fail_at=model:2:5
    expect_err "twinkle: group model is back (restart 1,"
    expect_err ", without state)"
    expect_out "the group is back at epoch 0"
    grep -E '^epoch [0-9]+  loss ' "$TMP/out" | tail -n 30 >"$TMP/got-epochs"
    diff "$TMP/ref-epochs" "$TMP/got-epochs" || fail "a fresh restart changed the losses"
    [ "$(grep '^final loss:' "$TMP/out")" = "$REF_FINAL" ] || fail "a fresh restart changed the final loss"
    expect_clean
    ;;
  restart_budget)
    # Rank 2 dies in epoch 12 in every life: max_restarts = 2 allows exactly two restarts, then
    # the run fails saying the budget is spent.
    restart_job 2
    run 1 "$TWK" run --quiet "$TMP/restarts.toml" --set args.fail_at=model:2:12:always
    [ "$(grep -c '^twinkle: restarting group model' "$TMP/err")" -eq 2 ] ||
      { cat "$TMP/err"; fail "expected exactly 2 restarts"; }
    expect_err "group model has no restarts left (2 in the last 600 s: max_restarts = 2)"
    expect_err "twinkle: 2 restart(s) in this run:"
    expect_clean
    # A rank that dies before it completes a call, three times: a crash loop, whatever the budget.
    restart_job 10
    run 1 "$TWK" run --quiet "$TMP/restarts.toml" --set args.fail_at=model:1:0
    expect_err "rank 1 of group model died 3 times in"
    expect_err "s before completing a call (a crash loop; no more restarts): worker model:1"
    [ "$(grep -c '^twinkle: restarting group model' "$TMP/err")" -eq 2 ] ||
      { cat "$TMP/err"; fail "a crash loop should end at its third death"; }
    # Without max_restarts a lost worker ends the run as before.
    run 1 "$TWK" run --quiet "$TMP/ck.toml" --set args.fail_at=model:2:3
    expect_err "stopping the other workers"
    expect_clean
    ;;
  restart_remote)
    # The same in remote mode: a head with its agent on loopback; rank 2 aborts in epoch 12, its
    # node's agent starts the group's replacements, which join the run and take the checkpoint
    # of epoch 11: the run succeeds with the reference's losses; and without checkpoints, from
    # the start.
    export HOME="$TMP/home"
    mkdir -p "$HOME"
    "$TWK" node start --head --bind 127.0.0.1 --port 0 --cpus 8 --state-dir "$TMP/state" \
      --cache-dir "$TMP/cache" >"$TMP/head.log" 2>&1 &
    HEAD_PID=$!
    trap 'kill -KILL $HEAD_PID 2>/dev/null; rm -rf "$TMP"' EXIT
    wait_for "$TMP/head.log" "joined the cluster" 10
    ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/head.log" | head -1)
    # restart = "worker": the node's agent starts rank 2 alone; it copies its state from a
    # replica over TCP (the run's keys), and the losses are the reference's.
    restart_job 1 "" digits.toml
    run 0 "$TWK" run "$TMP/restarts.toml" --set job.mode=remote --address "$ADDR" \
      --set args.fail_at=model:2:12
    expect_err "s after the loss; model:2 replaced, state copied model:2 from model:0 (0.1 MiB in "
    [ "$(grep -c 'MLP 64-64-10 on rank' "$TMP/out")" -eq 5 ] || fail "more than rank 2 was replaced"
    losses_match "a remote worker restart with its state from a replica"
    grep -q "restarted 1 worker(s)" "$TMP/head.log" || { cat "$TMP/head.log"; fail "the agent did not restart rank 2"; }
    restart_job 1 'restart = "group"'
    run 0 "$TWK" run --quiet "$TMP/restarts.toml" --set job.mode=remote --address "$ADDR" \
      --set args.fail_at=model:2:12
    expect_err "twinkle: restarting group model (restart 1 of 1 in 600 s): worker model:2"
    expect_err "was killed by signal 6 (Aborted) on node"
    expect_err "twinkle: group model is back (restart 1,"
    expect_err "from the checkpoint of step 11)"
    expect_out "a model worker was lost in epoch 12; the group is back at epoch 11"
    [ "$(grep -c '^epoch 12  loss' "$TMP/out")" -eq 1 ] || fail "epoch 12 ran twice"
    losses_match "a remote restart from a checkpoint"
    grep -q "killed model:0, model:1, model:3 for their group's restart" "$TMP/head.log" ||
      { cat "$TMP/head.log"; fail "the agent did not kill the group's survivors"; }
    grep -q "restarted 4 worker(s)" "$TMP/head.log" || fail "the agent did not restart the group"
    # The head's history counts the run's restart.
    run 0 "$TWK" jobs --all --json --address "$ADDR"
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))[0]; assert j["kind"] == "interactive" and j["restarts"] == 1, j' "$TMP/out" ||
      { cat "$TMP/out"; fail "twinkle jobs does not count the restart"; }
    run 0 "$TWK" job show "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0]["id"])' "$TMP/out")" --address "$ADDR"
    expect_out "  restarts   1 (groups restarted after a lost worker)"
    grep -E ' head +restart +a group of run [0-9a-f]+ restarted after a lost worker \(restart 1 of the run\)' "$TMP/out" ||
      { cat "$TMP/out"; fail "the audit lacks the restart"; }
    # Without checkpoints the group starts fresh, and the driver from epoch 0.
    sed -e '/^checkpoint_dir/d' "$TMP/restarts.toml" >"$TMP/fresh.toml"
    run 0 "$TWK" run --quiet "$TMP/fresh.toml" --set job.mode=remote --address "$ADDR" \
      --set args.fail_at=model:2:5
    expect_err ", without state)"
    expect_out "the group is back at epoch 0"
    grep -E '^epoch [0-9]+  loss ' "$TMP/out" | tail -n 30 >"$TMP/got-epochs"
    diff "$TMP/ref-epochs" "$TMP/got-epochs" || fail "a fresh remote restart changed the losses"
    [ "$(grep '^final loss:' "$TMP/out")" = "$REF_FINAL" ] || fail "a fresh remote restart changed the final loss"
    # Nothing of either run is left on the node.
    deadline=$((SECONDS + 10))
    while pgrep -f -- " worker .*$TMP/cache/" >/dev/null; do
      [ $SECONDS -lt $deadline ] || { pgrep -af -- " worker .*$TMP/cache/"; fail "workers left behind"; }
      sleep 0.05
    done
    ;;
  files)
    # A full run keeps the newest checkpoint_keep (3) complete checkpoints, each with a part per
    # worker whose sha256 the manifest records.
    run 0 "$TWK" run --quiet "$TMP/ck.toml"
    [ "$(grep '^final loss:' "$TMP/out")" = "$REF_FINAL" ] || fail "checkpoints changed the loss"
    [ "$(ls "$CK")" = "$(printf 'step-0000000028\nstep-0000000029\nstep-0000000030')" ] ||
      { ls -la "$CK"; fail "expected the newest three checkpoints"; }
    python3 - "$CK/step-0000000030" "$REF_FINAL" <<'PY' || fail "the manifest does not describe the parts"
import hashlib, json, os, sys
d = sys.argv[1]
m = json.load(open(os.path.join(d, "manifest.json")))
assert m["step"] == 30 and m["job"] == "digits", m
assert m["groups"] == [{"name": "model", "workers": 4, "mesh": [{"dim": "dp", "size": 4}]}], m
assert [p["worker"] for p in m["parts"]] == ["model:0", "model:1", "model:2", "model:3"], m
for p in m["parts"]:
    data = open(os.path.join(d, p["file"]), "rb").read()
    assert hashlib.sha256(data).hexdigest() == p["sha256"] and len(data) == p["bytes"], p
    assert p["instances"] == 1, p
assert "%.6f" % m["meta"]["loss"] == sys.argv[2].split(": ")[1], (m["meta"], sys.argv[2])
PY
    # A new run without --resume says that it starts fresh, and how to continue instead.
    run 0 "$TWK" run --quiet "$TMP/ck.toml" --set args.epochs=1
    expect_out "holds checkpoints (the newest: step 30); this run starts fresh"
    # --resume from step 30: nothing left to train, the same final loss and accuracy.
    run 0 "$TWK" run --quiet --resume "$TMP/ck.toml"
    expect_out "resumed after epoch"
    # A damaged part is refused by the worker that reads it, naming the file.
    newest=$(ls -d "$CK"/step-* | tail -1)
    printf 'X' | dd of="$newest/model.rank2.part" bs=1 seek=100 conv=notrunc status=none
    run 1 "$TWK" run --quiet --resume "$TMP/ck.toml"
    expect_err "model.rank2.part: its sha256 is not the manifest's"
    expect_err "Mlp constructor failed on group model rank 2"
    expect_clean
    ;;
  resume_after_kill)
    # The driver SIGKILLed at epoch 17 (perhaps while it checkpoints): its workers die with it,
    # and --resume ends with the reference's losses.
    start_bg
    wait_for "$TMP/bg.out" "epoch 17  loss" 30
    kill -KILL "$DRIVER_PID"
    wait "$DRIVER_PID"
    expect_clean
    resume_matches
    [ "$RESUMED_FROM" -ge 16 ] || fail "resumed from epoch $RESUMED_FROM, expected 16 or later"
    expect_clean
    ;;
  kill_points)
    # Killed at each point of writing the checkpoint of step 5: a worker half way through its
    # part, the driver before the manifest, before publishing, after publishing. The newest
    # complete checkpoint is then step 4 (5 once published), and --resume ends as the reference.
    for point in worker-part driver-parts driver-manifest driver-published; do
      rm -rf "$CK"
      start_bg TWINKLE_TEST_CHECKPOINT_FAULT="$point@5"
      wait "$DRIVER_PID"
      rc=$?
      [ "$rc" -ne 0 ] || { cat "$TMP/bg.err"; fail "$point: the run succeeded"; }
      grep -q "^epoch 6 " "$TMP/bg.out" && fail "$point: the run went on past the fault"
      expect_clean
      resume_matches
      want=4
      [ "$point" = driver-published ] && want=5
      [ "$RESUMED_FROM" -eq "$want" ] || fail "$point: resumed from $RESUMED_FROM, expected $want"
    done
    expect_clean
    ;;
  kill_random)
    # SIGKILL to the driver or to one worker at random moments of a run that checkpoints every
    # epoch (every few tens of milliseconds): resume always finds a complete checkpoint.
    for trial in $(seq 1 20); do
      rm -rf "$CK"
      start_bg
      wait_for "$TMP/bg.out" "epoch 3  loss" 30
      sleep "0.$((RANDOM % 40))"  # the random moment itself; the test waits on events elsewhere
      if [ $((trial % 2)) -eq 0 ]; then
        victim=$DRIVER_PID
      else
        victim=$(pgrep -f -- "$TMPDIR" | shuf -n 1)
      fi
      [ -n "$victim" ] && kill -KILL "$victim" 2>/dev/null
      wait "$DRIVER_PID"
      expect_clean
      if ! ls "$CK" | grep -q '^step-'; then fail "trial $trial: no complete checkpoint at all"; fi
      resume_matches
      echo "trial $trial: killed $([ "$victim" = "$DRIVER_PID" ] && echo driver || echo worker), resumed from $RESUMED_FROM"
    done
    expect_clean
    ;;
  stop_on_request)
    # SIGTERM at epoch 9: the driver finishes the epoch, checkpoints and returns; exit 75 with the
    # command that continues; --resume ends as the reference. SIGUSR1 the same.
    for sig in TERM USR1; do
      rm -rf "$CK"
      start_bg
      wait_for "$TMP/bg.out" "epoch 9  loss" 30
      kill -"$sig" "$DRIVER_PID"
      wait "$DRIVER_PID"
      rc=$?
      [ "$rc" -eq 75 ] || { cat "$TMP/bg.err"; fail "SIG$sig: exit $rc, expected 75"; }
      grep -q "stopped on request (SIG$sig) after the checkpoint of step" "$TMP/bg.err" ||
        { cat "$TMP/bg.err"; fail "SIG$sig: no word of the checkpoint"; }
      grep -qF "twinkle run --resume $TMP/ck.toml" "$TMP/bg.err" ||
        { cat "$TMP/bg.err"; fail "SIG$sig: no command to continue"; }
      grep -q "^stopping after epoch" "$TMP/bg.out" || fail "SIG$sig: the driver never saw the request"
      expect_clean
      resume_matches
    done
    # Without a checkpoint_dir, SIGTERM stops at once as before (143).
    "$TWK" run --quiet "$TMP/digits.toml" --set args.epochs=100000 >"$TMP/bg.out" 2>"$TMP/bg.err" &
    DRIVER_PID=$!
    wait_for "$TMP/bg.out" "epoch 2  loss" 30
    kill -TERM "$DRIVER_PID"
    wait "$DRIVER_PID"
    rc=$?
    [ "$rc" -eq 143 ] || { cat "$TMP/bg.err"; fail "SIGTERM without checkpoints: exit $rc, expected 143"; }
    expect_clean
    ;;
  mismatch)
    # A checkpoint of other groups or meshes is refused before anything starts, saying what
    # differs; so are --resume without a checkpoint_dir and --resume with nothing to resume.
    run 2 "$TWK" run --quiet --resume "$TMP/digits.toml"
    expect_err "--resume: $TMP/digits.toml has no job.checkpoint_dir"
    run 2 "$TWK" run --quiet --resume "$TMP/ck.toml"
    expect_err "--resume: no complete checkpoint in $CK; run without --resume to start fresh"
    run 0 "$TWK" run --quiet "$TMP/ck.toml" --set args.epochs=2
    run 2 "$TWK" run --quiet --resume "$TMP/ck.toml" --set group.model.ranks=2
    expect_err "group model has 4 workers in the checkpoint, 2 in the job"
    run 2 "$TWK" run --quiet --resume "$TMP/ck.toml" --set group.model.name=replicas
    expect_err "group model is in the checkpoint, not in the job"
    expect_err "group replicas is in the job, not in the checkpoint"
    # resume = "auto" starts fresh where there is nothing yet, and resumes where there is.
    rm -rf "$CK"
    run 0 "$TWK" run --quiet "$TMP/ck.toml" --set job.resume=auto --set args.epochs=3
    expect_out "no checkpoint in $CK yet; starting fresh"
    run 0 "$TWK" run --quiet "$TMP/ck.toml" --set job.resume=auto
    expect_out "resuming from the checkpoint of step 3"
    [ "$(grep '^final loss:' "$TMP/out")" = "$REF_FINAL" ] || fail "resume = auto changed the loss"
    expect_clean
    ;;
  *)
    fail "unknown case $CASE"
    ;;
esac
echo "ok: $CASE"
