#!/usr/bin/env bash
# Integration tests of `twinkle topology`, `twinkle nodes` and the top-level flags.
# Usage: cli.sh TWINKLE_BINARY SOURCE_ROOT CASE
TWK=$1
SRC=$2
source "$SRC/tests/integration/lib.sh"

case $3 in
  topology_example)
    run 0 "$TWK" topology "$SRC/examples/hello/job.toml"
    expect_out "DEVICE PLACEMENT TOPOLOGY"
    expect_out "DeviceGroup: model"
    expect_out "Dimensions : dp=2 × tp=2"
    expect_width_80
    run 0 "$TWK" topology --ascii "$SRC/examples/hello/job.toml"
    expect_out "| * DeviceGroup: processor"
    LC_ALL=C grep -q $'[\x80-\xff]' "$TMP/out" && fail "--ascii printed non-ASCII bytes"
    expect_width_80
    ;;
  topology_json)
    run 0 "$TWK" topology --json --set job.name=renamed "$SRC/examples/hello/job.toml"
    python3 - "$TMP/out" <<'PY' || fail "--json output is not the expected JSON"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["job"] == "renamed", j["job"]
assert [g["name"] for g in j["groups"]] == ["model", "processor"]
assert j["groups"][0]["mesh"]["dims"] == [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}]
assert j["groups"][1]["ranks"] == [4, 5]
PY
    ;;
  topology_gpus)
    cat >"$TMP/job.toml" <<'TOML'
[job]
plugin = "x.so"
[[group]]
name = "model"
ranks = 4
device = "cuda"
mesh = { dp = 2, tp = 2 }
[[group]]
name = "sampler"
ranks = 2
device = "cuda"
TOML
    # No NVML on the test machines: CUDA_VISIBLE_DEVICES names the physical GPUs.
    if ! ldconfig -p 2>/dev/null | grep -q libnvidia-ml.so.1; then
      CUDA_VISIBLE_DEVICES= run 2 "$TWK" topology "$TMP/job.toml"
      expect_err "job.toml:3:1: group \"model\" does not fit"
      expect_err "declare them with --gpus N"
      CUDA_VISIBLE_DEVICES= run 0 "$TWK" topology --gpus 6 "$TMP/job.toml"
      expect_out "rank 5 → "
      expect_out "GPU 5"
      CUDA_VISIBLE_DEVICES=7,6,5,4,3,2 run 0 "$TWK" topology "$TMP/job.toml"
      expect_out "rank 0 → "
      grep -q "rank 0 → .* GPU 7" "$TMP/out" || fail "rank 0 is not on physical GPU 7"
      grep -q "rank 5 → .* GPU 2" "$TMP/out" || fail "rank 5 is not on physical GPU 2"
    fi
    ;;
  bad_job)
    printf '[job]\nplugin = "x.so"\n[[group]]\nname = "a"\nranks = [0, 1]\n[[group]]\nname = "b"\nranks = [1]\n' >"$TMP/job.toml"
    run 2 "$TWK" topology "$TMP/job.toml"
    expect_err "job.toml:8:9: group \"b\": ranks overlap group \"a\" (rank 1)"
    run 2 "$TWK" topology "$TMP/missing.toml"
    expect_err "missing.toml: no such job file"
    run 2 "$TWK" topology --set job.sed=1 "$SRC/examples/hello/job.toml"
    expect_err "--set job.sed: unknown key \"sed\" in job; did you mean \"seed\"?"
    run 2 "$TWK" topology
    expect_err "job is required"
    run 2 "$TWK" frobnicate
    ;;
  nodes)
    run 0 "$TWK" nodes
    expect_out "HOST"
    expect_out "ALIVE"
    run 0 "$TWK" nodes --json
    python3 - "$TMP/out" <<'PY' || fail "nodes --json is not the expected JSON"
