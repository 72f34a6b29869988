#!/usr/bin/env bash
# The job service (issue 21): `twinkle submit`, `jobs`, `job show`, `logs`, `stop` against a head
# and node agents on loopback, with the digits example and the runtime fixture plugin; the head's
# history survives it being killed; users and their rights; dependencies; driver retries.
# Usage: jobs.sh TWINKLE_BINARY SOURCE_ROOT FIXTURE_PLUGIN EXAMPLES_BUILD_DIR CASE
TWK=$1
SRC=$2
PLUGIN=$3
EXAMPLES=$4
CASE=$5
source "$SRC/tests/integration/lib.sh"

export HOME="$TMP/home"  # keys, caches, pid files and the head's state of this test only
mkdir -p "$HOME"
unset TWINKLE_ADDRESS TWINKLE_KEY TWINKLE_HEAD_KEY TWINKLE_AUTHORIZED_KEYS TWINKLE_HOME
unset TWINKLE_JOB_ID TWINKLE_JOB_USER
unset DISPLAY WAYLAND_DISPLAY  # no login link goes to a desktop browser (dashboard_expired sets its own)
PIDS=()
ACCOUNTS=()  # Unix accounts this test made (users_apart)
cleanup() {
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  # Supervisors, drivers and workers of this test run from its folders: none may outlive it.
  pkill -KILL -f -- "$TMP/" 2>/dev/null
  for u in "${ACCOUNTS[@]}"; do
    pkill -KILL -u "$u" 2>/dev/null
    userdel "$u" 2>/dev/null
  done
  rm -rf "$TMP"
}
trap cleanup EXIT
STATE="$TMP/state"

# start_head [FLAGS...]: a head with no agent of its own, its state in $STATE; sets ADDR.
start_head() {
  "$TWK" node start --head --no-agent --bind 127.0.0.1 --port "${HEAD_PORT:-0}" \
    --state-dir "$STATE" "$@" >>"$TMP/head.log" 2>&1 &
  HEAD_PID=$!
  PIDS+=($HEAD_PID)
  wait_for "$TMP/head.log" "listening on" 10
  ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/head.log" | tail -1)
  HEAD_PORT=${ADDR##*:}
}

start_agent() {
  local id=$1; shift
  "$TWK" node start --address "$ADDR" --node-id "$id" --cache-dir "$TMP/cache-$id" "$@" \
    >"$TMP/agent-$id.log" 2>&1 &
  PIDS+=($!)
  wait_for "$TMP/agent-$id.log" "joined the cluster" 10
}

# digits_dir NAME EPOCHS [JOB LINES]: a working directory with the digits example (its plugin
# copied in), EPOCHS epochs.
digits_dir() {
  mkdir -p "$TMP/$1"
  sed -e "s|^plugin *=.*|plugin = \"libdigits.so\"|" -e "s|^epochs *=.*|epochs = $2|" \
    -e "s|^timeout_s = 120|timeout_s = 120\n${3-}|" \
    "$SRC/examples/digits/job.toml" >"$TMP/$1/job.toml"
  cp "$SRC/examples/digits/digits.csv.gz" "$EXAMPLES/digits/libdigits.so" "$TMP/$1/"
}

# fixture_dir NAME DRIVER: a working directory with a job of the fixture plugin (groups a: 4
# workers, b: 2).
fixture_dir() {
  mkdir -p "$TMP/$1"
  cat >"$TMP/$1/job.toml" <<TOML
[job]
name = "$1"
plugin = "$PLUGIN"
driver = "$2"
timeout_s = 60

[[group]]
name = "a"
ranks = 4
mesh = { dp = 2, tp = 2 }

[[group]]
name = "b"
ranks = 2
mesh = { pp = 2 }

[args]
tag = "t"
TOML
}

# web_session: logs in to the head's dashboard (started with --dashboard 0) with a link of
# `twinkle dashboard`; sets WEB, auth (curl's arguments of the session) and change (those and the
# CSRF token and Origin a change needs).
web_session() {
  wait_for "$TMP/head.log" "dashboard on http://127.0.0.1:" 10
  WEB=$(grep -o 'dashboard on http://127.0.0.1:[0-9]*' "$TMP/head.log" | tail -1 | sed 's/dashboard on //')
  run 0 "$TWK" dashboard --address "$ADDR"
  local link went key csrf
  link=$(grep -o 'http://127.0.0.1:[0-9]*/login?token=[0-9a-f]*' "$TMP/out")
  went=$(curl -s -o /dev/null -w '%{redirect_url}' -c "$TMP/jar" -H "Origin: $WEB" \
    --data "token=${link##*token=}" "$WEB/login")
  key=${went##*#key=}
  auth=(-b "$TMP/jar" -H "X-Twinkle-Key: $key")
  curl -s "${auth[@]}" "$WEB/api/v1/session" >"$TMP/session.json"
  csrf=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["csrf"])' "$TMP/session.json") ||
    fail "no session from the login link"
  change=("${auth[@]}" -H "X-CSRF-Token: $csrf" -H "Origin: $WEB")
}

# nvml_dir: a folder where the tests' stand-in NVML (tests/fixtures/nvml) is libnvidia-ml.so.1;
# an agent started with it first in LD_LIBRARY_PATH samples what $TMP/nvml says (TWINKLE_FAKE_NVML).
nvml_dir() {
  local lib
  lib="$(dirname "$PLUGIN")/nvml/libtwinkle_test_nvml.so"
  [ -f "$lib" ] || fail "no $lib: build the tests"
  mkdir -p "$TMP/nvml-lib"
  ln -sf "$lib" "$TMP/nvml-lib/libnvidia-ml.so.1"
  echo "$TMP/nvml-lib"
}

# job_field ID FIELD: a field of the job in `twinkle jobs --all --json`.
job_field() {
  "$TWK" jobs --all --json --address "$ADDR" "${MEMBER[@]}" |
    python3 -c 'import json,sys
jobs = {j["id"]: j for j in json.load(sys.stdin)}
j = jobs.get(int(sys.argv[1]))
print("" if j is None else j.get(sys.argv[2], ""))' "$1" "$2"
}

# wait_state ID STATE SECONDS: until the job is in STATE (polled, with a deadline); fails at once
# when it ends in another state.
wait_state() {
  local deadline=$((SECONDS + $3)) st
  while :; do
    st=$(job_field "$1" state)
    [ "$st" = "$2" ] && return 0
    case "$st" in SUCCEEDED|FAILED|STOPPED|DROPPED)
      "$TWK" job show "$1" --address "$ADDR" "${MEMBER[@]}"
      fail "job $1 ended $st, expected $2" ;;
    esac
    [ $SECONDS -lt $deadline ] || { "$TWK" job show "$1" --address "$ADDR" "${MEMBER[@]}"; cat "$TMP/head.log"; fail "job $1 is $st, not $2, after $3 s"; }
    sleep 0.1
  done
}

# submit_id ARGS...: submits, returns the job's id.
submit_id() {
  "$TWK" submit --json --address "$ADDR" "${MEMBER[@]}" "$@" >"$TMP/submit.json" 2>"$TMP/submit.err" ||
    { cat "$TMP/submit.err"; fail "submit $* failed"; }
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$TMP/submit.json"
}

# team_keys: keys for the head, a node and the members alice (team a), bob (team b) and carol
# (team c, admin) in $TMP/keys, with the allow-list $TMP/keys/allow; defines `as MEMBER`.
team_keys() {
  mkdir -p "$TMP/keys"
  run 0 "$TWK" keygen --out "$TMP/keys/head" --name the-head
  for who in node alice bob carol; do
    run 0 "$TWK" keygen --out "$TMP/keys/$who" --name "$who"
  done
  {
    cat "$TMP/keys/node/twinkle.pub"
    echo "$(cat "$TMP/keys/alice/twinkle.pub") team=a"
    echo "$(cat "$TMP/keys/bob/twinkle.pub") team=b"
    echo "$(cat "$TMP/keys/carol/twinkle.pub") team=c admin"
  } >"$TMP/keys/allow"
  KEYED=(--key "$TMP/keys/head/twinkle.key" --authorized-keys "$TMP/keys/allow")
}
as() { echo --key "$TMP/keys/$1/twinkle.key" --head-key "$TMP/keys/head/twinkle.pub"; }

# gpu_job NAME N: a working directory with a job of the fixture's `hang` driver whose group a is
# N workers of one GPU each (mesh dp = N) and group b one CPU worker.
gpu_job() {
  fixture_dir "$1" hang
  sed -i "s/^ranks = 4\$/ranks = $2\ndevice = \"cuda\"/; s/^mesh = { dp = 2, tp = 2 }\$/mesh = { dp = $2 }/; s/^ranks = 2\$/ranks = 1/; s/^mesh = { pp = 2 }\$/mesh = { pp = 1 }/" "$TMP/$1/job.toml"
}

# show_jobs HEADING: `twinkle jobs` into the test's log, under HEADING.
show_jobs() {
  echo "=== $1"
  "$TWK" jobs --address "$ADDR" "${MEMBER[@]}"
}

# until_reason ID TEXT SECONDS: until job ID's reason holds TEXT.
until_reason() {
  local deadline=$((SECONDS + $3))
  until job_field "$1" reason | grep -qF -- "$2"; do
    [ $SECONDS -lt $deadline ] || { show_jobs "jobs"; fail "job $1 waits with \"$(job_field "$1" reason)\", not \"$2\""; }
    sleep 0.1
  done
}

# until_epoch ID N SECONDS: until job ID's log has its epoch N.
until_epoch() {
  local deadline=$((SECONDS + $3))
  until "$TWK" logs "$1" --grep "^epoch $2 " --address "$ADDR" "${MEMBER[@]}" | grep -q epoch; do
    [ $SECONDS -lt $deadline ] || fail "job $1 did not reach epoch $2 in $3 s"
    sleep 0.1
  done
}

final_loss() { sed -n 's/^final loss: //p' "$1"; }
same_loss() {
  python3 -c "import sys; a,b=float('$1'),float('$2'); sys.exit(0 if abs(a-b)<=1e-4 else 1)" ||
    fail "final loss $1, expected $2"
}

