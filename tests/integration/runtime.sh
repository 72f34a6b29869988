#!/usr/bin/env bash
# Integration tests of `twinkle run` on the runtime fixture plugin: the environment of each rank,
# every dispatch/execute/collect mode end to end, every failure, signals, and that nothing of a
# run is left behind. Usage: runtime.sh TWINKLE_BINARY SOURCE_ROOT FIXTURE_PLUGIN CASE
TWK=$1
SRC=$2
PLUGIN=$3
source "$SRC/tests/integration/lib.sh"

export TMPDIR="$TMP/run"  # where runs make their private directories
mkdir -p "$TMPDIR"

write_job() {
  cat >"$TMP/job.toml" <<TOML
[job]
name = "runtime"
plugin = "$PLUGIN"
seed = 7
timeout_s = 30
$1
[[group]]
name = "a"
ranks = 4
mesh = { dp = 2, tp = 2 }

[[group]]
name = "b"
ranks = 2
mesh = { pp = 2 }
$2
[args]
tag = "t"
TOML
}

SHM_BEFORE=$(ls /dev/shm 2>/dev/null | sort)

# Nothing of a run may remain: no worker process, no run directory, no shared memory.
expect_clean() {
  local deadline=$((SECONDS + 3))
  while pgrep -r RSD -f -- "$TMPDIR" >/dev/null; do
    [ $SECONDS -lt $deadline ] || { pgrep -af -- "$TMPDIR"; fail "worker processes left behind"; }
    sleep 0.05
  done
  [ -z "$(ls -A "$TMPDIR")" ] || { ls -laR "$TMPDIR"; fail "the run directory was not removed"; }
  [ "$(ls /dev/shm 2>/dev/null | sort)" = "$SHM_BEFORE" ] || fail "something was left in /dev/shm"
  if grep -l "memfd:twinkle-tensor" /proc/[0-9]*/maps 2>/dev/null | grep -v "/proc/$$/" ; then
    fail "a process still maps a twinkle tensor segment"
  fi
}

# Starts the hang scenario in the background; sets DRIVER_PID and WORKER_PIDS once all are ready.
# $1: more [job] keys.
start_hanging() {
  write_job "${1-}" ""
  "$TWK" run --set job.driver=hang "$TMP/job.toml" >"$TMP/out" 2>"$TMP/err" &
  DRIVER_PID=$!
  local deadline=$((SECONDS + 20))
  until grep -q "ALL READY" "$TMP/out"; do
    kill -0 $DRIVER_PID 2>/dev/null || { cat "$TMP/out" "$TMP/err"; fail "the run ended before it was ready"; }
    [ $SECONDS -lt $deadline ] || fail "workers not ready in time"
    sleep 0.05
  done
  WORKER_PIDS=$(sed -n 's/^\[[ab]:[0-9]\] READY pid=\([0-9]*\)$/\1/p' "$TMP/out")
  [ "$(echo "$WORKER_PIDS" | wc -w)" -eq 6 ] || { cat "$TMP/out"; fail "expected 6 worker pids"; }
}

# Waits for the background driver to end; sets DRIVER_RC.
wait_driver() {
  local deadline=$((SECONDS + 5))
  while kill -0 $DRIVER_PID 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || fail "twinkle did not stop"
    sleep 0.02
  done
  wait $DRIVER_PID
  DRIVER_RC=$?
}

# A process that ended but was not yet reaped by its new parent (a zombie) counts as gone.
alive() { [ -e "/proc/$1" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != "Z" ]; }

workers_gone_within() {
  local deadline_ms=$1 start
  start=$(date +%s%N)
  for pid in $WORKER_PIDS; do
    while alive "$pid"; do
      [ $((($(date +%s%N) - start) / 1000000)) -lt "$deadline_ms" ] || fail "worker $pid still runs after ${deadline_ms} ms"
      sleep 0.02
    done
  done
}

case $4 in
  env)
    write_job "" $'[[group]]\nname = "c"\nranks = 2\ndevice = "cuda"\n'
    CUDA_VISIBLE_DEVICES=5,6 OMP_NUM_THREADS= run 0 env -u OMP_NUM_THREADS "$TWK" run --set job.driver=env --log-dir "$TMP/logs" "$TMP/job.toml"
    grep '^ENV ' "$TMP/out" | sed 's/^ENV //' >"$TMP/env.json"
    python3 - "$TMP/env.json" <<'PY' || fail "the workers' environment is wrong"
