#!/usr/bin/env bash
# Integration tests of `twinkle topology`, `twinkle nodes`, `twinkle inspect`, `twinkle keygen`, the
# top-level flags, and of what `meson install` gives SDK users.
# Usage: cli.sh TWINKLE_BINARY SOURCE_ROOT CASE [ARG]
TWK=$1
SRC=$2
source "$SRC/tests/integration/lib.sh"

# stage_install BUILD: `meson install` of BUILD into $TMP/dest. Sets PREFIX, BINDIR, SYSCONFDIR and
# DATADIR to the configured (absolute) folders, and STAGE to where PREFIX lies in the staging folder.
stage_install() {
  meson install -C "$1" --no-rebuild --destdir "$TMP/dest" >"$TMP/install.log" 2>&1 ||
    { cat "$TMP/install.log"; fail "meson install failed"; }
  eval "$(meson introspect "$1" --buildoptions | python3 -c '
import json, os, shlex, sys
o = {x["name"]: x["value"] for x in json.load(sys.stdin)}
for name in ["prefix", "bindir", "sysconfdir", "datadir"]:
    print("%s=%s" % (name.upper(), shlex.quote(os.path.join(o["prefix"], o[name]))))
')"
  STAGE=$TMP/dest$PREFIX
}

# write_plugin FILE: a small plugin that uses the SDK, the way an out-of-tree user writes one.
write_plugin() {
  cat >"$1" <<'CPP'
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
}

# check_plugin SO: exports only the entry symbol (the version script reached the link) and loads.
check_plugin() {
  local exports
  exports=$(nm -D --defined-only "$1" | awk '{print $3}')
  [ "$exports" = "twinkle_plugin_v1" ] || fail "the plugin exports more than its entry symbol: $exports"
  run 0 "$TWK" inspect "$1"
  expect_out "plugin mine 0.0.1"
  grep -qE "^  twice +all +all +sum +job$" "$TMP/out" || fail "twice row is wrong"
}

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
    protocol=$(sed -n 's/^inline constexpr std::uint16_t kProtocolVersion = \([0-9]*\);$/\1/p' "$SRC/transports/zmq/protocol.hpp")
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
    stage_install "$4"
    pc=$(find "$TMP/dest" -name twinkle-plugin.pc | head -1)
    [ -n "$pc" ] || fail "no twinkle-plugin.pc installed"
    prefix=$(sed -n "s/^prefix=//p" "$pc")
    cflags=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --define-variable=prefix="$TMP/dest$prefix" --cflags --libs twinkle-plugin) ||
      fail "pkg-config cannot read twinkle-plugin.pc"
    write_plugin "$TMP/mine.cpp"
    # shellcheck disable=SC2086
    c++ -shared -fPIC $cflags "$TMP/mine.cpp" -o "$TMP/libmine.so" || fail "the out-of-tree plugin does not build"
    check_plugin "$TMP/libmine.so"
    ;;
  sdk_cmake)
    # The same out of tree with CMake: find_package(Twinkle) from the staging folder.
    command -v cmake >/dev/null || { echo "cmake is not installed: skipped"; exit 77; }
    stage_install "$4"
    mkdir "$TMP/src"
    write_plugin "$TMP/src/mine.cpp"
    cat >"$TMP/src/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.13)