MEMBER=()
case "$CASE" in
  detached)
    # Test 1: the job lives on after the client that submitted it is killed.
    start_head
    start_agent n1 --cpus 4
    digits_dir d 4
    run 0 "$TWK" run --quiet "$TMP/d/job.toml"  # the reference, in local mode
    want=$(final_loss "$TMP/out")
    [ -n "$want" ] || fail "no final loss in the reference run"
    "$TWK" submit "$TMP/d/job.toml" --wait --address "$ADDR" >"$TMP/client.out" 2>&1 &
    CLIENT=$!
    PIDS+=($CLIENT)
    wait_for "$TMP/client.out" "submitted job 1" 20
    kill -KILL $CLIENT
    wait_state 1 SUCCEEDED 90
    run 0 "$TWK" logs 1 --address "$ADDR"
    same_loss "$(final_loss "$TMP/out")" "$want"
    expect_out "[model:3]"
    run 0 "$TWK" jobs --address "$ADDR"
    grep -E '^ +1 +digits +[a-z]+ +SUCCEEDED +1 +0 ' "$TMP/out" || { cat "$TMP/out"; fail "jobs: no SUCCEEDED row for job 1"; }
    run 0 "$TWK" job show 1 --address "$ADDR"
        expect_out "job 1 (digits): SUCCEEDED"
    expect_out "DEVICE PLACEMENT TOPOLOGY"  # as `twinkle topology` draws it, with the real nodes
    expect_out "4 workers on n1"
        for r in 0 1 2 3; do
      grep -qE "^  model:$r +node n1$" "$TMP/out" || { cat "$TMP/out"; fail "job show: no placement of model:$r on n1"; }
    done
    expect_out "exit code  0"
    expect_out "final loss:"
    # An interactive run on the same cluster is recorded too, marked as such.
    run 0 "$TWK" run --quiet --set job.mode=remote "$TMP/d/job.toml" --address "$ADDR"
    run 0 "$TWK" jobs --address "$ADDR" --json
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); i=[x for x in j if x["kind"]=="interactive"]; assert len(i)==1 and i[0]["state"]=="SUCCEEDED" and i[0]["nodes"]==1, j' "$TMP/out" ||
      { cat "$TMP/out"; fail "the interactive run is not in the history"; }
    ;;

  logs)
    # Test 7: -f follows to the end; --rank, --driver, --grep and --tail filter.
    start_head
    start_agent n1 --cpus 8
    fixture_dir t talk
    id=$(submit_id "$TMP/t/job.toml")
    timeout 60 "$TWK" logs "$id" -f --address "$ADDR" >"$TMP/follow.out" 2>&1
    rc=$?
    [ $rc -eq 0 ] || { cat "$TMP/follow.out"; fail "logs -f exited $rc (124: it did not end with the job)"; }
    grep -qF "TALK DONE" "$TMP/follow.out" || { cat "$TMP/follow.out"; fail "logs -f lacks the driver's last line"; }
    grep -qF "exited with code 0" "$TMP/follow.out" || { cat "$TMP/follow.out"; fail "logs -f stopped before the end"; }
    [ "$(job_field "$id" state)" = SUCCEEDED ] || fail "the job did not succeed"
    run 0 "$TWK" logs "$id" --rank a:2 --address "$ADDR"
    [ "$(grep -c 'SAY a:2 line' "$TMP/out")" -eq 3 ] || { cat "$TMP/out"; fail "--rank a:2: not its 3 lines"; }
    if grep -v '^\[a:2\] ' "$TMP/out" | grep -q .; then cat "$TMP/out"; fail "--rank a:2 shows other lines"; fi
    run 0 "$TWK" logs "$id" --driver --address "$ADDR"
    expect_out "TALK DONE"
    if grep -q '^\[a:' "$TMP/out"; then cat "$TMP/out"; fail "--driver shows workers' lines"; fi
    run 0 "$TWK" logs "$id" --grep 'line 1$' --address "$ADDR"
    [ "$(wc -l <"$TMP/out")" -eq 4 ] || { cat "$TMP/out"; fail "--grep: not one line per rank of a"; }
    run 0 "$TWK" logs "$id" --tail 2 --address "$ADDR"
    [ "$(wc -l <"$TMP/out")" -eq 2 ] || { cat "$TMP/out"; fail "--tail 2: not two lines"; }
    tail -1 "$TMP/out" | grep -qF "exited with code 0" || { cat "$TMP/out"; fail "--tail: not the last lines"; }
    run 2 "$TWK" logs "$id" --rank a2 --address "$ADDR"
    expect_err "GROUP:N"
    run 1 "$TWK" logs 99 --address "$ADDR"
    expect_err "no job 99"
    ;;

  head_killed)
    # Test 2: SIGKILL the head mid-run and start it again: the running job goes on to SUCCEEDED,
    # the history is intact, and a queued job starts once the devices are free.
    start_head
    start_agent n1 --cpus 4
    digits_dir quick 2
    digits_dir long 800  # long enough to be running while the queued job waits, on a fast machine
    first=$(submit_id "$TMP/quick/job.toml")
    wait_state "$first" SUCCEEDED 60
    long=$(submit_id "$TMP/long/job.toml")
    queued=$(submit_id "$TMP/quick/job.toml")
    wait_state "$long" RUNNING 20
    deadline=$((SECONDS + 60))
    until "$TWK" logs "$long" --grep '^epoch 3 ' --address "$ADDR" | grep -q epoch; do
      [ $SECONDS -lt $deadline ] || fail "the long job did not reach epoch 3"
      sleep 0.1
    done
    until_reason "$queued" "waiting for devices" 10
    kill -KILL $HEAD_PID
    wait $HEAD_PID 2>/dev/null
    start_head  # the same port and state folder
    wait_for "$TMP/head.log" "1 running" 10
    wait_state "$long" SUCCEEDED 120
    wait_state "$queued" SUCCEEDED 90
    [ "$(job_field "$first" state)" = SUCCEEDED ] || fail "the history lost job $first"
    ended=$(job_field "$long" ended)
    started=$(job_field "$queued" started)
    [ "$started" -ge "$ended" ] || fail "the queued job started ($started) before the long one ended ($ended)"
    run 0 "$TWK" logs "$long" --address "$ADDR"
    expect_out "epoch 800 "
    expect_out "final loss:"
    ;;

  users)
    # Test 3: alice cannot stop bob's job; an admin can; the audit shows both.
    mkdir -p "$TMP/keys"
    run 0 "$TWK" keygen --out "$TMP/keys/head" --name the-head  # "head" is the head's own name
    for who in node alice bob carol; do
      run 0 "$TWK" keygen --out "$TMP/keys/$who" --name "$who"
    done
    expect_out 'as "carol"'
    for who in node alice bob; do cat "$TMP/keys/$who/twinkle.pub"; done >"$TMP/keys/allow"
    echo "$(cat "$TMP/keys/carol/twinkle.pub") admin" >>"$TMP/keys/allow"
    start_head --key "$TMP/keys/head/twinkle.key" --authorized-keys "$TMP/keys/allow"
    as() { echo --key "$TMP/keys/$1/twinkle.key" --head-key "$TMP/keys/head/twinkle.pub"; }
    start_agent n1 --cpus 8 $(as node)
    fixture_dir h hang
    MEMBER=($(as bob))
    id=$(submit_id "$TMP/h/job.toml")
    wait_state "$id" RUNNING 20
    deadline=$((SECONDS + 30))
    until "$TWK" logs "$id" --address "$ADDR" $(as bob) | grep -q "ALL READY"; do
      [ $SECONDS -lt $deadline ] || fail "the job did not start its workers"
      sleep 0.1
    done
        [ "$(job_field "$id" user)" = bob ] || fail "the job is not bob's: $(job_field "$id" user)"
    # A second job of bob's waits for the devices the first holds; bob stops it himself.
    queued=$(submit_id "$TMP/h/job.toml" --name second)
    deadline=$((SECONDS + 10))
    until job_field "$queued" reason | grep -q "waiting for devices"; do
      [ $SECONDS -lt $deadline ] || fail "the second job does not wait for devices: $(job_field "$queued" reason)"
      sleep 0.1
    done
    run 0 "$TWK" stop "$queued" --address "$ADDR" $(as bob)
    expect_out "job $queued stopped (it had not started)"
    [ "$(job_field "$queued" state)" = STOPPED ] || fail "the queued job is $(job_field "$queued" state)"
    [ "$(job_field "$queued" started)" = 0 ] || fail "the stopped queued job started"
    run 1 "$TWK" stop "$id" --address "$ADDR" $(as alice)
    expect_err "job $id is bob's; you (alice) may stop only your own jobs"
    [ "$(job_field "$id" state)" = RUNNING ] || fail "alice's refused stop changed the job"
    run 0 "$TWK" stop "$id" --address "$ADDR" $(as carol)
    wait_state "$id" STOPPED 60
    run 0 "$TWK" job show "$id" --address "$ADDR" $(as alice)
    expect_out "stopped by carol"
    grep -E ' bob +submit ' "$TMP/out" || { cat "$TMP/out"; fail "the audit lacks bob's submit"; }
    grep -E ' alice +stop refused ' "$TMP/out" || { cat "$TMP/out"; fail "the audit lacks alice's refused stop"; }
    grep -E ' carol +stop ' "$TMP/out" || { cat "$TMP/out"; fail "the audit lacks carol's stop"; }
    # An allow-list line with a third word that is not "admin" is refused with its line.
    echo "$(cat "$TMP/keys/alice/twinkle.pub") boss" >"$TMP/keys/bad"
    run 2 "$TWK" node start --head --no-agent --bind 127.0.0.1 --port 0 --state-dir "$TMP/s2" \
      --key "$TMP/keys/head/twinkle.key" --authorized-keys "$TMP/keys/bad"
    expect_err "bad:1: \"boss\" after the name"
    ;;

  after)
    # Test 4: --after ID:ok runs only after ID succeeds; --after ID:notok is dropped then.
    start_head
    start_agent n1 --cpus 8
    fixture_dir ok modes
    fixture_dir bad throws
    a=$(submit_id "$TMP/ok/job.toml")
    b=$(submit_id "$TMP/ok/job.toml" --after "$a:ok" --name after-ok)
    c=$(submit_id "$TMP/ok/job.toml" --after "$a:notok" --name after-notok)
    e=$(submit_id "$TMP/bad/job.toml")
    f=$(submit_id "$TMP/ok/job.toml" --after "$e:notok")
    g=$(submit_id "$TMP/ok/job.toml" --after "$e")
    wait_state "$b" SUCCEEDED 60
    wait_state "$c" DROPPED 30
    wait_state "$f" SUCCEEDED 60
    wait_state "$g" DROPPED 30
    [ "$(job_field "$e" state)" = FAILED ] || fail "job $e should have failed"
    [ "$(job_field "$b" started)" -ge "$(job_field "$a" ended)" ] || fail "job $b started before job $a ended"
    run 0 "$TWK" job show "$c" --address "$ADDR"
    expect_out "job $a ended SUCCEEDED, and this job runs only after it fails or is stopped"
    run 0 "$TWK" job show "$g" --address "$ADDR"
    expect_out "job $e ended FAILED, and this job runs only after it succeeds"
    run 2 "$TWK" submit "$TMP/ok/job.toml" --after 999 --address "$ADDR"
    expect_err "--after 999: no such job"
    run 2 "$TWK" submit "$TMP/ok/job.toml" --after "$a:maybe" --address "$ADDR"
    expect_err "ok, notok or any"
    ;;

  retries)
    # Test 5: --max-retries 1: the driver SIGKILLed mid-run starts again with --resume and the
    # job ends SUCCEEDED with 1 retry and the uninterrupted run's final loss.
    start_head
    start_agent n1 --cpus 4
        digits_dir ref 30 'checkpoint_dir = "ck"'
    digits_dir r 30 'checkpoint_dir = "ck"'
    run 0 "$TWK" run --quiet "$TMP/ref/job.toml"
    want=$(final_loss "$TMP/out")
    id=$(submit_id "$TMP/r/job.toml" --max-retries 1)
    deadline=$((SECONDS + 60))
    until "$TWK" logs "$id" --grep '^epoch 3 ' --address "$ADDR" | grep -q epoch; do
      [ $SECONDS -lt $deadline ] || fail "the job did not reach epoch 3"
      sleep 0.1
    done
    driver=$(awk '{print $2}' "$STATE/jobs/$id/attempt")
    [ -n "$driver" ] || fail "no driver pid in the attempt file"
    kill -KILL "$driver"
    wait_state "$id" SUCCEEDED 120
    [ "$(job_field "$id" retries)" = 1 ] || fail "retries: $(job_field "$id" retries), expected 1"
    run 0 "$TWK" logs "$id" --address "$ADDR"
        expect_out "was killed by signal 9; starting it again (1 of 1 retries, resuming from its newest checkpoint)"
        expect_out "resumed after epoch"
    [ "$(grep -c '^final loss: ' "$TMP/out")" -eq 1 ] || { cat "$TMP/out"; fail "the first attempt was not killed mid-run"; }
    same_loss "$(final_loss "$TMP/out")" "$want"
    run 0 "$TWK" jobs --address "$ADDR"
    grep -E "^ +$id +digits .* SUCCEEDED .* 1 +0$" "$TMP/out" || { cat "$TMP/out"; fail "jobs: no retry counted"; }
    ;;

    stop_checkpoint)
    # `twinkle stop` of a job with a checkpoint_dir: the graceful path, a checkpoint, exit 75,
    # STOPPED; the checkpoint is in the job's copy of its folder. `twinkle resume` queues it
    # again: it goes on from that checkpoint and ends with the uninterrupted run's loss.
    start_head
    start_agent n1 --cpus 4
    digits_dir ref 200
    run 0 "$TWK" run --quiet "$TMP/ref/job.toml"
    want=$(final_loss "$TMP/out")
    digits_dir s 200 'checkpoint_dir = "ck"'
    id=$(submit_id "$TMP/s/job.toml")
    until_epoch "$id" 3 60
    run 0 "$TWK" stop "$id" --address "$ADDR"
    expect_out "asked its driver to stop"
    wait_state "$id" STOPPED 60
    [ "$(job_field "$id" exit_code)" = 75 ] || fail "exit code $(job_field "$id" exit_code), expected 75"
    job_field "$id" reason | grep -qF "after its checkpoint" || fail "reason: $(job_field "$id" reason)"
    run 0 "$TWK" logs "$id" --address "$ADDR"
    expect_out "stopping after epoch"
    ls "$STATE/jobs/$id/work/ck/" | grep -q '^step-' || { ls -R "$STATE/jobs/$id/work"; fail "no checkpoint in the job's folder"; }
    expect_out "continue with:"
    expect_out "  twinkle resume $id"
    run 1 "$TWK" resume 999 --address "$ADDR"
    expect_err "no job 999 in this cluster's history"
    run 0 "$TWK" resume "$id" --address "$ADDR"
    expect_out "job $id is queued again; its driver resumes from its newest checkpoint"
    run 1 "$TWK" resume "$id" --address "$ADDR"
    expect_err "only a STOPPED or FAILED job resumes"
    wait_state "$id" SUCCEEDED 120
    run 0 "$TWK" logs "$id" --address "$ADDR"
    expect_out "twinkle: resuming from the checkpoint of step"
    [ "$(grep -c '^final loss: ' "$TMP/out")" -eq 1 ] || { cat "$TMP/out"; fail "the stopped run ended on its own"; }
    same_loss "$(final_loss "$TMP/out")" "$want"
    run 0 "$TWK" job show "$id" --address "$ADDR"
    expect_out "resume"
    grep -E "$(id -un) +resume .*it was STOPPED" "$TMP/out" || { cat "$TMP/out"; fail "no resume in the audit"; }
    # A job without a checkpoint_dir has nothing to resume from.
    digits_dir n 100000
    id=$(submit_id "$TMP/n/job.toml")
    wait_state "$id" RUNNING 20
    run 0 "$TWK" stop "$id" --now --address "$ADDR"
    wait_state "$id" STOPPED 30
    run 1 "$TWK" resume "$id" --address "$ADDR"
    expect_err "job $id has no checkpoint_dir, so it has nothing to resume from; submit it again to start over"
    ;;

  upload)
    # Test 6: the same working directory uploads once; one over the limit is refused before
    # anything is queued; a job file with an error is refused with its file:line:col.
    start_head
    start_agent n1 --cpus 8
    fixture_dir u modes
    run 0 "$TWK" submit --json "$TMP/u/job.toml" --address "$ADDR"
    python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["uploaded"] is True' "$TMP/out" || fail "the first submit did not upload"
    run 0 "$TWK" submit "$TMP/u/job.toml" --address "$ADDR"
    expect_out "the head had it already"
    [ "$(ls "$STATE/uploads" | wc -l)" -eq 1 ] || { ls "$STATE/uploads"; fail "two uploads of one folder"; }
    wait_state 2 SUCCEEDED 60
    head -c 3000000 /dev/urandom >"$TMP/u/big.bin"
    run 2 "$TWK" submit "$TMP/u/job.toml" --max-upload 1MiB --address "$ADDR"
    expect_err "more than the upload limit of 1.0 MiB"
    expect_err ".twinkleignore"
    echo "big.bin" >"$TMP/u/.twinkleignore"
    run 0 "$TWK" submit --json "$TMP/u/job.toml" --max-upload 1MiB --address "$ADDR"
    rm "$TMP/u/big.bin" "$TMP/u/.twinkleignore"
    printf '[job]\nname = "broken"\nplugin = "x.so"\n\n[[group]]\nname = "a"\nranks = "four"\n' >"$TMP/u/broken.toml"
    run 2 "$TWK" submit "$TMP/u/broken.toml" --address "$ADDR"
    expect_err "broken.toml:7:9: group \"a\": ranks must be an integer"
    run 2 "$TWK" submit "$TMP/u/job.toml" --working-dir "$TMP/ok-elsewhere" --address "$ADDR"
    expect_err "is not inside the working directory"
    [ "$(job_field 4 state)" = "" ] || fail "a refused submit was queued"
    [ "$(ls "$STATE/uploads" | wc -l)" -eq 2 ] || { ls "$STATE/uploads"; fail "a refused submit uploaded"; }
    ;;

    retention)
    # --keep-jobs N: the history keeps the newest N ended jobs; older ones go with their folders,
    # and an archive with the last job that used it.
    start_head --keep-jobs 2
    start_agent n1 --cpus 8
    fixture_dir one modes
    fixture_dir two modes
    a=$(submit_id "$TMP/one/job.toml")
    wait_state "$a" SUCCEEDED 60
    for _ in 1 2; do last=$(submit_id "$TMP/two/job.toml"); wait_state "$last" SUCCEEDED 60; done
    run 0 "$TWK" jobs --all --json --address "$ADDR"
    python3 -c 'import json,sys; ids=[j["id"] for j in json.load(open(sys.argv[1]))]; assert ids==[int(sys.argv[2]), int(sys.argv[2])-1], ids' "$TMP/out" "$last" ||
      { cat "$TMP/out"; fail "--keep-jobs 2 should keep jobs $((last-1)) and $last only"; }
    [ ! -e "$STATE/jobs/$a" ] || fail "the pruned job's folder is left"
    [ "$(ls "$STATE/uploads" | wc -l)" -eq 1 ] || { ls "$STATE/uploads"; fail "the pruned job's archive is left"; }
    run 1 "$TWK" job show "$a" --address "$ADDR"
    expect_err "no job $a in this cluster's history"
    ;;

    driver_labels)
    # [job] driver_labels: a submitted job's driver runs on a node with those labels (its agent
    # fetches the working directory and starts it), and its log, its end and `twinkle stop` go
    # through that agent. A job no node can take waits, saying why. The driver's node lost
    # mid-run: with --max-retries the job starts again on another such node and resumes from
    # its checkpoint (in a folder both nodes see), ending with the uninterrupted run's loss.
    # On a cluster with keys: the driver on a node has a key of its own, as on the head.
    team_keys
    start_head "${KEYED[@]}"
    MEMBER=($(as alice))
    start_agent w1 --cpus 4 --labels role=work $(as node)
    digits_dir ref 30
    run 0 "$TWK" run --quiet "$TMP/ref/job.toml"
    want=$(final_loss "$TMP/out")
    digits_dir d 30 'driver_labels = { role = "driver" }'
    id=$(submit_id "$TMP/d/job.toml")
    until_reason "$id" "the driver (driver_labels role=driver)" 10
    [ "$(job_field "$id" state)" = QUEUED ] || fail "a job whose driver fits no node should wait"
    start_agent d1 --cpus 1 --labels role=driver $(as node)
    wait_state "$id" SUCCEEDED 60
    [ "$(job_field "$id" driver_node)" = d1 ] || fail "driver_node: $(job_field "$id" driver_node), expected d1"
    run 0 "$TWK" job show "$id" --address "$ADDR" "${MEMBER[@]}"
    expect_out "driver     on node d1"
    run 0 "$TWK" logs "$id" --address "$ADDR" "${MEMBER[@]}"
    expect_out "twinkle job: the driver (attempt 1, pid"
    same_loss "$(final_loss "$TMP/out")" "$want"
    [ "$(grep -c '^epoch [0-9]*  loss' "$TMP/out")" -eq 30 ] || { cat "$TMP/out"; fail "the log lacks epochs, or has some twice"; }
    grep -q "job $id (digits) of alice: its driver started here" "$TMP/agent-d1.log" ||
      { cat "$TMP/agent-d1.log"; fail "the driver did not start on d1"; }
    wait_for "$TMP/agent-d1.log" "job $id: its driver is done here" 10
    [ -z "$(ls -A "$TMP/cache-d1/drivers")" ] || { ls -la "$TMP/cache-d1/drivers"; fail "d1 kept the driver's folder"; }
    [ ! -e "$TMP/cache-d1/archives" ] || fail "d1 kept a working directory's archive outside the driver's folder"

    # `twinkle stop` reaches a driver on a node: a checkpoint, exit 75, STOPPED.
    digits_dir s 100000 "checkpoint_dir = \"$TMP/ck-s\"\ndriver_labels = { role = \"driver\" }"
    id=$(submit_id "$TMP/s/job.toml")
    wait_state "$id" RUNNING 20
    until_epoch "$id" 3 60
    run 0 "$TWK" stop "$id" --address "$ADDR" "${MEMBER[@]}"
    wait_state "$id" STOPPED 60
    [ "$(job_field "$id" exit_code)" = 75 ] || fail "exit code $(job_field "$id" exit_code), expected 75"
    run 0 "$TWK" logs "$id" --address "$ADDR" "${MEMBER[@]}"
    expect_out "stopped on request (SIGTERM) after the checkpoint of step"

    # The driver's node lost: another node with the labels takes it, from its checkpoint.
    start_agent d2 --cpus 1 --labels role=driver $(as node)
    digits_dir lref 400
    run 0 "$TWK" run --quiet "$TMP/lref/job.toml"
    want=$(final_loss "$TMP/out")
    digits_dir l 400 "checkpoint_dir = \"$TMP/ck-l\"\ndriver_labels = { role = \"driver\" }"
    id=$(submit_id "$TMP/l/job.toml" --max-retries 1)
    wait_state "$id" RUNNING 20
    until_epoch "$id" 5 60
    lost=$(job_field "$id" driver_node)
    case "$lost" in d1) other=d2 ;; d2) other=d1 ;; *) fail "driver_node: \"$lost\"" ;; esac
    # The node goes as a machine would: its agent and everything it started.
    pkill -KILL -f -- "--node-id $lost " || fail "no agent of $lost"
    pkill -KILL -f -- "$TMP/cache-$lost/"
    wait_state "$id" SUCCEEDED 120
    [ "$(job_field "$id" driver_node)" = "$other" ] || fail "driver_node: $(job_field "$id" driver_node), expected $other"
    [ "$(job_field "$id" retries)" = 1 ] || fail "retries: $(job_field "$id" retries), expected 1"
    run 0 "$TWK" job show "$id" --address "$ADDR" "${MEMBER[@]}"
    expect_out "attempt 2 of 2: the node $lost of its driver was lost"
    run 0 "$TWK" logs "$id" --address "$ADDR" "${MEMBER[@]}"
    expect_out "resumed after epoch"
    same_loss "$(final_loss "$TMP/out")" "$want"
    ;;

    driver_agent)
    # A driver on a node outlives its agent: an agent killed and started again at once takes it
    # up (the job goes on, every epoch once in its log, the uninterrupted loss); one that comes
    # back after the head declared its node DEAD finds the job started elsewhere, and kills the
    # driver it left.
    start_head
    start_agent w1 --cpus 4 --labels role=work
    start_agent d1 --cpus 1 --labels role=driver
    digits_dir ref 300
    run 0 "$TWK" run --quiet "$TMP/ref/job.toml"
    want=$(final_loss "$TMP/out")
    digits_dir a 300 'driver_labels = { role = "driver" }'
    id=$(submit_id "$TMP/a/job.toml")
    until_epoch "$id" 5 60
    pkill -KILL -f -- "--node-id d1 " || fail "no agent d1"
    # Again at once: the head takes the node id from a new agent once the old one has been
    # silent for 1 s, so it is tried until taken (each try ends at once when refused).
    deadline=$((SECONDS + 3))
    while :; do
      "$TWK" node start --address "$ADDR" --node-id d1 --cache-dir "$TMP/cache-d1" --cpus 1 \
        --labels role=driver >"$TMP/agent-d1.log" 2>&1 &
      apid=$!
      PIDS+=($apid)
      while kill -0 "$apid" 2>/dev/null && ! grep -q "joined the cluster" "$TMP/agent-d1.log"; do
        [ $SECONDS -lt $((deadline + 10)) ] || { cat "$TMP/agent-d1.log"; fail "d1 neither joined nor ended"; }
        sleep 0.02
      done
      grep -q "joined the cluster" "$TMP/agent-d1.log" && break
      [ $SECONDS -lt $deadline ] || { cat "$TMP/agent-d1.log"; fail "d1 could not join again"; }
    done
    wait_for "$TMP/agent-d1.log" "job $id: took up its driver again" 10
    wait_state "$id" SUCCEEDED 120
    [ "$(job_field "$id" retries)" = 0 ] || fail "retries: $(job_field "$id" retries): the driver was not kept"
    [ "$(job_field "$id" driver_node)" = d1 ] || fail "driver_node: $(job_field "$id" driver_node)"
    run 0 "$TWK" logs "$id" --address "$ADDR"
    [ "$(grep -c '^epoch [0-9]*  loss' "$TMP/out")" -eq 300 ] || { cat "$TMP/out"; fail "the log lacks epochs, or has some twice"; }
    same_loss "$(final_loss "$TMP/out")" "$want"

    start_agent d2 --cpus 1 --labels role=driver
    digits_dir b 100000 'driver_labels = { role = "driver" }'
    id=$(submit_id "$TMP/b/job.toml" --max-retries 1)
    until_epoch "$id" 3 60
    lost=$(job_field "$id" driver_node)
    case "$lost" in d1) other=d2 ;; d2) other=d1 ;; *) fail "driver_node: \"$lost\"" ;; esac
    pkill -KILL -f -- "--node-id $lost " || fail "no agent of $lost"
    deadline=$((SECONDS + 30))
    until [ "$(job_field "$id" driver_node)" = "$other" ] && [ "$(job_field "$id" state)" = RUNNING ]; do
      [ $SECONDS -lt $deadline ] || { "$TWK" job show "$id" --address "$ADDR"; fail "the job did not move to $other"; }
      sleep 0.1
    done
    [ "$(job_field "$id" retries)" = 1 ] || fail "retries: $(job_field "$id" retries), expected 1"
    pgrep -f -- "$TMP/cache-$lost/drivers" >/dev/null || fail "the driver left on $lost did not outlive its agent"
    start_agent "$lost" --cpus 1 --labels role=driver
    deadline=$((SECONDS + 20))
    while pgrep -f -- "$TMP/cache-$lost/drivers" >/dev/null; do
      [ $SECONDS -lt $deadline ] || { pgrep -af -- "$TMP/cache-$lost/drivers"; fail "the driver left on $lost still runs"; }
      sleep 0.1
    done
    grep -q "job $id: its driver is done here" "$TMP/agent-$lost.log" || { cat "$TMP/agent-$lost.log"; fail "$lost did not forget the driver"; }
    [ "$(job_field "$id" state)" = RUNNING ] || fail "the old driver's end was taken for the job's"
    run 0 "$TWK" stop "$id" --now --address "$ADDR"
    wait_state "$id" STOPPED 30
    ;;

    driver_cpu)
    # A submitted job's driver runs on the head's machine and, when that is a node, takes one of
    # its CPUs while the job runs: a 4-worker job on a head node of 4 CPUs waits, saying why; with
    # a second node its workers go there and the driver's CPU stays on the head's node.
    "$TWK" node start --head --bind 127.0.0.1 --port 0 --cpus 4 --node-id hn --state-dir "$STATE" \
      --cache-dir "$TMP/cache-hn" >"$TMP/head.log" 2>&1 &
    PIDS+=($!)
    wait_for "$TMP/head.log" "joined the cluster" 10
    ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/head.log" | head -1)
        digits_dir d 300  # long enough to look at while it runs; stopped below
    id=$(submit_id "$TMP/d/job.toml")
    deadline=$((SECONDS + 10))
    until job_field "$id" reason | grep -qF "its driver takes one CPU of hn, the head's node"; do
      [ $SECONDS -lt $deadline ] || fail "the job does not wait for its driver's CPU: $(job_field "$id" reason)"
      sleep 0.1
    done
    [ "$(job_field "$id" state)" = QUEUED ] || fail "the job should wait"
    start_agent n2 --cpus 4
    wait_state "$id" RUNNING 20
    deadline=$((SECONDS + 20))
    until "$TWK" nodes --address "$ADDR" --json >"$TMP/nodes.json" && python3 - "$TMP/nodes.json" "$id" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