import json, sys
e = json.load(open(sys.argv[1]))
a, b = e["a"], e["b"]
run_ids = {w["TWINKLE_RUN_ID"] for w in a + b}
assert len(run_ids) == 1 and len(run_ids.pop()) == 8, "one run id for all"
for group, ws, n in (("a", a, 4), ("b", b, 2)):
    assert len(ws) == n
    ports = {w["MASTER_PORT"] for w in ws}
    assert len(ports) == 1, f"{group}: one MASTER_PORT per group"
    for i, w in enumerate(ws):
        assert w["RANK"] == str(i) and w["LOCAL_RANK"] == str(i), w
        assert w["WORLD_SIZE"] == str(n) and w["LOCAL_WORLD_SIZE"] == str(n), w
        assert w["GROUP_RANK"] == "0" and w["MASTER_ADDR"] == "127.0.0.1", w
        assert w["TWINKLE_GROUP"] == group and w["TWINKLE_WORKER_NAME"] == f"{group}:{i}", w
        assert w["TWINKLE_MODE"] == "local" and w["TWINKLE_SEED"] == "7", w
        assert w["OMP_NUM_THREADS"] == "1", w
        assert w["ctx_rank"] == i and w["ctx_world"] == n and w["args_tag"] == "t", w
assert a[0]["MASTER_PORT"] != b[0]["MASTER_PORT"], "distinct MASTER_PORT per group"
assert [w["data_rank"] for w in a] == [0, 0, 1, 1]
# The cuda group's workers see the physical GPUs placed for them; cpu groups get none set.
assert [w["CUDA_VISIBLE_DEVICES"] for w in e["c"]] == ["5", "6"], e["c"]
assert all(w["CUDA_VISIBLE_DEVICES"] == "" for w in a + b), a[0]
PY
    expect_out "[a:0] env asked"
    expect_out "[c:1] env asked"
    grep -q "env asked" "$TMP/logs/a-3.log" || fail "--log-dir has no a-3.log with the worker's output"
    CUDA_VISIBLE_DEVICES=5,6 OMP_NUM_THREADS=3 run 0 "$TWK" run --quiet --set job.driver=env "$TMP/job.toml"
    grep -q '^\[' "$TMP/out" && fail "--quiet still shows worker output"
    grep '^ENV ' "$TMP/out" | sed 's/^ENV //' >"$TMP/env.json"
    python3 - "$TMP/env.json" <<'PY' || fail "OMP_NUM_THREADS set by the user must be kept"
