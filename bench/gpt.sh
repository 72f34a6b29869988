#!/usr/bin/env bash
# `meson test --benchmark`: examples/gpt (issue 22), measured in one run on this machine: training
# throughput with 1 and 2 trainer workers (and the sampler generating beside them), where a step's
# time goes (torch's own compute, the all_reduce of the gradients, Twinkle's dispatch and collect),
# and the weight broadcast to the sampler next to a memcpy of the same bytes.
# Usage: gpt.sh TWINKLE_BINARY GPT_PLUGIN SOURCE_ROOT [STEPS]
set -euo pipefail
TWK=$1 GPT=$2 SRC=$3 STEPS=${4:-300}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-bench-gpt.XXXXXX")
trap 'pkill -KILL -f -- "$TMP/" 2>/dev/null || true; rm -rf "$TMP"' EXIT
sed -e "s|^plugin *=.*|plugin = \"$GPT\"|" "$SRC/examples/gpt/job.toml" >"$TMP/job.toml"
cp "$SRC/examples/gpt/tinyshakespeare.txt.gz" "$TMP/"
common=(--quiet --set args.steps="$STEPS" --set args.eval_every=100 --set args.sync_every=100
        --set args.target_val_loss=9)
"$TWK" run "$TMP/job.toml" "${common[@]}" --set group.trainer.ranks=1 \
  --set group.trainer.mesh.dp=1 >"$TMP/one" 2>&1 || { cat "$TMP/one"; exit 1; }
"$TWK" run "$TMP/job.toml" "${common[@]}" >"$TMP/two" 2>&1 || { cat "$TMP/two"; exit 1; }
python3 - "$TMP/one" "$TMP/two" "$STEPS" <<'PY'
import re, sys
def read(path):
    t = open(path).read()
    tps = float(re.search(r"^throughput: ([0-9.]+) tokens/s", t, re.M).group(1))
    step, torch, comm, twk = map(float, re.search(
        r"^per step: ([0-9.]+) ms, of which torch ([0-9.]+) ms, all_reduce ([0-9.]+) ms, "
        r"twinkle's dispatch and collect (-?[0-9.]+) ms", t, re.M).groups())
    kib, bc, mc = map(float, re.search(
        r"^weight broadcast: ([0-9]+) KiB in ([0-9.]+) ms \(a memcpy of them: ([0-9.]+) ms;",
        t, re.M).groups())
    return tps, step, torch, comm, twk, kib, bc, mc
one, two = read(sys.argv[1]), read(sys.argv[2])
print(f"examples/gpt, {sys.argv[3]} steps of 32 sequences x 64 characters, 1 sampler beside")
print(f"{'trainers':<10}{'tokens/s':>10}{'step ms':>10}{'torch':>9}{'all_reduce':>12}"
      f"{'twinkle':>9}{'twinkle share':>15}")
for n, r in (("1", one), ("2 (dp)", two)):
    tps, step, torch, comm, twk, *_ = r
    print(f"{n:<10}{tps:>10.0f}{step:>10.2f}{torch:>9.2f}{comm:>12.3f}{twk:>9.2f}"
          f"{100 * (comm + twk) / step:>14.1f}%")
print(f"2 trainers / 1 trainer tokens/s: {two[0] / one[0]:.2f}x")
kib, bc, mc = two[5:]
print(f"weight broadcast trainer:0 -> sampler ({kib:.0f} KiB): {bc:.3f} ms; memcpy of the same "
      f"bytes {mc:.3f} ms; ratio {bc / mc:.1f}x")
PY