job = sys.argv[2]
r = {x["run"]: x for x in d["reservations"]}
drv = r.get(f"job-{job}-driver")
assert drv and drv["bundles"] == [{"node": "hn", "gpus": [], "cpus": 1}], r
work = [x for k, x in r.items() if not k.startswith("job-")]
assert len(work) == 1 and [b["node"] for b in work[0]["bundles"]] == ["n2"], r
PY
    do
            [ $SECONDS -lt $deadline ] || { cat "$TMP/nodes.json"; fail "no driver CPU on hn with the workers on n2"; }
      sleep 0.1
    done
    run 0 "$TWK" stop --now "$id" --address "$ADDR"
    wait_state "$id" STOPPED 30
    deadline=$((SECONDS + 10))
    until "$TWK" nodes --address "$ADDR" --json | python3 -c 'import json,sys; sys.exit(0 if not json.load(sys.stdin)["reservations"] else 1)'; do
      [ $SECONDS -lt $deadline ] || fail "the driver's CPU was not freed with the job"
      sleep 0.1
    done
    ;;

  node_stop)
    # Test 9: `twinkle node stop` stops a head and an agent that run in the foreground.
    "$TWK" node start --head --bind 127.0.0.1 --port 0 --cpus 2 --state-dir "$STATE" >"$TMP/head.log" 2>&1 &
    head_pid=$!
    PIDS+=($head_pid)
    wait_for "$TMP/head.log" "joined the cluster" 10
    ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/head.log" | head -1)
    start_agent n2 --cpus 2
    agent_pid=${PIDS[-1]}
    run 0 "$TWK" node stop
    [ "$(grep -c 'stopped the node' "$TMP/out")" -eq 2 ] || { cat "$TMP/out"; fail "not both nodes stopped"; }
    for p in $head_pid $agent_pid; do
      wait "$p" 2>/dev/null
      [ ! -e "/proc/$p" ] || grep -q '^[0-9]* ([^)]*) Z' "/proc/$p/stat" || fail "node $p still runs"
    done
    run 2 "$TWK" node stop
    expect_err "no node of this user runs on this machine"
    ;;

  dashboard_api)
    # The dashboard's API (issue 23) refuses what a browser of another site, a stranger or another
    # user might try: no session 401; a foreign Host; a used, forged or expired login link; a
    # change without the session's CSRF token or from another Origin 403; alice's session cannot
    # stop bob's job, an admin's can.
    mkdir -p "$TMP/keys"
    run 0 "$TWK" keygen --out "$TMP/keys/head" --name the-head
    for who in node alice bob carol; do run 0 "$TWK" keygen --out "$TMP/keys/$who" --name "$who"; done
    for who in node alice bob; do cat "$TMP/keys/$who/twinkle.pub"; done >"$TMP/keys/allow"
    echo "$(cat "$TMP/keys/carol/twinkle.pub") admin" >>"$TMP/keys/allow"
    start_head --key "$TMP/keys/head/twinkle.key" --authorized-keys "$TMP/keys/allow" --dashboard 0
    wait_for "$TMP/head.log" "dashboard on http://127.0.0.1:" 10
    WEB=$(grep -o 'dashboard on http://127.0.0.1:[0-9]*' "$TMP/head.log" | tail -1 | sed 's/dashboard on //')
    as() { echo --key "$TMP/keys/$1/twinkle.key" --head-key "$TMP/keys/head/twinkle.pub"; }
    start_agent n1 --cpus 8 $(as node)
    # code METHOD PATH [CURL ARGS...]: the HTTP status; the body in $TMP/body.
    code() {
      local m=$1 p=$2; shift 2
      [ "$m" = POST ] && set -- -H "Content-Type: application/json" --data '{}' "$@"
      curl -s -o "$TMP/body" -w '%{http_code}' -X "$m" "$@" "$WEB$p"
    }
    # login USER: USER's session: its cookie in $TMP/USER.jar, its key (from the redirect's
    # fragment) in $TMP/USER.key.
    login() {
      run 0 "$TWK" dashboard --address "$ADDR" $(as "$1")
      local link went
      link=$(grep -o 'http://127.0.0.1:[0-9]*/login?token=[0-9a-f]*' "$TMP/out")
      [ -n "$link" ] || { cat "$TMP/out"; fail "twinkle dashboard printed no link"; }
      echo "$link" >"$TMP/$1.link"
      # The link asks first (and uses nothing up: asked twice, it still works) ...
      for _ in 1 2; do
        [ "$(curl -s -o "$TMP/body" -w '%{http_code}' "$link")" = 200 ] &&
          grep -q "as <strong>$1</strong>" "$TMP/body" && grep -q 'method="post"' "$TMP/body" ||
          { cat "$TMP/body"; fail "$1's login link does not ask to log in as $1"; }
      done
      # ... and its form's POST, from the dashboard's own page, logs in.
      went=$(curl -s -o /dev/null -w '%{http_code} %{redirect_url}' -c "$TMP/$1.jar" \
        -H "Origin: $WEB" --data "token=${link##*token=}" "$WEB/login")
      [ "${went%% *}" = 303 ] || fail "$1's login link did not log in: $went"
      sed -n 's|.*/#key=\([0-9a-f]\{64\}\)$|\1|p' <<<"$went" >"$TMP/$1.key"
      [ -s "$TMP/$1.key" ] || fail "the login's redirect carries no key: $went"
      grep -q "twinkle_session_${WEB##*:}" "$TMP/$1.jar" || fail "no session cookie for $1"
    }
    # web USER: curl's arguments for USER's session.
    web() { echo -b "$TMP/$1.jar" -H "X-Twinkle-Key:$(cat "$TMP/$1.key")"; }  # no spaces
    [ "$(code GET /api/v1/session)" = 401 ] || { cat "$TMP/body"; fail "no cookie: not 401"; }
    grep -q "twinkle dashboard" "$TMP/body" || fail "the 401 does not say how to log in"
    [ "$(code GET /)" = 200 ] && grep -q '<script src="/app.js"' "$TMP/body" || fail "no page at /"
    [ "$(code GET / -H "Host: attacker.example:${WEB##*:}")" = 421 ] || fail "a foreign Host was served"
    [ "$(code POST / --data x)" = 405 ] || fail "a POST to the page was not refused"
    login alice
    token=$(sed 's/.*token=//' "$TMP/alice.link")
    [ "$(code POST /login -H "Origin: $WEB" --data "token=$token")" = 403 ] ||
      fail "a used link logged in again"
    grep -q "used already or has expired" "$TMP/body" || fail "the refusal does not say why"
    [ "$(code GET "/login?token=$token")" = 403 ] || fail "a used link still asks to log in"
    [ "$(code GET /login?token=0123456789abcdef)" = 403 ] || fail "a forged link was not refused"
    # Another site's page cannot log a browser in to a session of its own choosing.
    run 0 "$TWK" dashboard --address "$ADDR" $(as bob)
    token=$(grep -o 'login?token=[0-9a-f]*' "$TMP/out" | sed 's/.*token=//')
    [ "$(code POST /login -H "Origin: http://attacker.example" --data "token=$token")" = 403 ] &&
      grep -q Origin "$TMP/body" || fail "a login from another site's page was let in"
    [ "$(code POST /login --data "token=$token")" = 403 ] || fail "a login without an Origin was let in"
    [ "$(code GET /api/v1/session -b "$TMP/alice.jar")" = 401 ] || fail "the cookie without the key was let in"
    [ "$(code GET /api/v1/session -H "X-Twinkle-Key: $(cat "$TMP/alice.key")")" = 401 ] ||
      fail "the key without the cookie was let in"
    [ "$(code GET /api/v1/session $(web alice))" = 200 ] || fail "alice's session is refused"
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); sys.exit(0 if s["user"]=="alice" and not s["admin"] and len(s["csrf"])==64 else 1)' "$TMP/body" ||
      { cat "$TMP/body"; fail "alice's session is not alice's"; }
    csrf=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["csrf"])' "$TMP/body")
    [ "$(code GET /api/v1/cluster $(web alice))" = 200 ] && grep -q '"id":"n1"' "$TMP/body" ||
      { cat "$TMP/body"; fail "the cluster view lacks node n1"; }
    # bob's running job.
    fixture_dir h hang
    MEMBER=($(as bob))
    id=$(submit_id "$TMP/h/job.toml")
    wait_state "$id" RUNNING 20
    [ "$(code GET "/api/v1/jobs" $(web alice))" = 200 ] && grep -q "\"id\":$id" "$TMP/body" ||
      { cat "$TMP/body"; fail "alice does not see bob's job"; }
    [ "$(code GET "/api/v1/jobs/$id" $(web alice))" = 200 ] && grep -q '"user":"bob"' "$TMP/body" ||
      { cat "$TMP/body"; fail "the job's page is not bob's job"; }
    # Prometheus' text format, for a session too.
    [ "$(code GET /metrics)" = 401 ] || fail "/metrics without a session was not refused"
    [ "$(code GET /metrics $(web alice))" = 200 ] || fail "/metrics refused alice"
    for m in 'twinkle_nodes{state="ALIVE"} 1' 'twinkle_cpus{state="free"} 2' \
             "twinkle_jobs{state=\"RUNNING\",user=\"bob\"} 1" 'twinkle_gpus{state="used"} 0'; do
      grep -qxF "$m" "$TMP/body" || { cat "$TMP/body"; fail "/metrics lacks: $m"; }
    done
    origin=(-H "Origin: $WEB")
    [ "$(code POST "/api/v1/jobs/$id/stop" $(web alice) "${origin[@]}")" = 403 ] ||
      fail "a stop without the CSRF token was not refused"
    grep -q CSRF "$TMP/body" || fail "the refusal does not name the CSRF token"
    [ "$(code POST "/api/v1/jobs/$id/stop" $(web alice) -H "X-CSRF-Token: $csrf" "${origin[@]}")" = 403 ] ||
      { cat "$TMP/body"; echo; fail "alice stopped bob's job"; }
    grep -q "you (alice) may stop only your own jobs" "$TMP/body" || { cat "$TMP/body"; fail "the refusal does not say why"; }
    [ "$(job_field "$id" state)" = RUNNING ] || fail "alice's refused stop changed the job"
    [ "$(code POST "/api/v1/jobs/$id/rerun" $(web alice) -H "X-CSRF-Token: $csrf" "${origin[@]}")" = 403 ] &&
      grep -q "you re-run only your own" "$TMP/body" || { cat "$TMP/body"; fail "alice re-ran bob's job"; }
    login carol
    [ "$(code GET /api/v1/session $(web carol))" = 200 ] || fail "carol's session is refused"
    ccsrf=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["csrf"])' "$TMP/body")
    [ "$(code POST "/api/v1/jobs/$id/stop" $(web carol) -H "X-CSRF-Token: $csrf" "${origin[@]}")" = 403 ] ||
      fail "carol's session took alice's CSRF token"
    # Carol may stop it; only the Origin can be why these are refused.
    [ "$(code POST "/api/v1/jobs/$id/stop" $(web carol) -H "X-CSRF-Token: $ccsrf" -H "Origin: http://attacker.example")" = 403 ] &&
      grep -q Origin "$TMP/body" || fail "a stop from another Origin was not refused"
    [ "$(code POST "/api/v1/jobs/$id/stop" $(web carol) -H "X-CSRF-Token: $ccsrf")" = 403 ] &&
      grep -q Origin "$TMP/body" || fail "a stop without an Origin was not refused"
    [ "$(job_field "$id" state)" = RUNNING ] || fail "a refused stop changed the job"
    [ "$(code POST "/api/v1/jobs/$id/stop" $(web carol) -H "X-CSRF-Token: $ccsrf" "${origin[@]}")" = 200 ] ||
      { cat "$TMP/body"; fail "the admin could not stop bob's job"; }
    wait_state "$id" STOPPED 60
    run 0 "$TWK" job show "$id" --address "$ADDR" $(as bob)
    expect_out "stopped by carol"
    # Resume: the owner's or an admin's; this job has no checkpoint to go on from.
    [ "$(code POST "/api/v1/jobs/$id/resume" $(web alice) -H "X-CSRF-Token: $csrf" "${origin[@]}")" = 403 ] &&
      grep -q "you (alice) may resume only your own jobs" "$TMP/body" || { cat "$TMP/body"; fail "alice resumed bob's job"; }
    [ "$(code POST "/api/v1/jobs/$id/resume" $(web carol) -H "X-CSRF-Token: $ccsrf" "${origin[@]}")" = 400 ] &&
      grep -q "has no checkpoint_dir, so it has nothing to resume from" "$TMP/body" ||
      { cat "$TMP/body"; fail "a job without checkpoints was resumed"; }
    [ "$(job_field "$id" state)" = STOPPED ] || fail "a refused resume changed the job"
    [ "$(code GET "/api/v1/jobs/$id/logs?tail=5" $(web carol))" = 200 ] && grep -q '"ended":true' "$TMP/body" ||
      { cat "$TMP/body"; fail "the job's log is not there"; }
    ;;

  dashboard_expired)
    # A login link is good for a limited time (60 s; here 0 s): after that it fails, saying why.
    # Where there is a desktop, twinkle dashboard hands it to xdg-open too.
    TWINKLE_TEST_DASHBOARD_LINK_S=0 start_head --dashboard 0
    wait_for "$TMP/head.log" "dashboard on http://127.0.0.1:" 10
    run 0 "$TWK" dashboard --address "$ADDR"
    link=$(grep -o 'http://127.0.0.1:[0-9]*/login?token=[0-9a-f]*' "$TMP/out")
    [ "$(curl -s -o "$TMP/body" -w '%{http_code}' "$link")" = 403 ] || fail "an expired link asked to log in"
    grep -q "used already or has expired" "$TMP/body" || fail "the refusal does not say why"
    web=${link%%/login*}
    [ "$(curl -s -o "$TMP/body" -w '%{http_code}' -H "Origin: $web" --data "token=${link##*token=}" "$web/login")" = 403 ] ||
      fail "an expired link logged in"
    grep -q "used already or has expired" "$TMP/body" || fail "the refusal does not say why"
    # Where there is a desktop the link also goes to xdg-open (here a stand-in that keeps it).
    mkdir -p "$TMP/bin"
    printf '#!/bin/sh\necho "$1" >"%s/opened.tmp" && mv "%s/opened.tmp" "%s/opened"\n' "$TMP" "$TMP" "$TMP" >"$TMP/bin/xdg-open"
    chmod +x "$TMP/bin/xdg-open"
    DISPLAY=:9 PATH="$TMP/bin:$PATH" run 0 "$TWK" dashboard --address "$ADDR"
    expect_out "handed to your browser with xdg-open"
    wait_for "$TMP/opened" "$(grep -o 'http://127.0.0.1:[0-9]*/login?token=[0-9a-f]*' "$TMP/out")" 10
    DISPLAY=:9 PATH="$TMP/bin:$PATH" run 0 "$TWK" dashboard --no-open --address "$ADDR"
    ! grep -q "handed to your browser" "$TMP/out" || fail "--no-open handed the link to the browser"
    PATH="$TMP/bin:$PATH" run 0 "$TWK" dashboard --address "$ADDR"
    ! grep -q "handed to your browser" "$TMP/out" || fail "without a desktop the link went to xdg-open"
    # A dashboard elsewhere than loopback is refused, with the way to reach one from elsewhere.
    run 2 "$TWK" node start --head --no-agent --port 0 --dashboard 0.0.0.0:8265 --state-dir "$TMP/s2"
    expect_err "the dashboard serves loopback only"
    expect_err "give --tls-cert FILE --tls-key FILE"
    expect_err "ssh -L 8265:127.0.0.1:8265"
    for a in 127.0.0.2:8265 127.0.0.1.example:8265 127.evil:8265; do
      run 2 "$TWK" node start --head --no-agent --port 0 --dashboard "$a" --state-dir "$TMP/s2"
      expect_err "the dashboard serves loopback only"
    done
    ;;

  dashboard_work)
    # The page's work through the API (issue 23): the topology's preview (errors with line and
    # column), a submit of a folder's files (multipart) that runs, its log as Server-Sent
    # Events, searched and downloaded, and a re-run; what a submit may not bring is refused.
    start_head --dashboard 0
    start_agent n1 --cpus 8
    web_session
    # api METHOD PATH [CURL ARGS...]: the HTTP status; the body in $TMP/body.
    api() {
      local m=$1 p=$2; shift 2
      curl -s -o "$TMP/body" -w '%{http_code}' -X "$m" "${change[@]}" "$@" "$WEB/api/v1$p"
    }
    field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$TMP/body" "$1"; }
    fixture_dir t talk
    # The preview: the diagram of `twinkle topology`, with every rank on n1.
    python3 -c 'import json,sys; print(json.dumps({"job_file": "job.toml", "job_text": open(sys.argv[1]).read(), "overrides": ["group.b.ranks=1", "group.b.mesh.pp=1"]}))' \
      "$TMP/t/job.toml" >"$TMP/preview.json"
    [ "$(api POST /topology -H "Content-Type: application/json" --data @"$TMP/preview.json")" = 200 ] ||
      { cat "$TMP/body"; fail "the preview was refused"; }
    field text >"$TMP/topology.txt"
    grep -q "DEVICE PLACEMENT TOPOLOGY" "$TMP/topology.txt" && grep -q "DeviceGroup: a" "$TMP/topology.txt" &&
      grep -q "4 workers on n1" "$TMP/topology.txt" && grep -q "1 node (planned)" "$TMP/topology.txt" ||
      { cat "$TMP/topology.txt"; fail "the preview is not the job's topology on n1"; }
    grep -q "Ranks       : \[4\] " "$TMP/topology.txt" ||
      { cat "$TMP/topology.txt"; fail "the preview did not take the override group.b.ranks=1"; }
    # A job file with a mistake: the error names the file, line and column.
    printf '[job]\nname = "x"\nplugin = 7\n' >"$TMP/bad.toml"
    python3 -c 'import json,sys; print(json.dumps({"job_file": "sub/job.toml", "job_text": open(sys.argv[1]).read()}))' \
      "$TMP/bad.toml" >"$TMP/preview.json"
    [ "$(api POST /topology -H "Content-Type: application/json" --data @"$TMP/preview.json")" = 400 ] ||
      { cat "$TMP/body"; fail "a job file with a mistake was previewed"; }
    grep -q '"error":"sub/job.toml:3:' "$TMP/body" || { cat "$TMP/body"; fail "the error lacks file:line:col"; }
    # A submit from the form: the folder's files, each part named in meta.paths.
    mkdir -p "$TMP/t/data"
    echo "some data" >"$TMP/t/data/input.txt"
    meta='{"job_file": "job.toml", "name": "from-web", "overrides": ["args.tag=web"], "paths": ["job.toml", "data/input.txt"]}'
    [ "$(api POST /submit -F "meta=$meta" -F "file=@$TMP/t/job.toml" -F "file=@$TMP/t/data/input.txt")" = 200 ] ||
      { cat "$TMP/body"; fail "the form's submit was refused"; }
    id=$(field job)
    wait_state "$id" SUCCEEDED 60
    [ "$(job_field "$id" name)" = from-web ] || fail "the submit's name was not kept"
    # Where it ran, drawn as `twinkle topology` draws a run.
    [ "$(api GET "/jobs/$id/topology")" = 200 ] || { cat "$TMP/body"; fail "the job's topology was refused"; }
    field text >"$TMP/ran.txt"
    grep -q "DeviceGroup: b" "$TMP/ran.txt" && grep -q "4 workers on n1" "$TMP/ran.txt" &&
      grep -q "1 node (reserved)" "$TMP/ran.txt" || { cat "$TMP/ran.txt"; fail "the job's topology is not where it ran"; }
    [ "$(job_field "$id" overrides)" = "['args.tag=web']" ] || fail "the submit's overrides were not kept: $(job_field "$id" overrides)"
    sha=$(curl -s "${auth[@]}" "$WEB/api/v1/jobs/$id" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("sha256",""))')
    [ -n "$sha" ] && [ -f "$STATE/uploads/$sha.tar" ] || fail "the head does not hold the submit's working directory"
    tar -tf "$STATE/uploads/$sha.tar" | grep -qx "data/input.txt" || fail "the archive lacks data/input.txt"
    # The log as Server-Sent Events: every line, then "end" (the job has ended).
    timeout 20 curl -s -N "${auth[@]}" "$WEB/api/v1/jobs/$id/events" >"$TMP/events" ||
      { cat "$TMP/events"; fail "the event stream did not end with the job"; }
    grep -q '^event: log$' "$TMP/events" && grep -q '^event: end$' "$TMP/events" ||
      { cat "$TMP/events"; fail "the stream lacks its log and end events"; }
    python3 - "$TMP/events" >"$TMP/streamed" <<'PY' || fail "the stream's events do not read"
import json, sys
event = None
for line in open(sys.argv[1]):
    line = line.rstrip("\n")
    if line.startswith("event: "): event = line[7:]
    elif line.startswith("data: ") and event == "log": sys.stdout.write(json.loads(line[6:])["text"])
PY
    run 0 "$TWK" logs "$id" --address "$ADDR"
    cmp -s "$TMP/streamed" "$TMP/out" || { diff "$TMP/streamed" "$TMP/out"; fail "the stream is not the job's log"; }
    timeout 20 curl -s -N "${auth[@]}" "$WEB/api/v1/jobs/$id/events?rank=a:2" >"$TMP/events"
    [ "$(grep -c 'SAY a:2 line' "$TMP/events")" -eq 1 ] && ! grep -q "SAY a:1" "$TMP/events" ||
      { cat "$TMP/events"; fail "rank=a:2 streams other ranks' lines"; }
    # Search: the count, and the lines around each match.
    [ "$(api GET "/jobs/$id/search?q=SAY%20a:2%20line&context=1")" = 200 ] || { cat "$TMP/body"; fail "the search was refused"; }
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); m=r["matches"]
sys.exit(0 if r["count"]==3 and r["shown"]==3 and all("SAY a:2 line" in x["text"] and len(x["before"])==1 for x in m) else 1)' "$TMP/body" ||
      { cat "$TMP/body"; fail "the search did not find a:2's 3 lines with a line before each"; }
    [ "$(api GET "/jobs/$id/search?q=line&rank=a:1")" = 200 ] && [ "$(field count)" = 3 ] ||
      { cat "$TMP/body"; fail "the search with rank=a:1 did not count its 3 lines"; }
    # The text is plain text: "(a*)*b" is looked for as it is, and cannot make a search slow.
    [ "$(api GET "/jobs/$id/search?q=(a*)*b")" = 200 ] && [ "$(field count)" = 0 ] ||
      { cat "$TMP/body"; fail "q=(a*)*b was not searched for as text"; }
    [ "$(api GET "/jobs/$id/search")" = 400 ] || { cat "$TMP/body"; fail "a search without q was taken"; }
    # Download: the whole log as a file.
    curl -s -D "$TMP/headers" -o "$TMP/download" "${auth[@]}" "$WEB/api/v1/jobs/$id/log"
    grep -qi "content-disposition: attachment; filename=\"job-$id.log\"" "$TMP/headers" ||
      { cat "$TMP/headers"; fail "the download is not an attachment job-$id.log"; }
    cmp -s "$TMP/download" "$TMP/out" || fail "the download is not the job's log"
    # Re-run: the same working directory and overrides, a new job that runs.
    [ "$(api POST "/jobs/$id/rerun" -H "Content-Type: application/json" --data '{}')" = 200 ] ||
      { cat "$TMP/body"; fail "the re-run was refused"; }
    again=$(field job)
    [ "$again" != "$id" ] || fail "the re-run has the job's own id"
    wait_state "$again" SUCCEEDED 60
    [ "$(job_field "$again" overrides)" = "['args.tag=web']" ] || fail "the re-run lost the overrides"
    [ "$(job_field "$again" name)" = from-web ] || fail "the re-run lost the name"
    # What a submit may not bring.
    [ "$(api POST /submit -F 'meta={"job_file": "job.toml", "paths": ["../escape.toml"]}' -F "file=@$TMP/t/job.toml")" = 400 ] &&
      grep -q "not a path inside the working directory" "$TMP/body" || { cat "$TMP/body"; fail "a path out of the folder was taken"; }
    [ ! -e "$STATE/dashboard/escape.toml" ] && [ ! -e "$STATE/escape.toml" ] || fail "a file was written outside the upload"
    [ "$(api POST /submit -F 'meta={"job_file": "other.toml", "paths": ["job.toml"]}' -F "file=@$TMP/t/job.toml")" = 400 ] &&
      grep -q 'the job file \\"other.toml\\" is not among the files sent' "$TMP/body" || { cat "$TMP/body"; fail "a missing job file was not refused"; }
    [ "$(api POST /submit -F "file=@$TMP/t/job.toml")" = 400 ] || { cat "$TMP/body"; fail "a form without meta was taken"; }
    [ "$(api POST /submit -F 'meta={"paths": ["job.toml"]}' -F "file=@$TMP/bad.toml;filename=job.toml")" = 400 ] &&
      grep -q 'job.toml:3:' "$TMP/body" || { cat "$TMP/body"; fail "a job file with a mistake was queued"; }
    head -c 100000 /dev/zero >"$TMP/big"
    [ "$(api POST "/jobs/$id/stop" -H "Content-Type: application/json" --data-binary @"$TMP/big")" = 413 ] ||
      { cat "$TMP/body"; fail "a 100 kB body to stop was read"; }
    [ "$(api PUT /submit --data-binary @"$TMP/big")" = 413 ] || { cat "$TMP/body"; fail "a PUT took the submit's limit"; }
    [ "$(api POST "/jobs/$id/stop" -H "Content-Encoding: gzip" --data-binary '{}')" = 415 ] ||
      { cat "$TMP/body"; fail "a compressed body was taken"; }
    [ "$(curl -s -o "$TMP/body" -w '%{http_code}' "${change[@]}" -X POST -H "Content-Length:" "$WEB/api/v1/jobs/$id/stop")" = 411 ] ||
      { cat "$TMP/body"; fail "a POST without a Content-Length was read"; }
    # A line that is not UTF-8 reaches the live log (as U+FFFD), and the head lives on.
    fixture_dir r relay
    sed -i "s|^tag = \"t\"|tag = \"t\"\nrelay_file = \"$TMP/relay\"|" "$TMP/r/job.toml"
    relay=$(submit_id "$TMP/r/job.toml")
    wait_state "$relay" RUNNING 30
    printf 'bytes \377\376 here\n' >"$TMP/relay"
    # (grep stops at the line, and curl then ends on SIGPIPE: only grep's status counts.)
    { timeout 20 curl -s -N "${auth[@]}" "$WEB/api/v1/jobs/$relay/events" || true; } |
      grep -a -m1 "RELAY bytes" >"$TMP/relayed" || fail "the line that is not UTF-8 did not reach the live log"
    grep -q $'RELAY bytes \xef\xbf\xbd\xef\xbf\xbd here' "$TMP/relayed" || { cat -v "$TMP/relayed"; fail "the bytes did not become U+FFFD"; }
    [ "$(api GET /session)" = 200 ] || fail "the dashboard is gone after a line that is not UTF-8"
    run 0 "$TWK" stop "$relay" --now --address "$ADDR"
    wait_state "$relay" STOPPED 30
    [ -z "$(ls -A "$STATE/dashboard" 2>/dev/null)" ] || { ls -R "$STATE/dashboard"; fail "the submits left files behind"; }
    ;;

  dashboard_tls)
    # Another address than loopback only over HTTPS: with a certificate the dashboard serves
    # https on 127.0.0.2 (logins, Secure cookies), under the certificate's name with
    # --dashboard-name; without one, or with a bad one, the head refuses to start and says how.
    run 2 "$TWK" node start --head --no-agent --port 0 --dashboard 127.0.0.2:0 --state-dir "$TMP/s2"
    expect_err "give --tls-cert FILE --tls-key FILE"
    echo "not a certificate" >"$TMP/junk.pem"
    run 2 "$TWK" node start --head --no-agent --port 0 --dashboard 127.0.0.2:0 --tls-cert "$TMP/junk.pem" \
      --tls-key "$TMP/junk.pem" --state-dir "$TMP/s2"
    expect_err "not a PEM certificate and its private key"
    run 2 "$TWK" node start --head --no-agent --port 0 --dashboard 127.0.0.2:0 --tls-cert "$TMP/junk.pem" --state-dir "$TMP/s2"
    expect_err "--tls-cert and --tls-key go together"
    command -v openssl >/dev/null || { echo "openssl is missing"; exit 77; }
    openssl req -x509 -newkey rsa:2048 -nodes -days 1 -keyout "$TMP/key.pem" -out "$TMP/cert.pem" \
      -subj /CN=127.0.0.2 -addext subjectAltName=IP:127.0.0.2 2>"$TMP/openssl.err" ||
      { cat "$TMP/openssl.err"; fail "openssl made no certificate"; }
    start_head --dashboard 127.0.0.2:0 --tls-cert "$TMP/cert.pem" --tls-key "$TMP/key.pem"
    wait_for "$TMP/head.log" "dashboard on https://127.0.0.2:" 10
    WEB=$(grep -o 'dashboard on https://127.0.0.2:[0-9]*' "$TMP/head.log" | tail -1 | sed 's/dashboard on //')
    run 0 "$TWK" dashboard --address "$ADDR"
    link=$(grep -o 'https://127.0.0.2:[0-9]*/login?token=[0-9a-f]*' "$TMP/out")
    [ -n "$link" ] || { cat "$TMP/out"; fail "twinkle dashboard printed no https link"; }
    [ "$(curl -s --cacert "$TMP/cert.pem" -o "$TMP/body" -w '%{http_code}' "$link")" = 200 ] ||
      fail "the https login link does not answer"
    curl -s -D "$TMP/headers" -o /dev/null --cacert "$TMP/cert.pem" -H "Origin: $WEB" \
      --data "token=${link##*token=}" "$WEB/login"
    grep -qi '^set-cookie: twinkle_session_[0-9]*=[0-9a-f]*; HttpOnly; SameSite=Strict; Path=/; Secure' "$TMP/headers" ||
      { cat "$TMP/headers"; fail "the session cookie over https is not Secure"; }
    # The Origin of a page of this server is https://, not http://.
    run 0 "$TWK" dashboard --address "$ADDR"
    link=$(grep -o 'https://127.0.0.2:[0-9]*/login?token=[0-9a-f]*' "$TMP/out")
    [ "$(curl -s --cacert "$TMP/cert.pem" -o "$TMP/body" -w '%{http_code}' -H "Origin: http://${WEB#https://}" \
      --data "token=${link##*token=}" "$WEB/login")" = 403 ] || fail "an http:// Origin logged in over https"
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://${WEB#https://}/")" != 200 ] || fail "plain http was served"
    # The certificate's name (--dashboard-name): the Host browsers send, and the links' name.
    kill "$HEAD_PID"; wait "$HEAD_PID" 2>/dev/null
    mv "$TMP/head.log" "$TMP/head-1.log"
    HEAD_PORT=
    openssl req -x509 -newkey rsa:2048 -nodes -days 1 -keyout "$TMP/key2.pem" -out "$TMP/cert2.pem" \
      -subj /CN=head.twinkle.test -addext subjectAltName=DNS:head.twinkle.test 2>"$TMP/openssl.err" ||
      { cat "$TMP/openssl.err"; fail "openssl made no certificate"; }
    start_head --dashboard 127.0.0.2:0 --tls-cert "$TMP/cert2.pem" --tls-key "$TMP/key2.pem" \
      --dashboard-name head.twinkle.test
    wait_for "$TMP/head.log" "dashboard on https://head.twinkle.test:" 10
    port=$(grep -o 'dashboard on https://head.twinkle.test:[0-9]*' "$TMP/head.log" | tail -1 | sed 's/.*://')
    run 0 "$TWK" dashboard --address "$ADDR"
    link=$(grep -o 'https://head.twinkle.test:[0-9]*/login?token=[0-9a-f]*' "$TMP/out")
    [ -n "$link" ] || { cat "$TMP/out"; fail "the link does not use the certificate's name"; }
    at=(--cacert "$TMP/cert2.pem" --resolve "head.twinkle.test:$port:127.0.0.2")
    [ "$(curl -s "${at[@]}" -o "$TMP/body" -w '%{http_code}' "$link")" = 200 ] ||
      { cat "$TMP/body"; fail "the certificate's name is not one of the dashboard's"; }
    [ "$(curl -s "${at[@]}" -o "$TMP/body" -w '%{http_code}' -H "Host: other.twinkle.test:$port" "$link")" = 421 ] ||
      fail "a name not given was served"
    run 2 "$TWK" node start --head --no-agent --port 0 --dashboard-name x.test --state-dir "$TMP/s2"
    expect_err "give --dashboard too"
    ;;

  dashboard_gpu)
    # GPU use as the agents sample it through NVML: here the tests' stand-in libnvidia-ml.so.1
    # (tests/fixtures/nvml), loaded by node g1's agent only, reporting what $TMP/nvml says. The
    # cluster view and /metrics show each GPU's use and follow it as it changes, with the run
    # holding it; a node without NVML shows none (never a made-up number).
    NVML_DIR=$(nvml_dir) || exit 1
    printf '37 1073741824\n5 0\n' >"$TMP/nvml"
    start_head --dashboard 0
    start_agent n1 --cpus 4
    TWINKLE_FAKE_NVML="$TMP/nvml" LD_LIBRARY_PATH="$NVML_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      start_agent g1 --cpus 4
    web_session
    # gpu_use NODE INDEX: "UTIL MEMORY_USED RUN" of that GPU in the cluster view ("none" unsampled).
    gpu_use() {
      curl -s "${auth[@]}" "$WEB/api/v1/cluster" | python3 -c 'import json,sys
n = {x["id"]: x for x in json.load(sys.stdin)["nodes"]}[sys.argv[1]]
g = [g for g in n["gpus"] if g["index"] == int(sys.argv[2])]
print("none" if not g or "util" not in g[0] else "%d %d %s" % (g[0]["util"], g[0]["memory_used"], g[0]["run"] or "-"))' "$1" "$2"
    }
    # until_use NODE INDEX WANT: waits (10 s at most) for the GPU's use to read WANT.
    until_use() {
      local deadline=$((SECONDS + 10)) got
      while got=$(gpu_use "$1" "$2"); [ "$got" != "$3" ]; do
        [ $SECONDS -lt $deadline ] || fail "GPU $2 of $1 reads \"$got\", not \"$3\", after 10 s"
        sleep 0.1
      done
    }
    until_use g1 0 "37 1073741824 -"
    until_use g1 1 "5 0 -"
    run 0 "$TWK" nodes --json --address "$ADDR"
    python3 -c 'import json,sys; n={x["id"]: x for x in json.load(open(sys.argv[1]))["nodes"]}