import json, sys
e = json.load(open(sys.argv[1]))
assert all(w["OMP_NUM_THREADS"] == "3" for w in e["a"]), e["a"][0]
PY
    expect_clean
    ;;
  modes)
    write_job "" ""
    run 0 "$TWK" run --set job.driver=modes "$TMP/job.toml"
    expect_out "ALL MODES OK"
    expect_out "DEVICE PLACEMENT TOPOLOGY"
    expect_clean
    ;;
  throws)
    write_job "" ""
    run 1 "$TWK" run --set job.driver=throws "$TMP/job.toml"
    expect_err "twinkle: job \"runtime\" failed"
    expect_err "root cause: [twinkle driver caller: runtime_plugin.cpp:"
    expect_err "Probe.fail failed on group a rank 2 (host "
    expect_err "deliberate failure on rank 2"
    grep -q "root cause: .*pid [0-9]*)" "$TMP/err" || fail "the root cause does not name the pid"
    expect_clean
    ;;
  abort|segv|exit)
    write_job "" ""
    case $4 in
      abort) driver=abort_in_call rank=a:1 how="was killed by signal 6 (Aborted)" ;;
      segv) driver=segv_in_call rank=a:3 how="was killed by signal 11 (Segmentation fault)" ;;
      exit) driver=exit_in_call rank=a:0 how="exited with code 3" ;;
    esac
    run 1 "$TWK" run --set job.driver=$driver "$TMP/job.toml"
    grep -q "root cause: worker $rank (host [^,]*, pid [0-9]*) $how" "$TMP/err" || { cat "$TMP/err"; fail "no root cause for $rank"; }
    [ "$(grep -c "| about to $4" "$TMP/err")" -eq 1 ] || fail "the last stderr lines are shown more than once"
    expect_err "| about to $4 on rank ${rank#a:}"
    # The call the driver was waiting on when the worker died, with the driver's call site.
    expect_err "the driver was waiting on: Probe.fail (driver caller: runtime_plugin.cpp:"
    [ "$(grep -c 'root cause' "$TMP/err")" -eq 1 ] || fail "more than one root cause"
    expect_clean
    ;;
  idle_death)
    write_job "" ""
    run 1 "$TWK" run --set job.driver=idle_death "$TMP/job.toml"
    expect_err "root cause: worker a:1"
    expect_err "was killed by signal 6 (Aborted)"
    expect_err "| dying now"
    ms=$(sed -n 's/^NOTICED after \([0-9]*\) ms$/\1/p' "$TMP/out")
    [ -n "$ms" ] || fail "the driver did not notice the death"
    # die_later waits 100 ms; the death must reach the driver within a second of it.
    [ "$ms" -lt 1100 ] || fail "the death was noticed after $ms ms"
    expect_clean
    ;;
  collectives)
    write_job "" ""
    # auto picks shared memory (one host); both backends must give the same results.
    for backend in auto shm gloo; do
      run 0 "$TWK" run --set job.driver=collectives --set job.collectives=$backend "$TMP/job.toml"
      expect_out "COLLECTIVES OK"
    done
    TWINKLE_COLLECTIVES=gloo run 0 "$TWK" run --set job.driver=collectives "$TMP/job.toml"
    expect_out "COLLECTIVES OK"
    TWINKLE_COLLECTIVES=mpi run 2 "$TWK" run --set job.driver=collectives "$TMP/job.toml"
    expect_err 'TWINKLE_COLLECTIVES must be "auto", "shm" or "gloo", not "mpi"'
    expect_clean
    ;;
  cross_group)
    write_job "" ""
    # A communicator across groups (a:0 and all of b): 64 MiB from a:0 arrive bit for bit, with
    # both backends; the workers outside it are untouched.
    for backend in shm gloo; do
      run 0 "$TWK" run --set job.driver=cross_group --set job.collectives=$backend "$TMP/job.toml"
      expect_out "a:0 rank 0 of 3: 64 MiB bit-exact"
      expect_out "b:0 rank 1 of 3: 64 MiB bit-exact"
      expect_out "b:1 rank 2 of 3: 64 MiB bit-exact"
      expect_out "a:3 not a member"
    done
    # A member that never joins is named, within the communicator's timeout.
    start=$SECONDS
    run 1 "$TWK" run --set job.driver=cross_missing "$TMP/job.toml"
    expect_err "communicator weights: rank 0 (a:0) never joined within 1.5 s"
    [ $((SECONDS - start)) -lt 20 ] || fail "the missing member took too long to report"
    # Declarations that cannot work are refused, each with its reason.
    run 0 "$TWK" run --set job.driver=cross_bad "$TMP/job.toml"
    expect_out 'communicator "dp": the name of a mesh dimension'
    expect_out 'communicator "w": the job has no group "nosuch"'
    expect_out 'communicator "w": group a has workers 0 to 3, not 7'
    expect_out 'communicator "w": a:0 is listed twice'
    if grep -q ACCEPTED "$TMP/out"; then fail "a bad communicator was accepted"; fi
    # A member's group restarts (b:1 dies): the communicator is declared again on every member
    # and the next broadcast reaches the new b:1, with both backends.
    write_job "" "max_restarts = 1"
    for backend in shm gloo; do
      run 0 "$TWK" run --set job.driver=cross_restart --set job.collectives=$backend "$TMP/job.toml"
      expect_err "twinkle: group b is back (restart 1,"
      expect_out "BEFORE b:1 rank 2 of 3: 1 MiB bit-exact"
      expect_out "LOST"
      expect_out "AFTER a:0 rank 0 of 3: 2 MiB bit-exact"
      expect_out "AFTER b:0 rank 1 of 3: 2 MiB bit-exact"
      expect_out "AFTER b:1 rank 2 of 3: 2 MiB bit-exact"
    done
    expect_clean
    ;;

  peers)
    # Calls between groups (docs/ARCHITECTURE.md, Calls between groups): worker r of "a" (m
    # workers) reaches its balanced block of "b" (n >= m) or worker r mod n (n < m), worker to
    # worker, and `slice` splits the caller's 12 items across that block.
    write_peer_job() {
      cat >"$TMP/peers.toml" <<TOML
[job]
name = "peers"
plugin = "$PLUGIN"
timeout_s = 20
driver = "peer_map"
[[group]]
name = "a"
ranks = $1
[[group]]
name = "b"
ranks = $2
[[group]]
name = "c"
ranks = 1
TOML
    }
    for mn in "1 4" "2 4" "4 4" "3 4" "4 3" "4 2" "3 8" "8 3"; do
      read -r m n <<<"$mn"
      write_peer_job "$m" "$n"
      run 0 "$TWK" run --quiet "$TMP/peers.toml"
      python3 - "$m" "$n" "$TMP/out" <<'PY' || fail "the peer blocks for m=$m n=$n"
import sys
m, n = int(sys.argv[1]), int(sys.argv[2])
lines = open(sys.argv[3]).read().splitlines()
def balanced(length, parts, i):
    base, extra = divmod(length, parts)
    b = i * base + min(i, extra)
    return b, b + base + (1 if i < extra else 0)
want, made = [], []
for r in range(m):
    block = [r % n] if n < m else list(range(*balanced(n, m, r)))
    items = [100 * r + i for i in range(12)]
    parts = []
    for j, w in enumerate(block):
        b, e = balanced(12, len(block), j)
        parts.append(f"b:{w}[{','.join(map(str, items[b:e]))}]")
    want.append(f"a:{r} -> " + " ".join(parts))
    made.append(f"made on b:[{','.join(map(str, block))}]")
got = [l for l in lines if l.startswith("a:")]
got_made = [l for l in lines if l.startswith("made on")]
if got != want or got_made != made:
    print("want:", *want, *made, "got:", *got, *got_made, sep="\n")
    sys.exit(1)
