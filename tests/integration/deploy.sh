#!/usr/bin/env bash
# Tests of what deploy/ ships for running Twinkle where clusters already are.
# Usage: deploy.sh TWINKLE_BINARY SOURCE_ROOT CASE BUILD_ROOT
TWK=$(realpath "$1")  # meson may pass it relative to the build folder; units need absolute paths
SRC=$2
BUILD=$4
source "$SRC/tests/integration/lib.sh"

case $3 in
  systemd)
    # The units as meson configured them, checked by systemd itself. verify wants ExecStart's
    # binary to exist: the copies run this build's twinkle instead of the installed one.
    command -v systemd-analyze >/dev/null || { echo "systemd-analyze is not installed: skipped"; exit 77; }
    mkdir "$TMP/units"
    man_flag=(--man=no)
    if command -v man >/dev/null; then
      # Documentation=man:twinkle(1) is checked against this tree's page.
      mkdir -p "$TMP/man/man1" && cp "$SRC/man/twinkle.1" "$TMP/man/man1/"
      export MANPATH=$TMP/man
      man_flag=()
    fi
    env_file=$BUILD/deploy/twinkle.env
    for unit in twinkle-head.service twinkle-agent.service; do
      sed "s|^ExecStart=[^ ]*/twinkle |ExecStart=$TWK |" "$BUILD/deploy/$unit" >"$TMP/units/$unit"
      grep -q "^ExecStart=$TWK node start " "$TMP/units/$unit" || fail "$unit does not run twinkle node start"
      # verify exits 0 on unknown keys and bad values too: anything it says about the unit fails.
      systemd-analyze verify "${man_flag[@]}" "$TMP/units/$unit" >"$TMP/out" 2>&1
      rc=$?
      if [ $rc -ne 0 ] || grep -q "twinkle-" "$TMP/out"; then
        cat "$TMP/out"
        fail "systemd-analyze verify $unit: exit $rc"
      fi
      # What the hardening promises (README, On a cluster).
      for setting in User=twinkle ProtectSystem=strict ProtectHome=yes PrivateTmp=yes NoNewPrivileges=yes \
          StateDirectory=twinkle Restart=on-failure KillMode=control-group; do
        grep -qx "$setting" "$TMP/units/$unit" || fail "$unit lacks $setting"
      done
      # Every variable the command line uses is set by the environment file; an unset one would
      # silently drop a flag's value.
      for var in $(sed -n 's/^ExecStart=//p' "$TMP/units/$unit" | grep -oE '\$\{?[A-Z_]+' | tr -d '${'); do
        grep -q "^$var=" "$env_file" || fail "$unit uses \$$var, which twinkle.env does not set"
      done
      # Once `twinkle node start` exists, every flag of the command line is one it knows.
      # (Before it does, --help prints the top-level help.)
      if "$TWK" node start --help 2>&1 | tee "$TMP/help" | grep -q "^Usage: .*node start"; then
        for flag in $(sed -n 's/^ExecStart=//p' "$TMP/units/$unit" | grep -oE -- ' --[a-z-]+'); do
          grep -qE -- "^ +(-[a-z],)?$flag( |$)" "$TMP/help" || fail "$unit passes $flag, which twinkle node start does not know"
        done
      fi
    done
    ;;
  *) fail "unknown case $3" ;;
esac
echo "ok: $3"
