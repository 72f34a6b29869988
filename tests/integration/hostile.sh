#!/usr/bin/env bash
# Hostile input against the real binary: plugins that exit, crash or hang while loading, broken
# plugin files, job files that are too deep, too large, out of range or not files at all, and a
# method that returns a value nested too deep. Each must end with its exit code and one clear
# line: never a signal, a hang or a silent success, and nothing left behind.
# Usage: hostile.sh TWINKLE_BINARY SOURCE_ROOT FIXTURE_DIR CASE
TWK=$1
SRC=$2
FIX=$3
source "$SRC/tests/integration/lib.sh"

export TMPDIR="$TMP/run"  # where runs and load checks could leave something
mkdir -p "$TMPDIR"

# Every command gets a deadline: a hang fails the test instead of stalling it.
twk() { timeout -k 2 20 "$TWK" "$@"; }

# Nothing may remain: no process started from this test's files, nothing in TMPDIR.
expect_clean() {
  local deadline=$((SECONDS + 3))
  while pgrep -f -- "$FIX/libhostile_|$TMP/" >/dev/null; do
    [ $SECONDS -lt $deadline ] || { pgrep -af -- "$FIX/libhostile_|$TMP/"; fail "processes left behind"; }
    sleep 0.05
  done
  [ -z "$(ls -A "$TMPDIR")" ] || { ls -laR "$TMPDIR"; fail "temporary files left behind"; }
}

# one_line: stderr is exactly one line (the error), whatever the plugin printed to stdout.
one_line() { [ "$(wc -l <"$TMP/err")" -eq 1 ] || { cat "$TMP/err"; fail "stderr is not one line"; }; }

plugin_job() {
  printf '[job]\nplugin = "%s"\n[[group]]\nname = "a"\nranks = 1\n' "$1" >"$TMP/job.toml"
}