sys.exit(0 if [g["name"] for g in n["g1"]["gpus"]] == ["Test GPU 0", "Test GPU 1"] and n["n1"]["gpus"] == [] else 1)' "$TMP/out" ||
      { cat "$TMP/out"; fail "g1 does not have the 2 GPUs NVML lists, or n1 has GPUs"; }
    curl -s "${auth[@]}" "$WEB/metrics" >"$TMP/metrics"
    for m in 'twinkle_gpu_utilization_percent{node="g1",gpu="0",run=""} 37' \
             'twinkle_gpu_memory_used_bytes{node="g1",gpu="0",run=""} 1073741824' \
             'twinkle_gpu_utilization_percent{node="g1",gpu="1",run=""} 5'; do
      grep -qxF "$m" "$TMP/metrics" || { cat "$TMP/metrics"; fail "/metrics lacks: $m"; }
    done
    ! grep -q 'node="n1"' "$TMP/metrics" || fail "/metrics reports GPU use for n1, which samples none"
    # A job on one GPU of g1: the GPU's use is that run's, and follows what NVML says.
    fixture_dir h hang
    sed -i 's/^ranks = 4$/ranks = 1\ndevice = "cuda"/; s/^mesh = { dp = 2, tp = 2 }$/mesh = { dp = 1 }/' "$TMP/h/job.toml"
    id=$(submit_id "$TMP/h/job.toml")
    wait_state "$id" RUNNING 30
    run_id=$(job_field "$id" run)
    printf '81 2147483648\n5 0\n' >"$TMP/nvml"
    until_use g1 0 "81 2147483648 $run_id"
    curl -s "${auth[@]}" "$WEB/metrics" >"$TMP/metrics"
    grep -qxF "twinkle_gpu_utilization_percent{node=\"g1\",gpu=\"0\",run=\"$run_id\"} 81" "$TMP/metrics" ||
      { cat "$TMP/metrics"; fail "/metrics lacks the job's GPU at 81%"; }
    run 0 "$TWK" stop "$id" --now --address "$ADDR"
    wait_state "$id" STOPPED 30
    ;;

  dashboard_browser)
    # The dashboard in Debian's chromium, driven by playwright-core (tests/browser/dashboard.mjs):
    # log in with the link, 3 nodes on the Cluster view, a running job on the Jobs view, a line
    # its worker prints in the live log within 2 s, Stop now -> STOPPED and its devices free.
    # Screenshots of every view in the build's meson-logs/dashboard/. 77 without chromium or node.
    BROWSER="$SRC/tests/browser"
    { [ -x /usr/bin/chromium ] && command -v node >/dev/null &&
      [ -d "$BROWSER/node_modules/playwright-core" ]; } || {
      echo "chromium, node or tests/browser/node_modules (npm ci) is missing: .ci/install-deps --tests"
      exit 77
    }
    SHOTS="$(dirname "$EXAMPLES")/meson-logs/dashboard"  # the build's test output
    mkdir -p "$SHOTS"
    start_head --dashboard 0
    wait_for "$TMP/head.log" "dashboard on http://127.0.0.1:" 10
    for n in n1 n2; do start_agent "$n" --cpus 4; done
    # n3 samples 2 GPUs through the tests' stand-in NVML (see dashboard_gpu).
    printf '37 1073741824\n5 0\n' >"$TMP/nvml"
    NVML_DIR=$(nvml_dir) || exit 1
    TWINKLE_FAKE_NVML="$TMP/nvml" LD_LIBRARY_PATH="$NVML_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      start_agent n3 --cpus 4
    fixture_dir r relay
    sed -i "s|^tag = \"t\"|tag = \"t\"\nrelay_file = \"$TMP/relay\"|" "$TMP/r/job.toml"
    id=$(submit_id "$TMP/r/job.toml")
    wait_state "$id" RUNNING 30
    # The hello example's folder, which the page's form uploads.
    mkdir -p "$TMP/hello"
    cp "$SRC/examples/hello/job.toml" "$EXAMPLES/hello/libhello.so" "$TMP/hello/"
    run 0 "$TWK" dashboard --address "$ADDR"
    link=$(grep -o 'http://127.0.0.1:[0-9]*/login?token=[0-9a-f]*' "$TMP/out")
    node "$BROWSER/dashboard.mjs" "$link" "$id" "$TMP/relay" "$SHOTS" "$TMP/hello" n1 n2 n3 ||
      { cat "$TMP/head.log"; fail "the browser test failed"; }
    wait_state "$id" STOPPED 20
    for f in cluster jobs job job-stopped cluster-after-stop submit job-hello search rerun; do
      [ -s "$SHOTS/$f.png" ] || fail "no screenshot $f.png"
    done
    ;;

  teams_preempt)
    # Issue 24, test 1: teams a and b with quotas of 4 CPUs and 4 to borrow, on an 8-CPU node.
    # alice (a) runs an 8-worker digits, borrowing 4; bob (b) submits a 4-worker job within his
    # quota: alice's job checkpoints and is PREEMPTED, bob's runs; when it ends, alice's resumes
    # and ends with the final loss of an uninterrupted run.
    team_keys
    printf '[team.a]\ncpus = 4\nborrow_cpus = 4\n[team.b]\ncpus = 4\nborrow_cpus = 4\n' >"$TMP/quotas.toml"
    start_head "${KEYED[@]}" --quotas "$TMP/quotas.toml"
    start_agent n1 --cpus 8 $(as node)
    for d in ref big; do
      digits_dir "$d" 150 'checkpoint_dir = "ck"'
      sed -i 's/^ranks  = 4 .*/ranks  = 8/' "$TMP/$d/job.toml"
    done
    digits_dir small 400
    run 0 "$TWK" run --quiet "$TMP/ref/job.toml"
    want=$(final_loss "$TMP/out")
    [ -n "$want" ] || fail "no final loss in the reference run"
    MEMBER=($(as alice))
    big=$(submit_id "$TMP/big/job.toml")
    deadline=$((SECONDS + 60))
    until "$TWK" logs "$big" --grep '^epoch 2 ' --address "$ADDR" "${MEMBER[@]}" | grep -q epoch; do
      [ $SECONDS -lt $deadline ] || fail "alice's job did not reach epoch 2"
      sleep 0.1
    done
    show_jobs "1. alice's 8-worker job runs, 4 of its CPUs borrowed"
    until_reason "$big" "borrowing beyond team a's quota" 5
    MEMBER=($(as bob))
    small=$(submit_id "$TMP/small/job.toml")
    wait_state "$big" PREEMPTED 60
    # One snapshot: alice's job resumes as soon as bob's ends.
    step2=$(show_jobs "2. bob's job within team b's quota: alice's job is preempted")
    echo "$step2"
    grep -qF "preempted by job $small" <<<"$step2" || fail "job $big is not said to be preempted by job $small"
    wait_state "$small" SUCCEEDED 120
    show_jobs "3. bob's job ended: alice's resumes"
    wait_state "$big" SUCCEEDED 150
    show_jobs "4. alice's job ended with the uninterrupted run's final loss"
    run 0 "$TWK" logs "$big" --address "$ADDR" "${MEMBER[@]}"
    expect_out "stopping after epoch"
    expect_out "resumed after epoch"
    [ "$(grep -c '^final loss: ' "$TMP/out")" -eq 1 ] || { cat "$TMP/out"; fail "the preempted attempt did not stop mid-run"; }
    same_loss "$(final_loss "$TMP/out")" "$want"
    run 0 "$TWK" job show "$big" --address "$ADDR" "${MEMBER[@]}"
    cat "$TMP/out"
    expect_out "team       a"
    expect_out "preempted  1 time, last for job $small"
    grep -E ' head +preempt +for job '"$small"' of team b' "$TMP/out" || fail "the audit lacks the preemption"
    grep -E ' head +preempted +for job '"$small"'; driver exit code 75' "$TMP/out" || fail "the driver did not stop with 75 after its checkpoint"
    run 0 "$TWK" jobs --json --address "$ADDR" "${MEMBER[@]}"
    python3 -c 'import json,sys; j={x["id"]: x for x in json.load(open(sys.argv[1]))}; b=j[int(sys.argv[2])]