PY
    done
    # 64 MiB from worker to worker and back: bit-exact, and on the way there in shared memory
    # (the target sees the tensor inside a memfd mapping), not through the socket.
    write_peer_job 2 2
    run 0 "$TWK" run --quiet --set args.mib=64 "$TMP/peers.toml"
    expect_out "a:0 64 MiB to its peer: bit-exact yes, shared memory yes; back: bit-exact yes"
    expect_out "a:1 64 MiB to its peer: bit-exact yes, shared memory yes; back: bit-exact yes"
    # Failures name both call sites: the driver's and the worker's.
    site() { grep -n "$1" "$SRC/tests/fixtures/runtime_plugin.cpp" | head -1 | cut -d: -f1; }
    drv=$(site PEER-DRIVER-SITE)
    wrk=$(site PEER-WORKER-SITE)
    write_peer_job 2 4
    run 1 "$TWK" run --quiet --set job.driver=peer_fail --set args.which=boom "$TMP/peers.toml"
    expect_err "[twinkle driver caller: runtime_plugin.cpp:$drv] Caller.fail failed on group a rank 0"
    expect_err "[twinkle worker caller: runtime_plugin.cpp:$wrk] Target.boom failed on group b rank 0"
    expect_err "target 0 exploded"
    # A target that hangs: the worker's call times out (1 s) and says so, long before the job's
    # 20 s timeout.
    start=$SECONDS
    run 1 "$TWK" run --quiet --set job.driver=peer_fail --set args.which=stall "$TMP/peers.toml"
    expect_err "[twinkle driver caller: runtime_plugin.cpp:$drv] Caller.fail failed on group a rank 0"
    expect_err "[twinkle worker caller: runtime_plugin.cpp:$wrk] Target.stall timed out after 1 s: ranks [0, 1] of group b did not answer"
    [ $((SECONDS - start)) -lt 15 ] || fail "the stalled call took $((SECONDS - start)) s to fail"
    # A target worker that dies during the call: the run fails at once, naming it.
    start=$SECONDS
    run 1 "$TWK" run --quiet --set job.driver=peer_fail --set args.which=die "$TMP/peers.toml"
    grep -qE "root cause: worker b:[0-3] \(host [^,]+, pid [0-9]+\) was killed by signal 9" "$TMP/err" ||
      { cat "$TMP/err"; fail "the dead target worker is not the root cause"; }
    [ $((SECONDS - start)) -lt 15 ] || fail "the dead target took $((SECONDS - start)) s to report"
    # A call back into a worker that waits for it: an error naming the cycle, not a hang.
    start=$SECONDS
    run 1 "$TWK" run --quiet --set job.driver=peer_fail --set args.which=cycle "$TMP/peers.toml"
    expect_err "[twinkle driver caller: runtime_plugin.cpp:$(site PEER-CYCLE-SITE)] Caller.cycle failed on group a rank 0"
    expect_err "deadlock: a cycle of calls: a:0 Caller.cycle -> b:0 Target.back (called at runtime_plugin.cpp:$(site PEER-CALLBACK-SITE)) -> a:0 Caller.noop (called at runtime_plugin.cpp:$(site PEER-BACK-SITE))"
    [ $((SECONDS - start)) -lt 15 ] || fail "the cycle took $((SECONDS - start)) s to report"
    # Three calls that wait on each other around a:0 -> b:0 -> c:0, none nested in another.
    write_peer_job 1 1
    start=$SECONDS
    run 0 "$TWK" run --quiet --set job.driver=peer_ring "$TMP/peers.toml"
    grep -qE "^RING ERROR .*deadlock: a cycle of calls that wait on each other: (a:0 Ring.pass -> b:0 Ring.pass -> c:0 Ring.pass -> a:0|b:0 Ring.pass -> c:0 Ring.pass -> a:0 Ring.pass -> b:0|c:0 Ring.pass -> a:0 Ring.pass -> b:0 Ring.pass -> c:0);" "$TMP/out" ||
      { cat "$TMP/out"; fail "the ring of calls was not reported as a cycle"; }
    [ $((SECONDS - start)) -lt 15 ] || fail "the ring took $((SECONDS - start)) s to report"
    expect_clean
    ;;

  shm)
    write_job "" ""
    run 0 "$TWK" run --set job.driver=shm "$TMP/job.toml"
    expect_out "SHM OK"
    expect_clean
    ;;
  collective_death)
    # A peer that dies mid-collective: the run fails at once (not at the timeout) naming it.
    write_job "" ""
    for backend in shm gloo; do
      start=$SECONDS
      TWINKLE_COLLECTIVES=$backend run 1 "$TWK" run --set job.driver=collective_death "$TMP/job.toml"
      [ $((SECONDS - start)) -lt 20 ] || fail "the run waited for the collective's timeout ($backend)"
      expect_err "root cause: worker a:2"
      expect_err "| leaving before the all_reduce"
    done
    expect_clean
    ;;
  timeout)
    write_job "" ""
    run 1 "$TWK" run --set job.driver=timeout "$TMP/job.toml"
    expect_err "Probe.slow timed out after 0.3 s: ranks [0, 1] of group b did not answer"
    expect_clean
    ;;
  restart_idle)
    # A worker of a restarting group lost while no call waits on it: the driver's next call to
    # the group says so once (WorkerLost), so that state never goes back unnoticed; the call after
    # it runs on the new workers.
    write_job "" "max_restarts = 1"
    "$TWK" run --set job.driver=restart_idle --set args.marker="$TMP/marker" "$TMP/job.toml" \
      >"$TMP/out" 2>"$TMP/err" &
    DRIVER_PID=$!
    wait_for "$TMP/out" "B READY" 20
    victim=$(sed -n 's/^\[b:1\] READY pid=\([0-9]*\)$/\1/p' "$TMP/out" | head -1)
    [ -n "$victim" ] || { cat "$TMP/out"; fail "no pid of b:1"; }
    kill -KILL "$victim"
    wait_for "$TMP/err" "twinkle: worker b:1 (pid $victim) was killed by signal 9" 10
    touch "$TMP/marker"
    wait_driver
    [ "$DRIVER_RC" -eq 0 ] || { cat "$TMP/out" "$TMP/err"; fail "twinkle exited $DRIVER_RC"; }
    expect_out "LOST: [twinkle driver caller: runtime_plugin.cpp:"
    expect_out "Probe.pid failed: worker b:1 (host"
    expect_out "group b restarted while no call was waiting on it (its instances were made again, without state)"
    expect_out "AGAIN 2 workers"
    if grep -q "NO ERROR" "$TMP/out"; then fail "the restart went unnoticed"; fi
    expect_err "twinkle: 1 restart(s) in this run:"
    expect_clean
    ;;
  retry)
    # twinkle::retry: the calls in flight when b:1 is lost run again on the new workers, in the
    # order they were made, and get those results; a method without retry fails with WorkerLost
    # naming where it may have run; a call made meanwhile waits for the group.
    write_job "" "max_restarts = 1"
    run 0 "$TWK" run --set job.driver=retry "$TMP/job.toml"
    expect_out "FLAKY RESULTS 00 11 22 33 44 55 "
    expect_out "PLAIN LOST: [twinkle driver caller: runtime_plugin.cpp:"
    expect_out "Probe.echo failed: worker b:1 (host"
    expect_out "group b restarts. The call had finished on ranks ["
    expect_out "AFTER 2 workers"
    # The new b:1 ran again, in order and once each, the calls not answered when the loss was
    # seen: 3 to 5, and those before whose answers had not reached the driver yet.
    again=$(sed -n 's/^\[b:1\] FLAKY \([0-9]\) gen 1$/\1/p' "$TMP/out" | tr -d '\n')
    case "$again" in
      012345 | 12345 | 2345 | 345) ;;
      *) grep FLAKY "$TMP/out"; fail "the retried calls did not run again in order: $again" ;;
    esac
    [ "$(grep -c '^\[b:1\] FLAKY . gen 0$' "$TMP/out")" -eq 4 ] || fail "b:1 should have run calls 0 to 3 first"
    expect_clean
    ;;
  peer_restart)
    # Group b restarts (restart = "worker") while a:1 waits on b:1, which died: a:1's call fails
    # as soon as b is back, naming the replaced worker (not at its timeout), and a's next calls
    # reach b's new worker at its new address.
    cat >"$TMP/peers.toml" <<TOML