case $4 in
  plugin_exit)
    P=$FIX/libhostile_ctor_exit0.so
    run 3 twk inspect "$P"
    expect_err "twinkle: $P: the plugin's constructor called exit(0) while loading; a plugin must not end the process"
    one_line
    plugin_job "$P"
    run 3 twk run "$TMP/job.toml"
    expect_out "DEVICE PLACEMENT TOPOLOGY"
    expect_err "$P: the plugin's constructor called exit(0) while loading"
    run 3 twk inspect "$FIX/libhostile_ctor_exit3.so"
    expect_err "libhostile_ctor_exit3.so: the plugin's constructor called exit(3) while loading"
    run 3 twk inspect "$FIX/libhostile_entry_exit0.so"
    expect_err "libhostile_entry_exit0.so: twinkle_plugin_v1() called exit(0) while loading"
    expect_clean
    ;;
  plugin_crash)
    run 3 twk inspect "$FIX/libhostile_ctor_abort.so"
    expect_err "libhostile_ctor_abort.so: the plugin's constructor aborted (SIGABRT) while loading"
    one_line
    run 3 twk inspect "$FIX/libhostile_ctor_segv.so"
    expect_err "libhostile_ctor_segv.so: the plugin's constructor was killed by SIGSEGV while loading"
    plugin_job "$FIX/libhostile_ctor_segv.so"
    run 3 twk run "$TMP/job.toml"
    expect_err "libhostile_ctor_segv.so: the plugin's constructor was killed by SIGSEGV while loading"
    expect_clean
    ;;
  plugin_hang)
    export TWINKLE_PLUGIN_LOAD_TIMEOUT_S=1
    run 3 twk inspect "$FIX/libhostile_ctor_hang.so"
    expect_err "libhostile_ctor_hang.so: the plugin's constructor did not finish loading within 1 s; a plugin's constructors and twinkle_plugin_v1() must return (TWINKLE_PLUGIN_LOAD_TIMEOUT_S sets the limit)"
    one_line
    plugin_job "$FIX/libhostile_entry_hang.so"
    run 3 twk run "$TMP/job.toml"
    expect_err "libhostile_entry_hang.so: twinkle_plugin_v1() did not finish loading within 1 s"
    TWINKLE_PLUGIN_LOAD_TIMEOUT_S=forever run 3 twk inspect "$FIX/libhostile_ctor_hang.so"
    expect_err "TWINKLE_PLUGIN_LOAD_TIMEOUT_S=forever: must be a number of seconds between 0 and 3600"
    expect_clean
    ;;
  plugin_files)
    # A plugin cut to half its size: today's dlopen maps it and dies of SIGBUS.
    size=$(stat -c %s "$FIX/libfixture_ok.so")
    head -c $((size / 2)) "$FIX/libfixture_ok.so" >"$TMP/libhalf.so"
    run 3 twk inspect "$TMP/libhalf.so"
    expect_err "$TMP/libhalf.so: the file is truncated ($((size / 2)) bytes, its ELF headers need $size); rebuild the plugin"
    one_line
    mkfifo "$TMP/libfifo.so"
    run 3 twk inspect "$TMP/libfifo.so"
    expect_err "$TMP/libfifo.so: is a FIFO, not a regular file; job.plugin must name the plugin's .so file"
    run 3 twk inspect /dev/zero
    expect_err "/dev/zero: is a character device, not a regular file"
    mkdir "$TMP/libdir.so"
    run 3 twk inspect "$TMP/libdir.so"
    expect_err "$TMP/libdir.so: is a directory"
    plugin_job "$TMP/libfifo.so"
    run 3 twk run "$TMP/job.toml"
    expect_err "libfifo.so: is a FIFO, not a regular file"
    rm -rf "$TMP/libhalf.so" "$TMP/libfifo.so" "$TMP/libdir.so"
    expect_clean
    ;;
  plugin_table)
    run 3 twk inspect "$FIX/libhostile_data_entry.so"
    expect_err "libhostile_data_entry.so: twinkle_plugin_v1 is data, not a function; export it as extern \"C\" const twk_plugin_v1* twinkle_plugin_v1(void) (TWINKLE_PLUGIN does)"
    one_line
    run 3 twk inspect "$FIX/libhostile_garbage_pointer.so"
    expect_err "libhostile_garbage_pointer.so: class Model method step invoke function points outside the plugin's code (a garbage pointer); the table is corrupt"
    run 3 twk inspect "$FIX/libhostile_garbage_name.so"
    expect_err "libhostile_garbage_name.so: reading the plugin's table was killed by SIGSEGV: the table has garbage pointers or counts; rebuild the plugin against this twinkle's SDK"
    run 3 twk inspect "$FIX/libhostile_huge_count.so"
    expect_err "libhostile_huge_count.so: the table lists classes: 4000000000, more than the 65536 a table may hold; the table is corrupt"
    run 3 twk inspect "$FIX/libhostile_garbage_count.so"
    expect_err "libhostile_garbage_count.so: class 1 table is 0 bytes, smaller than 52"
    one_line
    expect_clean
    ;;
  job_file)
    P=$FIX/libfixture_ok.so
    # Thousands of levels of dotted keys in [args].
    python3 -c 'print("[job]\nplugin = \"x.so\"\n[[group]]\nname = \"a\"\nranks = 1\n[args]\n" + ".".join(["k"] * 5000) + " = 1")' >"$TMP/job.toml"
    run 2 twk run "$TMP/job.toml"
    expect_err "twinkle: $TMP/job.toml:7:512: a key nests deeper than 256 levels; TOML tables and values may nest at most 256 deep"
    one_line
    # Deep across lines: a 200-level table header and a 200-level key inside it.
    python3 -c 'print("[job]\nplugin = \"x.so\"\n[[group]]\nname = \"a\"\nranks = 1\n[" + ".".join(["t"] * 200) + "]\n" + ".".join(["k"] * 200) + " = 1")' >"$TMP/job.toml"
    run 2 twk topology "$TMP/job.toml"
    expect_err "job.toml:7:113: a value nests deeper than 256 levels; TOML tables and values may nest at most 256 deep"
    # Ranks that do not fit: never truncated, never a negative rank.
    for r in 2147483648 9223372036854775807 65536; do
      printf '[job]\nplugin = "x.so"\n[[group]]\nname = "a"\nranks = [%s]\n' "$r" >"$TMP/job.toml"
      run 2 twk topology "$TMP/job.toml"
      expect_err "job.toml:5:10: group \"a\": rank $r is out of range; ranks go from 0 to 65535"
    done
    printf '[job]\nplugin = "x.so"\n[[group]]\nname = "a"\nranks = 100000\n' >"$TMP/job.toml"
    run 2 twk topology "$TMP/job.toml"
    expect_err "job.toml:5:9: group.a.ranks must be at most 65536, not 100000"
    printf '[job]\nplugin = "x.so"\nmode = "remote"\nnproc_per_node = 9223372036854775807\n[[group]]\nname = "a"\nranks = [65535]\ndevice = "cuda"\n' >"$TMP/job.toml"
    run 2 twk topology "$TMP/job.toml"
    expect_err "job.toml:4:18: job.nproc_per_node must be at most 65536, not 9223372036854775807"
    # timeout_s outside its documented range.
    for t in 1e10 1e300 inf nan -1 0; do
      printf '[job]\nplugin = "x.so"\ntimeout_s = %s\n[[group]]\nname = "a"\nranks = 1\n' "$t" >"$TMP/job.toml"
      run 2 twk topology "$TMP/job.toml"
      expect_err "job.toml:3:13: job.timeout_s must be more than 0 and at most 604800 (7 days)"
    done
    printf '[job]\nplugin = "x.so"\n[[group]]\nname = "a"\nranks = 1\n' >"$TMP/job.toml"
    run 2 twk topology --set job.timeout_s=inf "$TMP/job.toml"
    expect_err "--set job.timeout_s: job.timeout_s must be more than 0 and at most 604800 (7 days), not inf"
    # Group names: a NUL, a newline, an escape code, hundreds of characters.
    for name in 'a\u0000b' 'a\nb' '\u001b[31mred' "$(printf 'g%.0s' {1..300})"; do
      printf '[job]\nplugin = "x.so"\n[[group]]\nname = "%s"\nranks = 1\n' "$name" >"$TMP/job.toml"
      run 2 twk topology "$TMP/job.toml"
      expect_err "job.toml:4:8: group name \""
      expect_err "is not allowed: use 1 to 64 letters, digits, '_', '.' or '-'"
      LC_ALL=C grep -q $'[\x01-\x08\x0b-\x1f]' "$TMP/err" && fail "a control character reached the terminal"
      one_line
    done
    expect_err "group name \"$(printf 'g%.0s' {1..40})... (300 bytes)\" is not allowed"
    printf '[job]\nplugin = "x.so"\n[[group]]\nname = "a\\nb"\nranks = 1\n' >"$TMP/job.toml"
    run 2 twk topology "$TMP/job.toml"
    expect_err 'group name "a\x0ab" is not allowed'
    # Not a job file at all.
    run 2 twk run /dev/zero
    expect_err "twinkle: /dev/zero: is a character device, not a regular file; give the path of a TOML job file"
    one_line
    run 2 twk topology /dev/urandom
    expect_err "/dev/urandom: is a character device, not a regular file"
    mkfifo "$TMP/fifo.toml"
    run 2 twk run "$TMP/fifo.toml"
    expect_err "$TMP/fifo.toml: is a FIFO, not a regular file"
    run 2 twk run "$TMP"
    expect_err "$TMP: is a directory, not a regular file"
    head -c 2000000 /dev/zero | tr '\0' '#' >"$TMP/big.toml"
    run 2 twk run "$TMP/big.toml"
    expect_err "$TMP/big.toml: the job file is 2000000 bytes, more than the 1048576 allowed"
    rm -f "$TMP/fifo.toml" "$TMP/big.toml" "$TMP/job.toml"
    expect_clean
    ;;
  deep_value)
    # A method that returns a value nested 100,000 deep: the method's error, not a dead worker.
    printf '[job]\nplugin = "%s"\ndriver = "deep_value"\n[[group]]\nname = "a"\nranks = 1\n' \
      "$FIX/libfixture_runtime.so" >"$TMP/job.toml"
    run 1 twk run "$TMP/job.toml"
    expect_err "Deep.make failed on group a rank 0"
    expect_err "value nests deeper than 256 levels of lists and maps"
    if grep -q "SIGSEGV\|internal error\|died" "$TMP/err"; then cat "$TMP/err"; fail "the worker crashed"; fi
    # The same value as an argument from the driver: the driver entry's error.
    run 1 twk run --set job.driver=deep_argument "$TMP/job.toml"
    expect_err "value nests deeper than 256 levels of lists and maps"
    expect_clean
    ;;
  *) fail "unknown case $4" ;;
esac
echo "ok: $4"