assert b["team"] == "a" and b["preemptions"] == 1 and b["preempted_by"] == int(sys.argv[3]), b' \
      "$TMP/out" "$big" "$small" || fail "jobs --json lacks the team or the preemption"
    ;;

  teams_quotas)
    # Issue 24, test 5, and the waiting reasons: a malformed quotas file is refused at start with
    # file:line:col; `twinkle quotas` shows each team; a reload (SIGHUP, `twinkle quotas reload`
    # by an admin) changes the queue's order; a malformed reload keeps the quotas; --priority is
    # bounded per team; a job larger than its team may ever hold is refused.
    team_keys
    printf '[team.a]\ncpus = 4\nweight = 0\n' >"$TMP/bad.toml"
    run 2 "$TWK" node start --head --no-agent --bind 127.0.0.1 --port 0 --state-dir "$TMP/s2" \
      "${KEYED[@]}" --quotas "$TMP/bad.toml"
    expect_err "bad.toml:3:10: team.a.weight must be a number above 0"
    run 2 "$TWK" node start --head --no-agent --bind 127.0.0.1 --port 0 --state-dir "$TMP/s2" \
      "${KEYED[@]}" --quotas "$TMP/missing.toml"
    expect_err "missing.toml: cannot read it"
    printf '[team.a]\ncpus = 6\n[team.b]\ncpus = 6\n[team.c]\ncpus = 6\n' >"$TMP/quotas.toml"
    start_head "${KEYED[@]}" --quotas "$TMP/quotas.toml"
    start_agent n1 --cpus 6 $(as node)
    fixture_dir h hang  # 6 workers
    MEMBER=($(as carol))
    blocker=$(submit_id "$TMP/h/job.toml" --name blocker)
    wait_state "$blocker" RUNNING 20
    MEMBER=($(as alice))
    a1=$(submit_id "$TMP/h/job.toml" --name a1)
    MEMBER=($(as bob))
    b1=$(submit_id "$TMP/h/job.toml" --name b1)
    until_reason "$a1" "waiting for devices" 10
    until_reason "$b1" "waiting behind job $a1" 10
    show_jobs "a1 goes first: both within quota, equal shares, a1 submitted first"
    run 0 "$TWK" quotas --address "$ADDR" "${MEMBER[@]}"
    cat "$TMP/out"
    grep -qE '^c +0 / - +0 / 0 +6 / 6 +0 / 0 .* 1 +0  carol$' "$TMP/out" || fail "quotas: team c does not hold 6 of its 6 CPUs"
    grep -qE '^a +0 / - +0 / 0 +0 / 6 .* 0 +1  alice$' "$TMP/out" || fail "quotas: team a has not 1 job waiting"
    # Team a may now hold 3 CPUs and borrow 3: a1 would borrow, so b1 (within quota) goes first.
    printf '[team.a]\ncpus = 3\nborrow_cpus = 3\n[team.b]\ncpus = 6\n[team.c]\ncpus = 6\n' >"$TMP/quotas.toml"
    run 1 "$TWK" quotas reload --address "$ADDR" $(as alice)
    expect_err "you (alice) may not reload the quotas"
    kill -HUP "$HEAD_PID"
    wait_for "$TMP/head.log" "read $TMP/quotas.toml again" 10
    until_reason "$b1" "waiting for devices" 10
    until_reason "$a1" "waiting behind job $b1" 10
    show_jobs "after SIGHUP: a1 would borrow, b1 goes first"
    # A malformed file is not taken: the quotas stay.
    printf '[team.a]\ncpus = "x"\n' >"$TMP/quotas.toml"
    run 1 "$TWK" quotas reload --address "$ADDR" $(as carol)
    expect_err "quotas.toml:2:8: team.a.cpus must be a whole number from 0 to"
    run 0 "$TWK" quotas --json --address "$ADDR" $(as carol)
    python3 -c 'import json,sys; t={x["name"]: x for x in json.load(open(sys.argv[1]))["teams"]}