import json, os, sys
j = json.load(open(sys.argv[1]))
n = j["nodes"][0]
assert n["cpus"] >= 1 and n["memory_bytes"] > 0 and n["state"] == "ALIVE"
assert isinstance(n["gpus"], list)
PY
    ;;
  version_help)
    # The version, and the facts that decide whether this build works with a plugin, with the other
    # members of a cluster and with the GPUs: read from the sources and the build's config.
    run 0 "$TWK" --version
    config=$(dirname "$TWK")/twinkle_config.h
    version=$(sed -n 's/^#define TWINKLE_VERSION "\(.*\)"$/\1/p' "$config")
    abi=$(sed -n 's/^#define TWK_ABI_VERSION \([0-9]*\)u$/\1/p' "$SRC/plugins/include/twinkle/plugin.h")
    protocol=$(sed -n 's/^inline constexpr std::uint16_t kProtocolVersion = \([0-9]*\);$/\1/p' "$SRC/transports/zmq/message.hpp")
    yes_no() { [ "$(sed -n "s/^#define $1 //p" "$config")" = 1 ] && echo yes || echo no; }
    [ -n "$version" ] && [ -n "$abi" ] && [ -n "$protocol" ] || fail "cannot read the versions from the sources"
    printf 'twinkle %s\nplugin ABI version: %s\nwire protocol version: %s\nCUDA: %s\nNCCL: %s\n' \
      "$version" "$abi" "$protocol" "$(yes_no TWINKLE_HAVE_CUDA)" "$(yes_no TWINKLE_HAVE_NCCL)" >"$TMP/want"
    diff -u "$TMP/want" "$TMP/out" || fail "--version does not say what this build is"
    for cmd in "" topology nodes; do
      run 0 "$TWK" $cmd --help
      expect_out "Usage"
    done
    ;;
  inspect)
    PLUGIN=$4
    run 0 "$TWK" inspect "$PLUGIN"
    expect_out "plugin hello 1.0.0"
    expect_out "class Model (execute all)"
    grep -qE "^  by_data_rank +slice_dp +all +flatten +job$" "$TMP/out" || fail "by_data_rank row is wrong"
    grep -qE "^  leader +all +first +first +job$" "$TMP/out" || fail "leader row is wrong"
    grep -qE "^  stage +all +all +last_pp +job$" "$TMP/out" || fail "stage row is wrong"
    expect_out "drivers: main"
    run 0 "$TWK" inspect --json "$PLUGIN"
    python3 - "$TMP/out" <<'PY' || fail "inspect --json is not the expected JSON"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["name"] == "hello" and j["abi_version"] == 1
model = next(c for c in j["classes"] if c["name"] == "Model")
words = next(m for m in model["methods"] if m["name"] == "words")
assert words["dispatch"] == "custom" and words["custom_dispatch"] == "every_other", words
assert words["collect"] == "custom" and words["custom_collect"] == "join_lines", words
assert j["drivers"] == ["main"]
PY
    echo "not a plugin" >"$TMP/notes.txt"
    run 3 "$TWK" inspect "$TMP/notes.txt"
    expect_err "notes.txt: not a shared library (no ELF header)"
    run 3 "$TWK" inspect "$TMP/absent.so"
    expect_err "absent.so: no such plugin file"
    ;;
  sdk_out_of_tree)
    # Install into a staging folder and build a plugin with nothing but pkg-config's flags.
    BUILD=$4
    meson install -C "$BUILD" --no-rebuild --destdir "$TMP/dest" >"$TMP/install.log" 2>&1 ||
      { cat "$TMP/install.log"; fail "meson install failed"; }
    pc=$(find "$TMP/dest" -name twinkle-plugin.pc | head -1)
    [ -n "$pc" ] || fail "no twinkle-plugin.pc installed"
    prefix=$(sed -n "s/^prefix=//p" "$pc")
    cflags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --define-variable=prefix="$TMP/dest$prefix" --cflags --libs twinkle-plugin) ||
      fail "pkg-config cannot read twinkle-plugin.pc"
    cat >"$TMP/mine.cpp" <<'CPP'
#include <twinkle/plugin.hpp>
struct Counter {
  explicit Counter(twinkle::Context&) {}
  int twice(twinkle::Context&, int x) { return 2 * x; }
};
TWINKLE_CLASS(Counter, twinkle::execute::all);
TWINKLE_METHOD(Counter, twice, twinkle::dispatch::all, twinkle::collect::sum);
TWINKLE_DRIVER(main, twinkle::Driver& d) { d.log("hi"); }
TWINKLE_PLUGIN("mine", "0.0.1");
CPP
    # shellcheck disable=SC2086
    c++ -shared -fPIC $cflags "$TMP/mine.cpp" -o "$TMP/libmine.so" || fail "the out-of-tree plugin does not build"
    exports=$(nm -D --defined-only "$TMP/libmine.so" | awk '{print $3}')
    [ "$exports" = "twinkle_plugin_v1" ] || fail "the plugin exports more than its entry symbol: $exports"
    run 0 "$TWK" inspect "$TMP/libmine.so"
    expect_out "plugin mine 0.0.1"
    grep -qE "^  twice +all +all +sum +job$" "$TMP/out" || fail "twice row is wrong"
    ;;
  keygen)
    run 0 "$TWK" keygen --out "$TMP/keys"
    expect_out "wrote $TMP/keys/twinkle.key"
    [ "$(stat -c %a "$TMP/keys/twinkle.key")" = 600 ] || fail "twinkle.key is not private"
    [ "$(stat -c %a "$TMP/keys")" = 700 ] || fail "the key folder is not private"
    pub=$(sed -n 's/^public key: //p' "$TMP/out")
    [ ${#pub} -eq 40 ] || fail "no 40-character public key printed"
    [ "$(cut -d" " -f1 "$TMP/keys/twinkle.pub")" = "$pub" ] || fail "twinkle.pub does not start with the public key"
    run 2 "$TWK" keygen --out "$TMP/keys"
    expect_err "twinkle.key already exists; keep it, or pass --force to replace it"
    run 0 "$TWK" keygen --out "$TMP/keys" --force
    [ "$(sed -n 's/^public key: //p' "$TMP/out")" != "$pub" ] || fail "--force kept the old key"
    HOME="$TMP/home" run 0 "$TWK" keygen
    [ -f "$TMP/home/.twinkle/twinkle.key" ] || fail "no key pair in ~/.twinkle by default"
    ;;
  *) fail "unknown case $3" ;;
esac
echo "ok: $3"