[job]
name = "peers"
plugin = "$PLUGIN"
timeout_s = 30
driver = "peer_restart"
[[group]]
name = "a"
ranks = 2
[[group]]
name = "b"
ranks = 2
max_restarts = 1
TOML
    start=$SECONDS
    run 0 "$TWK" run --quiet "$TMP/peers.toml"
    [ $((SECONDS - start)) -lt 20 ] || fail "the call into the restarted group waited for its timeout"
    expect_err "twinkle: group b is back (restart 1,"
    expect_out "FAILED: [twinkle driver caller: runtime_plugin.cpp:"
    expect_out "worker b:1 was lost and replaced (its group b restarted); the call may have run on it"
    expect_out "AFTER a:0 -> b:0[0,1]"
    expect_out "AFTER a:1 -> b:1[100,101]"
    # The same through instances that a's workers made on b themselves: the restart makes them
    # again on the new b:1 (before, a:1's next call found no such instance there).
    run 0 "$TWK" run --quiet --set job.driver=peer_made_restart "$TMP/peers.toml"
    expect_err "twinkle: group b is back (restart 1,"
    expect_out "AFTER a:0 -> b:0[0,1]"
    expect_out "AFTER a:1 -> b:1[100,101]"
    # The donor's state changes (a call from a) after its regroup and before the replacement
    # pulls it: the replacement gets the state after the change, not the one taken at the regroup.
    run 0 "$TWK" run --quiet --set job.driver=peer_donor_changed --set args.marker="$TMP/marker" \
      "$TMP/peers.toml"
    expect_err "state copied b:1 from b:0"
    expect_out "POKED 7"
    expect_out "REPLICAS [7,7]"
    expect_clean
    ;;
  restart_timeout)
    # In a group that restarts, a call timeout is the loss of the ranks that did not answer: the
    # hung workers are replaced (nothing is left sleeping) and the next call runs.
    write_job "" "max_restarts = 1"
    run 0 "$TWK" run --set job.driver=restart_timeout "$TMP/job.toml"
    expect_out "TIMEOUT LOST: [twinkle driver caller: runtime_plugin.cpp:"
    expect_out "did not answer Probe.slow_first within 0.3 s (a call timeout, counted as its loss)"
    expect_out "AFTER OK"
    expect_err "twinkle: restarting group b (restart 1 of 1 in 600 s)"
    expect_clean
    # Without restarts a timeout stays a timeout.
    write_job "" ""
    run 1 "$TWK" run --set job.driver=restart_timeout "$TMP/job.toml"
    expect_err "Probe.slow_first timed out after 0.3 s"
    expect_clean
    ;;
  stop_grace)
    # With a checkpoint_dir, SIGTERM asks the driver entry to stop; one that does not return
    # within stop_grace_s is stopped as SIGTERM always stopped runs (143), nothing left behind.
    start_hanging $'checkpoint_dir = "ck"\nstop_grace_s = 0.5'
    kill -TERM $DRIVER_PID
    wait_driver
    [ "$DRIVER_RC" -eq 143 ] || { cat "$TMP/err"; fail "twinkle exited $DRIVER_RC, expected 143"; }
    expect_err "SIGTERM: stop requested; the driver entry has 0.5 s to checkpoint and return"
    expect_err "the driver entry did not return within stop_grace_s = 0.5 s of the stop request"
    expect_err "interrupted by SIGTERM"
    workers_gone_within 1000
    expect_clean
    # A second signal during the grace stops the run at once.
    start_hanging $'checkpoint_dir = "ck"\nstop_grace_s = 600'
    kill -TERM $DRIVER_PID
    wait_for "$TMP/err" "stop requested" 5
    kill -INT $DRIVER_PID
    wait_driver
    [ "$DRIVER_RC" -eq 130 ] || { cat "$TMP/err"; fail "twinkle exited $DRIVER_RC, expected 130"; }
    workers_gone_within 1000
    expect_clean
    ;;
  fork_server)
    # Workers are forked by one fork server, the driver's child, and look as spawned ones do;
    # with TWINKLE_FORK_SERVER=0 the driver spawns each itself. Either way a stop leaves nothing.
    ppid() { awk '{print $4}' "/proc/$1/stat"; }
    cmd() { tr '\0' ' ' <"/proc/$1/cmdline"; }
    start_hanging
    server=$(ppid "$(echo $WORKER_PIDS | cut -d" " -f1)")
    [ "$(ppid "$server")" = "$DRIVER_PID" ] || fail "the workers' parent $server is not the driver's child"
    [[ $(cmd "$server") == *"twinkle-worker --fork-server"* ]] || fail "the workers' parent is not the fork server: $(cmd "$server")"
    for pid in $WORKER_PIDS; do
      [ "$(ppid "$pid")" = "$server" ] || fail "worker $pid was not forked by the fork server $server"
      [[ $(cmd "$pid") == *"twinkle-worker --endpoint "*" --plugin $PLUGIN --run-dir $TMPDIR/"* ]] ||
        fail "worker $pid's command line is not a worker's: $(cmd "$pid")"
    done
    kill -TERM $DRIVER_PID
    wait_driver
    [ "$DRIVER_RC" -eq 143 ] || { cat "$TMP/err"; fail "twinkle exited $DRIVER_RC, expected 143"; }
    workers_gone_within 1000
    alive "$server" && fail "the fork server $server outlived its run"
    expect_clean
    # A fork server that dies takes its workers along: the driver reports it and fails the run,
    # and still removes what the run left.
    start_hanging
    server=$(ppid "$(echo $WORKER_PIDS | cut -d" " -f1)")
    kill -KILL "$server"
    wait_driver
    [ "$DRIVER_RC" -eq 1 ] || { cat "$TMP/err"; fail "twinkle exited $DRIVER_RC after its fork server died, expected 1"; }
    grep -q "the workers' fork server (pid $server) died" "$TMP/err" || { cat "$TMP/err"; fail "the fork server's death was not reported"; }
    workers_gone_within 1000
    expect_clean
    export TWINKLE_FORK_SERVER=0
    start_hanging
    for pid in $WORKER_PIDS; do
      [ "$(ppid "$pid")" = "$DRIVER_PID" ] || fail "with TWINKLE_FORK_SERVER=0, worker $pid is not the driver's child"
    done
    pgrep -P $DRIVER_PID -f -- "--fork-server" >/dev/null && fail "TWINKLE_FORK_SERVER=0 still started a fork server"
    kill -TERM $DRIVER_PID
    wait_driver
    [ "$DRIVER_RC" -eq 143 ] || { cat "$TMP/err"; fail "twinkle exited $DRIVER_RC, expected 143"; }
    workers_gone_within 1000
    expect_clean
    ;;
  sigint|sigterm|sigkill)
    start_hanging
    case $4 in
      sigint) kill -INT $DRIVER_PID; want=130 ;;
      sigterm) kill -TERM $DRIVER_PID; want=143 ;;
      sigkill) kill -KILL $DRIVER_PID; want=137 ;;
    esac
    wait_driver
    [ "$DRIVER_RC" -eq "$want" ] || { cat "$TMP/err"; fail "twinkle exited $DRIVER_RC after $4, expected $want"; }
    if grep -q "stopping the other workers" "$TMP/err"; then fail "a stop on request was reported as a worker failure"; fi
    workers_gone_within 1000
    expect_clean
    ;;
  notify)
    python3 - "$TMP" <<'PY' &