assert t["a"]["cpus"] == 3 and t["a"]["borrow_cpus"] == 3 and t["c"]["used_cpus"] == 6, t' "$TMP/out" ||
      { cat "$TMP/out"; fail "a malformed reload changed the quotas"; }
    # --priority within the team's bound (10 by default); a job beyond what team a may ever hold.
    run 2 "$TWK" submit "$TMP/h/job.toml" --priority 50 --address "$ADDR" $(as alice)
    expect_err "--priority 50: team a may give -10 to 10"
    fixture_dir big hang
    sed -i 's/^ranks = 4$/ranks = 8/; s/dp = 2, tp = 2/dp = 4, tp = 2/' "$TMP/big/job.toml"
    run 2 "$TWK" submit "$TMP/big/job.toml" --address "$ADDR" $(as alice)
    expect_err "the job needs 10 CPUs, and team a may hold at most 6 (a quota of 3 and 3 to borrow)"
    # The blocker ends: b1 runs first, a1 waits behind it (it fits no more).
    run 0 "$TWK" stop "$blocker" --now --address "$ADDR" $(as carol)
    wait_state "$b1" RUNNING 20
    [ "$(job_field "$a1" state)" = QUEUED ] || fail "a1 is $(job_field "$a1" state), expected QUEUED"
    until_reason "$a1" "waiting: team a uses 0 of its 3 CPUs; it may borrow 3 more when the cluster has them free" 10
    show_jobs "b1 runs; a1 waits to borrow"
    ;;

  teams_gpus)
    # Issue 24, test 1 on 4 declared GPUs (the fixture's jobs, which hold GPUs without using
    # them): teams a and b with 2 GPUs each and 2 to borrow. alice's 4-GPU job borrows 2; bob's
    # 2-GPU job takes them back: alice's job is PREEMPTED (no checkpoint_dir: it starts again
    # from the start) and resumes once bob's job is gone. Every waiting reason names the team.
    team_keys
    printf '[team.a]\ngpus = 2\nborrow_gpus = 2\n[team.b]\ngpus = 2\nborrow_gpus = 2\n' >"$TMP/quotas.toml"
    start_head "${KEYED[@]}" --quotas "$TMP/quotas.toml"
    start_agent n1 --cpus 8 --gpus 4 $(as node)
    gpu_job g4 4
    gpu_job g2 2
    MEMBER=($(as alice))
    big=$(submit_id "$TMP/g4/job.toml" --name a-4gpu)
    wait_state "$big" RUNNING 20
    [ "$(job_field "$big" gpus)" = 4 ] || fail "alice's job holds $(job_field "$big" gpus) GPUs, not 4"
    until_reason "$big" "borrowing beyond team a's quota" 10
    # A second job of alice's would go beyond what team a may hold: it waits for her own jobs.
    second=$(submit_id "$TMP/g2/job.toml" --name a-more)
    until_reason "$second" "waiting: team a uses 4 of its 2 GPUs (job $big); this job needs 2 more and the team may borrow at most 2 beyond its quota" 10
    run 0 "$TWK" stop "$second" --address "$ADDR" "${MEMBER[@]}"
    show_jobs "1. alice's 4-GPU job borrows 2 of team b's GPUs"
    MEMBER=($(as bob))
    small=$(submit_id "$TMP/g2/job.toml" --name b-2gpu)
    wait_state "$big" PREEMPTED 60
    until_reason "$big" "preempted by job $small" 5
    until_reason "$big" "resumes from the start (it has no checkpoint_dir)" 5
    wait_state "$small" RUNNING 30
    until_reason "$big" "waiting: team a uses 0 of its 2 GPUs; it may borrow 2 more when the cluster has them free" 10
    show_jobs "2. bob's 2-GPU job within team b's quota runs; alice's waits to resume"
    run 0 "$TWK" quotas --address "$ADDR" "${MEMBER[@]}"
    cat "$TMP/out"
    grep -qE '^b +2 / 2 +0 / 2 ' "$TMP/out" || fail "quotas: team b does not use 2 of its 2 GPUs"
    run 0 "$TWK" stop "$small" --now --address "$ADDR" "${MEMBER[@]}"
    wait_state "$big" RUNNING 30
    show_jobs "3. bob's job is gone: alice's resumes"
    [ "$(job_field "$big" preemptions)" = 1 ] || fail "preemptions: $(job_field "$big" preemptions)"
    ;;

  isolation_memory)
    # Issue 24, test 3: `memory = "256MiB"` on group a: every worker runs in its run's cgroup
    # (/proc/PID/cgroup names it), the run's CPU quota is the CPUs its workers hold, a:0's limit
    # is 256 MiB, and when a:0 allocates 1 GiB the kernel kills it and the run says so. A limit
    # beyond every node's memory does not fit. 77 where this machine gives no cgroups.
    start_head
    start_agent n1 --cpus 8
    grep -q "isolation between jobs: cgroup" "$TMP/agent-n1.log" || {
      grep "isolation between jobs" "$TMP/agent-n1.log"
      echo "no usable cgroups here (needs root and cgroup v2, or the v1 cpu and memory hierarchies)"
      exit 77
    }
    run 0 "$TWK" nodes --address "$ADDR"
    expect_out "  isolation: cgroup v"
    fixture_dir m hog
    sed -i 's/^ranks = 4$/ranks = 4\nmemory = "256MiB"/' "$TMP/m/job.toml"
    sed -i "s|^tag = \"t\"|tag = \"t\"\nrelay_file = \"$TMP/go\"\nhog_mib = 1024|" "$TMP/m/job.toml"
    "$TWK" run "$TMP/m/job.toml" --set job.mode=remote --address "$ADDR" >"$TMP/run.out" 2>&1 &
    RUN_PID=$!
    PIDS+=($RUN_PID)
    wait_for "$TMP/run.out" "ALL READY" 30
    mapfile -t wpids < <(sed -n 's/^\[\([ab]\):[0-9]*\] READY pid=\([0-9]*\)$/\2/p' "$TMP/run.out")
    [ "${#wpids[@]}" -eq 6 ] || { cat "$TMP/run.out"; fail "expected 6 workers' pids, got ${#wpids[@]}"; }
    for p in "${wpids[@]}"; do
      cg=$(cat "/proc/$p/cgroup")
      echo "$cg" | grep -qE ':/twinkle/[0-9a-f]+\.n1(/|$)' || { echo "$cg"; fail "worker pid $p is not in its run's cgroup"; }
    done
    run_dir=$(sed -n 's|.*:/twinkle/\([0-9a-f]*\.n1\).*|\1|p' "/proc/${wpids[0]}/cgroup" | head -1)
    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
      [ "$(cat "/sys/fs/cgroup/twinkle/$run_dir/cpu.max")" = "600000 100000" ] || fail "cpu.max: $(cat "/sys/fs/cgroup/twinkle/$run_dir/cpu.max")"
      [ "$(cat "/sys/fs/cgroup/twinkle/$run_dir/a.0/memory.max")" = 268435456 ] || fail "a:0's memory.max is not 256 MiB"
    else
      cpu_root=$(ls -d /sys/fs/cgroup/cpu /sys/fs/cgroup/cpu,cpuacct 2>/dev/null | head -1)
      [ "$(cat "$cpu_root/twinkle/$run_dir/cpu.cfs_quota_us")" = 600000 ] || fail "the CPU quota is not 6 CPUs: $(cat "$cpu_root/twinkle/$run_dir/cpu.cfs_quota_us")"
      [ "$(cat "/sys/fs/cgroup/memory/twinkle/$run_dir/a.0/memory.limit_in_bytes")" = 268435456 ] || fail "a:0's memory limit is not 256 MiB"
    fi
    echo "6 workers in /twinkle/$run_dir; CPU quota 6 CPUs; a:0 limited to 256 MiB"
    touch "$TMP/go"
    wait "$RUN_PID"
    rc=$?
    [ $rc -eq 1 ] || { cat "$TMP/run.out"; fail "the run exited $rc, expected 1"; }
    grep -E "worker a:0 .*exceeded its memory limit of 256 MiB \(OOM-killed\)" "$TMP/run.out" ||
      { cat "$TMP/run.out"; fail "the OOM kill is not reported as such"; }
    ! grep -q "HOG DONE" "$TMP/run.out" || fail "a:0 held 1 GiB under a 256 MiB limit"
    grep -q "exceeded its memory limit of 256 MiB (OOM-killed)" "$TMP/agent-n1.log" || fail "the agent's log lacks the OOM kill"
    # Its folders are gone once the run is.
    deadline=$((SECONDS + 10))
    while ls -d /sys/fs/cgroup/*/twinkle/"$run_dir" /sys/fs/cgroup/twinkle/"$run_dir" >/dev/null 2>&1; do
      [ $SECONDS -lt $deadline ] || fail "the run's cgroup folders were left behind"
      sleep 0.1
    done
    # A limit no node has room for.
    run 2 "$TWK" run "$TMP/m/job.toml" --set job.mode=remote --set group.a.memory=1TiB --set job.queue_timeout_s=0 --address "$ADDR"
    grep -q "4 worker(s) of 1 CPU and 1 TiB each" "$TMP/err" "$TMP/out" || { cat "$TMP/out" "$TMP/err"; fail "a 1 TiB limit was not refused by the scheduler"; }
    ;;

  teams_order)
    # One pass of the queue with jobs of two teams: within-quota jobs go before borrowing ones
    # even when the borrower was submitted first. Teams a and b may each hold 4 of the 8 GPUs (b
    # may borrow 4 more); carol's job holds all 8 while bob queues two 4-GPU jobs and then alice
    # one. When carol's job ends, bob's first and alice's start, and bob's second (which would
    # borrow) waits, though it was submitted before alice's.
    team_keys
    printf '[team.a]\ngpus = 4\n[team.b]\ngpus = 4\nborrow_gpus = 4\n[team.c]\ngpus = 8\n' >"$TMP/quotas.toml"
    start_head "${KEYED[@]}" --quotas "$TMP/quotas.toml"
    start_agent n1 --cpus 16 --gpus 8 $(as node)
    gpu_job g8 8
    gpu_job g4 4
    MEMBER=($(as carol))
    blocker=$(submit_id "$TMP/g8/job.toml" --name blocker)
    wait_state "$blocker" RUNNING 20
    MEMBER=($(as bob))
    b1=$(submit_id "$TMP/g4/job.toml" --name b1)
    b2=$(submit_id "$TMP/g4/job.toml" --name b2)
    MEMBER=($(as alice))
    a1=$(submit_id "$TMP/g4/job.toml" --name a1)
    until_reason "$a1" "waiting behind job $b1" 10
    show_jobs "carol's job holds the 8 GPUs; b1, b2 and a1 wait in submit order"
    run 0 "$TWK" stop "$blocker" --now --address "$ADDR" $(as carol)
    wait_state "$b1" RUNNING 20
    wait_state "$a1" RUNNING 20
    until_reason "$b2" "waiting: team b uses 4 of its 4 GPUs (job $b1); it may borrow 4 more when the cluster has them free" 10
    show_jobs "b1 and a1 run within their quotas; b2, which would borrow, waits"
    [ "$(job_field "$b2" state)" = QUEUED ] || fail "b2 is $(job_field "$b2" state): it started borrowing ahead of a1"
    [ "$(job_field "$b1" preemptions)" = 0 ] && [ "$(job_field "$a1" preemptions)" = 0 ] ||
      fail "a job was preempted in a pass that had room for both quotas"
    ! grep -q "job service:" "$TMP/head.log" || { cat "$TMP/head.log"; fail "the job service failed a pass"; }
    ;;

  users_apart)
    # Issue 24, test 4: a head and an agent as root with --run-as map alice and bob to two Unix
    # accounts this test makes. bob's submitted digits job checkpoints and succeeds; then
    # alice's job (submitted, and run from a terminal) tries, from its driver and from each
    # worker, to read bob's run folder, job file, log, checkpoint and plugin cache: EACCES every
    # time, while a file open to all reads, and alice's jobs succeed too. carol, whom --run-as
    # does not map, is refused at submit.
    [ "$(id -u)" = 0 ] || { echo "needs root (useradd, and --run-as)"; exit 77; }
    command -v useradd >/dev/null || { echo "no useradd here"; exit 77; }
    ua="twa$$"
    ub="twb$$"
    for u in "$ua" "$ub"; do
      useradd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin --user-group "$u" ||
        fail "useradd $u"
      ACCOUNTS+=("$u")
    done
    uid_a=$(id -u "$ua")
    uid_b=$(id -u "$ub")
    chmod 0711 "$TMP"  # the accounts pass through to the state and cache folders
    mkdir -p "$TMP/shared"
    chmod 1777 "$TMP/shared"  # like /tmp: where the jobs' checkpoints go
    echo open >"$TMP/shared/open-to-all"
    chmod 0644 "$TMP/shared/open-to-all"
    team_keys
    map="alice=$ua,bob=$ub"
    start_head "${KEYED[@]}" --run-as "$map"
    start_agent n1 --cpus 8 $(as node) --run-as "$map"
    run 0 "$TWK" nodes --address "$ADDR" $(as alice)
    expect_out "  users: apart: alice as $ua, bob as $ub"
    # bob's job: digits, a checkpoint every epoch.
    digits_dir bob 3 "checkpoint_dir = \"$TMP/shared/ckpt-bob\""
    MEMBER=($(as bob))
    bid=$(submit_id "$TMP/bob/job.toml")
    wait_state "$bid" SUCCEEDED 90
    ls "$TMP/shared/ckpt-bob" | grep -q '^step-' || fail "bob's job wrote no checkpoint"
    manifest=$(ls -d "$TMP"/shared/ckpt-bob/step-*/manifest.json | head -1)
    owner_mode() { stat -c '%U %a' "$1"; }
    [ "$(owner_mode "$STATE/jobs/$bid/work")" = "$ub 700" ] || fail "bob's run folder: $(owner_mode "$STATE/jobs/$bid/work")"
    [ "$(owner_mode "$STATE/jobs/$bid/log")" = "$ub 600" ] || fail "bob's log: $(owner_mode "$STATE/jobs/$bid/log")"
    [ "$(owner_mode "$TMP/shared/ckpt-bob")" = "$ub 700" ] || fail "bob's checkpoints: $(owner_mode "$TMP/shared/ckpt-bob")"
    [ "$(owner_mode "$TMP/cache-n1/accounts/$ub")" = "$ub 700" ] || fail "bob's plugin cache: $(owner_mode "$TMP/cache-n1/accounts/$ub")"
    [ "$(owner_mode "$STATE/jobs/$bid")" = "root 711" ] || fail "bob's job folder: $(owner_mode "$STATE/jobs/$bid")"
    "$TWK" logs "$bid" --address "$ADDR" $(as bob) | grep -q "final loss" || fail "bob cannot read his log with twinkle logs"
    # alice's job probes bob's files.
    fixture_dir p apart
    cat >>"$TMP/p/job.toml" <<TOML