project(mine CXX)
find_package(Twinkle ${WANT} REQUIRED)
add_library(mine MODULE mine.cpp)
target_link_libraries(mine PRIVATE Twinkle::plugin)
CMAKE
    version=$(meson introspect "$4" --projectinfo | python3 -c 'import json, sys; print(json.load(sys.stdin)["version"])')
    generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    cmake -S "$TMP/src" -B "$TMP/cmake" "${generator[@]}" -DWANT="$version" \
      -DCMAKE_PREFIX_PATH="$STAGE" >"$TMP/cmake.log" 2>&1 ||
      { cat "$TMP/cmake.log"; fail "find_package(Twinkle $version) fails"; }
    grep -q "^Twinkle_DIR:PATH=$STAGE/" "$TMP/cmake/CMakeCache.txt" ||
      fail "CMake found a Twinkle other than the staged one: $(grep ^Twinkle_DIR "$TMP/cmake/CMakeCache.txt")"
    cmake --build "$TMP/cmake" >"$TMP/build.log" 2>&1 ||
      { cat "$TMP/build.log"; fail "the out-of-tree CMake plugin does not build"; }
    check_plugin "$TMP/cmake/libmine.so"
    # A version the installed SDK does not meet is refused at configure time.
    major=${version%%.*}
    cmake -S "$TMP/src" -B "$TMP/cmake-new" "${generator[@]}" -DWANT="$((major + 1)).0" \
      -DCMAKE_PREFIX_PATH="$STAGE" >"$TMP/cmake-new.log" 2>&1 &&
      fail "find_package(Twinkle $((major + 1)).0) accepted Twinkle $version"
    grep -q "$version" "$TMP/cmake-new.log" || { cat "$TMP/cmake-new.log"; fail "the refusal does not name the installed version"; }
    ;;
  install_layout)
    # Where `meson install` puts the completion and the systemd units: where bash-completion and
    # systemd look for them under this prefix, naming the installed binary and settings file.
    stage_install "$4"
    # The worker binary beside twinkle, where the launcher and node agents look for it.
    [ -x "$TMP/dest$BINDIR/twinkle-worker" ] || fail "twinkle-worker is not installed in $BINDIR: $(ls "$TMP/dest$BINDIR")"
    # The modules, where module_symbol looks for them once installed (LIBDIR/twinkle).
    for module in libtwinkle_gloo.so libtwinkle_notify.so libtwinkle_sha256.so \
      libtwinkle_archive.so libtwinkle_dashboard.so; do
      [ -n "$(find "$STAGE" -path "*/twinkle/$module")" ] ||
        fail "$module is not installed in LIBDIR/twinkle: $(find "$STAGE" -name 'libtwinkle_*')"
    done
    # What only the modules need is not loaded by every command: twinkle and twinkle-worker
    # start without libarchive, cpp-httplib and libcrypto.
    for bin in twinkle twinkle-worker; do
      needed=$(readelf -d "$TMP/dest$BINDIR/$bin" | grep NEEDED)
      for lib in libarchive libcpp-httplib libcrypto libssl; do
        case $needed in *"[$lib"*) fail "$bin needs $lib (it belongs in a module): $needed" ;; esac
      done
    done
    comp=$TMP/dest$DATADIR/bash-completion/completions/twinkle
    [ -f "$comp" ] || fail "no completion in $DATADIR/bash-completion/completions: $(find "$TMP/dest" -path '*completion*')"
    bash -c 'source "$1" && complete -p twinkle' _ "$comp" >"$TMP/out" 2>&1 || fail "the installed completion does not load: $(cat "$TMP/out")"
    for unit in twinkle-head.service twinkle-agent.service; do
      file=$STAGE/lib/systemd/system/$unit
      [ -f "$file" ] || fail "$unit is not in lib/systemd/system"
      bin=$(sed -n 's/^ExecStart=\([^ ]*\) .*/\1/p' "$file")
      [ "$bin" = "$BINDIR/twinkle" ] || fail "$unit runs $bin, not the installed $BINDIR/twinkle"
      [ -x "$TMP/dest$bin" ] || fail "$unit runs $bin, which is not installed"
      grep -qx "EnvironmentFile=$SYSCONFDIR/twinkle/twinkle.env" "$file" || fail "$unit reads no $SYSCONFDIR/twinkle/twinkle.env"
    done
    env=$TMP/dest$DATADIR/twinkle/twinkle.env
    [ -f "$env" ] || fail "no twinkle.env template in $DATADIR/twinkle"
    grep -q @ "$env" && fail "twinkle.env has unsubstituted @variables@: $(grep @ "$env")"
    grep -qx "TWINKLE_KEY=$SYSCONFDIR/twinkle/twinkle.key" "$env" || fail "twinkle.env does not point at $SYSCONFDIR/twinkle"
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
