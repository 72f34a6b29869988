#!/usr/bin/env bash
# `meson test --benchmark`: the job service (issue 21), measured in one run on this machine.
#  1. `twinkle submit --wait` of a short job (the fixture plugin's `modes` driver, 6 workers) from
#     the command to its end, next to `twinkle run --address` of the same job on the same head.
#  2. With 10,000 ended jobs in the history: `twinkle jobs` and `twinkle jobs --all --json`, next
#     to `twinkle nodes --address` (one round trip to the head, the same process start), the
#     head's resident memory and the state folder's size.
#  3. The dashboard's jobs view with that history (the first page, and of ?all=1), next to the same.
# Usage: jobs.sh TWINKLE_BINARY FIXTURE_PLUGIN
set -euo pipefail
TWK=$1 PLUGIN=$2
TMP=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-bench-jobs.XXXXXX")
export HOME="$TMP/home"
mkdir -p "$HOME"
unset TWINKLE_ADDRESS TWINKLE_KEY TWINKLE_HEAD_KEY TWINKLE_AUTHORIZED_KEYS TWINKLE_HOME
HEAD=""
stop_head() { [ -z "$HEAD" ] || { kill "$HEAD" 2>/dev/null; wait "$HEAD" 2>/dev/null || true; HEAD=""; }; }
trap 'stop_head; pkill -KILL -f -- "$TMP/" 2>/dev/null || true; rm -rf "$TMP"' EXIT

start_head() {
  : >"$TMP/head.log"
  "$TWK" node start --head --bind 127.0.0.1 --port 0 --cpus 8 --state-dir "$TMP/state" \
    --cache-dir "$TMP/cache" --dashboard 0 >"$TMP/head.log" 2>&1 &
  HEAD=$!
  for _ in $(seq 200); do grep -q "joined the cluster" "$TMP/head.log" && break; sleep 0.05; done
  ADDR=$(grep -o 'tcp://127.0.0.1:[0-9]*' "$TMP/head.log" | head -1)
}

now() { date +%s%N; }
secs() { python3 -c "print(($2 - $1) / 1e9)"; }
median() { printf '%s\n' "$@" | sort -g | sed -n "$(( ($# + 1) / 2 ))p"; }

mkdir -p "$TMP/job"
cat >"$TMP/job/job.toml" <<TOML
[job]
name = "bench"
plugin = "$PLUGIN"
driver = "modes"
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

start_head
submit=() interactive=()
for rep in 1 2 3 4 5; do
  t0=$(now)
  "$TWK" submit --wait "$TMP/job/job.toml" --address "$ADDR" >/dev/null 2>&1
  submit+=("$(secs "$t0" "$(now)")")
  t0=$(now)
  "$TWK" run --quiet --set job.mode=remote "$TMP/job/job.toml" --address "$ADDR" >/dev/null 2>&1
  interactive+=("$(secs "$t0" "$(now)")")
done
s=$(median "${submit[@]}") i=$(median "${interactive[@]}")
printf 'submit --wait of a 6-worker job, command to end:    %.3f s median of 5\n' "$s"
printf 'twinkle run --address of the same job, same head:   %.3f s median of 5\n' "$i"
printf 'ratio: %.2fx\n' "$(python3 -c "print($s / $i)")"

# 10,000 ended jobs, written into the history as the head would have (the head stopped).
stop_head
python3 - "$TMP/state/jobs.db" <<'PY'
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1])
now = int(time.time())
rows = [("bench", "user%d" % (i % 7), "submitted", "SUCCEEDED", "its driver exited with code 0",
         now - 100000 + i, now - 100000 + i, now - 99990 + i, 0, 0, 0, 1, 6, 1, 0.0, "r%d" % i,
         "laptop", "", "job.toml", "0" * 64, "[]", 0, "", "[]",
         '[{"group":"a","rank":0,"node":"vm","gpus":[]}]', 0, 30.0, 0, 0, 0) for i in range(10000)]
db.executemany("INSERT INTO jobs (name, user, kind, state, reason, submitted, started, ended, "
               "retries, max_retries, exit_code, gpus, cpus, nodes, gpu_seconds, run, from_host, "
               "stopped_by, job_file, sha256, overrides, after_job, after_condition, demand, "
               "placement, resume_on_retry, stop_grace_s, supervisor_pid, supervisor_start, "
               "stop_requested) VALUES (" + ", ".join("?" * 30) + ")", rows)
db.commit()
PY
start_head
jobs=() all=() ref=()
for rep in 1 2 3 4 5; do
  t0=$(now); "$TWK" jobs --address "$ADDR" >/dev/null; jobs+=("$(secs "$t0" "$(now)")")
  t0=$(now); "$TWK" jobs --all --json --address "$ADDR" >"$TMP/all.json"; all+=("$(secs "$t0" "$(now)")")
  t0=$(now); "$TWK" nodes --address "$ADDR" >/dev/null; ref+=("$(secs "$t0" "$(now)")")
done
count=$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))))' "$TMP/all.json")
j=$(median "${jobs[@]}") a=$(median "${all[@]}") r=$(median "${ref[@]}")
rss=$(awk '/VmRSS/ {print $2}' "/proc/$HEAD/status")
size=$(du -sk "$TMP/state" | awk '{print $1}')
printf 'history: %s jobs (twinkle jobs --all --json)\n' "$count"
printf 'twinkle jobs (active and newest 20):      %.3f s median of 5 (%.2fx twinkle nodes)\n' "$j" "$(python3 -c "print($j / $r)")"
printf 'twinkle jobs --all --json (every job):    %.3f s median of 5 (%.2fx twinkle nodes)\n' "$a" "$(python3 -c "print($a / $r)")"
printf 'twinkle nodes --address (reference):      %.3f s median of 5\n' "$r"
printf "the head's resident memory (with its agent): %s KiB; the state folder: %s KiB\n" "$rss" "$size"

# 3. The dashboard's jobs view with the same history: the API call the page makes (the first page
#    of 50), and of the whole history, next to `twinkle nodes` above.
link=$("$TWK" dashboard --address "$ADDR" | grep -o 'http://127.0.0.1:[0-9]*/login?token=[0-9a-f]*')
web=${link%%/login*}
went=$(curl -s -o /dev/null -w '%{redirect_url}' -c "$TMP/jar" -H "Origin: $web" \
  --data "token=${link##*token=}" "$web/login")
key=(-H "X-Twinkle-Key: ${went##*#key=}")  # the session's key, from the login's redirect
view=() hist=()
for rep in 1 2 3 4 5; do
  view+=("$(curl -s -o "$TMP/view.json" -w '%{time_total}' -b "$TMP/jar" "${key[@]}" "$web/api/v1/jobs")")
  hist+=("$(curl -s -o "$TMP/page.json" -w '%{time_total}' -b "$TMP/jar" "${key[@]}" "$web/api/v1/jobs?all=1")")
done
total=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["total"])' "$TMP/page.json")
v=$(median "${view[@]}") h=$(median "${hist[@]}")
printf 'dashboard jobs view (GET /api/v1/jobs):           %.3f s median of 5 (%.2fx twinkle nodes)\n' "$v" "$(python3 -c "print($v / $r)")"
printf 'dashboard history, first page of %s (?all=1):  %.3f s median of 5 (%.2fx twinkle nodes)\n' "$total" "$h" "$(python3 -c "print($h / $r)")"