import http.server, json, sys, os
tmp = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with open(os.path.join(tmp, "posts"), "a") as f:
            f.write(json.dumps({"path": self.path, "body": body.decode()}) + "\n")
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
open(os.path.join(tmp, "port.tmp"), "w").write(str(s.server_address[1]))
os.rename(os.path.join(tmp, "port.tmp"), os.path.join(tmp, "port"))
s.timeout = 20
while not os.path.exists(os.path.join(tmp, "stop")):
    s.handle_request()
PY
    LISTENER=$!
    trap 'touch "$TMP/stop"; kill $LISTENER 2>/dev/null; rm -rf "$TMP"' EXIT
    deadline=$((SECONDS + 10))
    until [ -f "$TMP/port" ]; do [ $SECONDS -lt $deadline ] || fail "no listener"; sleep 0.02; done
    port=$(cat "$TMP/port")
    write_job "" $'[notify]\nwebhook = "http://127.0.0.1:'"$port"$'/hook?x=1"\nkind = "dingtalk"\nsecret = "s3cret"\n'
    run 1 "$TWK" run --set job.driver=throws "$TMP/job.toml"
    write_job "" $'[notify]\nwebhook = "http://127.0.0.1:'"$port"$'/json"\n'
    run 1 "$TWK" run --set job.driver=throws "$TMP/job.toml"
    python3 - "$TMP/posts" <<'PY' || fail "the notifications are wrong"