probe = ["$STATE/jobs/$bid/work", "$STATE/jobs/$bid/work/job.toml", "$STATE/jobs/$bid/log",
         "$TMP/shared/ckpt-bob", "$manifest", "$TMP/cache-n1/accounts/$ub",
         "$TMP/shared/open-to-all"]
TOML
    MEMBER=($(as alice))
    aid=$(submit_id "$TMP/p/job.toml")
    wait_state "$aid" SUCCEEDED 60
    "$TWK" logs "$aid" --address "$ADDR" $(as alice) >"$TMP/alice.log"
    "$TWK" run "$TMP/p/job.toml" --set job.mode=remote --address "$ADDR" $(as alice) >"$TMP/alice-run.log" 2>&1 ||
      { cat "$TMP/alice-run.log"; fail "alice's run from a terminal failed"; }
    for f in "$TMP/alice.log" "$TMP/alice-run.log"; do
      grep "OPEN" "$f"
      for p in "$STATE/jobs/$bid/work" "$STATE/jobs/$bid/work/job.toml" "$STATE/jobs/$bid/log" \
               "$TMP/shared/ckpt-bob" "$manifest" "$TMP/cache-n1/accounts/$ub"; do
        # Her four workers of group a, and her driver where it ran as her (the submitted job).
        want=4
        [ "$f" = "$TMP/alice.log" ] && want=5
        n=$(grep -cF " $p: EACCES" "$f")
        [ "$n" -eq "$want" ] || fail "$f: $n of $want tries to read $p got EACCES"
      done
      n=$(grep -cF " $TMP/shared/open-to-all: ok" "$f")
      [ "$n" -ge 4 ] || fail "$f: the file open to all was read $n times, not by every worker"
      n=$(grep -E "OPEN a:[0-9] uid=" "$f" | grep -vc "uid=$uid_a ")
      [ "$n" -eq 0 ] || fail "$f: $n of alice's workers' lines come from another uid than $ua's ($uid_a)"
    done
    grep -q "OPEN driver uid=$uid_a " "$TMP/alice.log" || fail "alice's submitted driver did not run as $ua"
    [ "$(owner_mode "$STATE/jobs/$aid/work")" = "$ua 700" ] || fail "alice's run folder: $(owner_mode "$STATE/jobs/$aid/work")"
    grep -q "started 6 worker(s) as $ua" "$TMP/agent-n1.log" || fail "the agent does not say it ran alice's workers as $ua"
    grep -q "started 4 worker(s) as $ub" "$TMP/agent-n1.log" || fail "the agent does not say it ran bob's workers as $ub"
    # carol has no account here: refused at submit, with the fix.
    run 2 "$TWK" submit "$TMP/p/job.toml" --address "$ADDR" $(as carol)
    expect_err "member carol has no Unix account on this node"
    expect_err "add carol=ACCOUNT"
    echo "alice ($ua, uid $uid_a) and bob ($ub, uid $uid_b) kept apart; both jobs succeeded"
    ;;

  *) fail "unknown case $CASE" ;;
esac
echo "PASS jobs $CASE"
