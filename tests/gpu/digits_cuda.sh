#!/usr/bin/env bash
# GPU check: the digits example on a cuda group (CUDA kernels, NCCL all_reduce) reaches the CPU
# run's loss and accuracy. Exits 77 (skipped) where there is no GPU or no CUDA build.
# Usage: digits_cuda.sh TWINKLE_BINARY SOURCE_ROOT BUILD_EXAMPLES
TWK=$1
SRC=$2
EX=$3
source "$SRC/tests/integration/lib.sh"
export TMPDIR="$TMP/run"
mkdir -p "$TMPDIR"

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "skipped: no GPU on this machine"
  exit 77
fi
if ! ldd "$EX/digits/libdigits.so" | grep -q libcudart; then
  echo "skipped: this build has no CUDA kernels"
  exit 77
fi
gpus=$(nvidia-smi -L | wc -l)
run 0 "$TWK" run --quiet --set group.model.ranks=1 "$EX/digits/job.toml"
cpu=$(sed -n 's/^final loss: //p' "$TMP/out")
run 0 "$TWK" run --quiet --set group.model.ranks="$gpus" "$EX/digits/job-cuda.toml"
gpu=$(sed -n 's/^final loss: //p' "$TMP/out")
acc=$(sed -n 's/^accuracy: //p' "$TMP/out")
python3 -c "import sys; sys.exit(0 if float('$acc') >= 0.95 else 1)" || fail "GPU accuracy $acc < 0.95"
python3 -c "import sys; sys.exit(0 if abs(float('$cpu') - float('$gpu')) <= 1e-4 else 1)" ||
  fail "GPU final loss $gpu differs from the CPU's $cpu by more than 1e-4"
echo "ok: $gpus GPU(s): loss $gpu accuracy $acc (cpu loss $cpu)"