import base64, hashlib, hmac, json, sys, urllib.parse
posts = [json.loads(l) for l in open(sys.argv[1])]
assert len(posts) == 2, posts
ding, plain = posts
u = urllib.parse.urlparse(ding["path"])
q = urllib.parse.parse_qs(u.query)
assert u.path == "/hook" and q["x"] == ["1"], ding["path"]
ts = q["timestamp"][0]
want = base64.b64encode(hmac.new(b"s3cret", f"{ts}\ns3cret".encode(), hashlib.sha256).digest()).decode()
assert q["sign"] == [want], (q["sign"], want)
b = json.loads(ding["body"])
assert b["msgtype"] == "markdown" and "runtime" in b["markdown"]["title"], b
assert "deliberate failure on rank 2" in b["markdown"]["text"], b
p = json.loads(plain["body"])
assert plain["path"] == "/json" and p["job"] == "runtime" and len(p["run_id"]) == 8, p
assert "deliberate failure on rank 2" in p["error"], p
PY
    # A webhook that cannot be reached is reported, never fatal: the run still says why it failed.
    write_job "" $'[notify]\nwebhook = "http://127.0.0.1:1/hook"\n'
    run 1 "$TWK" run --set job.driver=throws "$TMP/job.toml"
    expect_err "failure notification to http://127.0.0.1:1/hook not delivered"
    expect_err "deliberate failure on rank 2"
    expect_clean
    ;;
  bad_input)
    write_job "" ""
    run 3 "$TWK" run --set job.driver=nope "$TMP/job.toml"
    expect_err "plugin has no driver entry \"nope\" (it has: "
    run 3 "$TWK" run --set job.plugin=/nonexistent/libx.so "$TMP/job.toml"
    expect_err "/nonexistent/libx.so: no such plugin file"
    run 1 "$TWK" run --set job.driver=bad_create "$TMP/job.toml"
    expect_err "the job has no group \"nosuchgroup\" (it has: a, b)"
    expect_err "[twinkle driver caller: runtime_plugin.cpp:"
    run 2 "$TWK" run --set job.sed=1 "$TMP/job.toml"
    # A twinkle without its worker binary beside it: refused before any worker starts, naming
    # the missing file and the fix.
    mkdir -p "$TMP/lonely" && cp "$TWK" "$TMP/lonely/twinkle"
    run 1 "$TMP/lonely/twinkle" run --set job.driver=env "$TMP/job.toml"
    expect_err "cannot run the worker binary $TMP/lonely/twinkle-worker: No such file or directory (twinkle-worker is installed beside twinkle"
    expect_clean
    ;;
  intruder)
    # A process of the same user cannot reach the control channel: it is a pair of pipes per
    # worker, with nothing in the run folder to connect to. A worker started by hand is refused
    # at once, saying why, and the run goes on.
    start_hanging
    rundir=$(ls -d "$TMPDIR"/twinkle-run.*)
    [ ! -e "$rundir/ctl" ] || fail "the run folder has a control socket: $(ls "$rundir")"
    ls "$rundir" | grep -qvE '^(kv|w[0-9]+|owner)$' &&
      fail "the run folder has more than the rendezvous and serve sockets: $(ls "$rundir")"
    # What connects to a worker's serve socket without a worker's greeting is dropped with a
    # line naming the socket; the run goes on.
    for sock in "$rundir"/w*; do
      python3 -c 'import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(b"hello")' "$sock" || fail "cannot connect to $sock"
    done
    for endpoint in "ipc://$rundir/ctl" "fd:4,5" "fd:4" "fd:99,100" "fd:4,5x"; do
      rc=0
      TWINKLE_WORKER_NAME=a:0 "$(dirname "$TWK")/twinkle-worker" --endpoint "$endpoint" --plugin "$PLUGIN" \
        --run-dir "$rundir" >"$TMP/intruder.out" 2>&1 4<&- 5<&- || rc=$?
      [ "$rc" -eq 2 ] || { cat "$TMP/intruder.out"; fail "a worker started by hand on $endpoint exited $rc, expected 2"; }
      grep -qF -- "--endpoint $endpoint: not a control channel this worker has" "$TMP/intruder.out" ||
        { cat "$TMP/intruder.out"; fail "the refused worker did not say why"; }
    done
    kill -0 $DRIVER_PID 2>/dev/null || fail "a worker started by hand stopped the run"
    [ -d "$rundir" ] || fail "a worker started by hand removed the run folder"
    kill -TERM $DRIVER_PID
    wait_driver
    [ "$DRIVER_RC" -eq 143 ] || { cat "$TMP/err"; fail "twinkle exited $DRIVER_RC, expected 143"; }
    grep -q "internal error" "$TMP/err" && fail "a worker started by hand caused an internal error"
    expect_err "dropped a message on the socket for calls from other workers: a connection on $rundir/w"
    expect_clean
    ;;
  freeze)
    # A worker frozen with SIGSTOP: the run still ends at once after a bounded grace and names it.
    write_job "" ""
    start=$(date +%s%N)
    run 0 "$TWK" run --set job.driver=freeze "$TMP/job.toml"
    took_ms=$((($(date +%s%N) - start) / 1000000))
    [ "$took_ms" -lt 8000 ] || fail "a frozen worker held the shutdown for $took_ms ms"
    expect_err "worker(s) b:0 did not exit within 2 s of the shutdown (stopped or stuck); killed them"
    expect_clean
    ;;
  run_dirs)
    # An unwritable --log-dir fails before anything starts.
    write_job "" ""
    run 2 "$TWK" run --set job.driver=throws --log-dir /proc/twinkle-logs "$TMP/job.toml"
    expect_err "--log-dir /proc/twinkle-logs: cannot write there"
    # A run folder whose driver is gone (killed before it could clean up, even before it put
    # anything in) is removed by the next run; a folder whose name names no driver is left alone.
    dead=99999
    while kill -0 $dead 2>/dev/null; do dead=$((dead + 1)); done
    stale="$TMPDIR/twinkle-run.0badc0de.$dead.12345.AbCdEf"
    mkdir -p "$stale" "$TMPDIR/twinkle-run.notours"
    run 0 "$TWK" run --quiet --set job.driver=modes "$TMP/job.toml"
    [ -e "$stale" ] && fail "the stale run folder was not removed"
    [ -d "$TMPDIR/twinkle-run.notours" ] || fail "a folder whose name names no driver was removed"
    rmdir "$TMPDIR/twinkle-run.notours"
    # A TMPDIR too long for a Unix socket path: the run uses /tmp and still works.
    long="$TMPDIR/$(printf 'd%.0s' $(seq 1 100))"
    mkdir -p "$long"
    before=$(ls -d /tmp/twinkle-run.* 2>/dev/null | wc -l)
    TMPDIR="$long" run 0 "$TWK" run --quiet --set job.driver=modes "$TMP/job.toml"
    grep -q "File name too long\|internal error" "$TMP/err" && fail "a long TMPDIR broke the run"
    [ "$(ls -d /tmp/twinkle-run.* 2>/dev/null | wc -l)" -eq "$before" ] || fail "a run folder was left in /tmp"
    rmdir "$long"
    expect_clean
    ;;
  log_dir_full)
    # A --log-dir whose file system fills up during the run (/dev/full fails every write with
    # ENOSPC): the driver warns once, naming the file and the error, and the run succeeds.
    write_job "" ""
    mkdir -p "$TMP/logs"
    ln -s /dev/full "$TMP/logs/a-0.log"
    ln -s /dev/full "$TMP/logs/b-1.log"
    run 0 "$TWK" run --set job.driver=env --log-dir "$TMP/logs" "$TMP/job.toml"
    expect_err "twinkle: warning: --log-dir $TMP/logs: cannot write "
    expect_err ".log (No space left on device); the run goes on"
    [ "$(grep -c -- "--log-dir $TMP/logs: cannot write" "$TMP/err")" -eq 1 ] ||
      { cat "$TMP/err"; fail "two full log files, but not exactly one warning"; }
    expect_out "[a:0] env asked"
    grep -q "env asked" "$TMP/logs/a-3.log" || fail "the other workers' logs stopped"
    expect_clean
    ;;
  *) fail "unknown case $4" ;;
esac
echo "ok: $4"
