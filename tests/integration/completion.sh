#!/bin/sh
# Tests of the bash completion (cli/completion/twinkle.bash): what TAB offers after `twinkle`.
# Usage: completion.sh TWINKLE_BINARY SOURCE_ROOT CASE
# Starts under sh so that it can report a skip where bash is absent; the checks run in bash.
if [ -z "${BASH_VERSION:-}" ]; then
  command -v bash >/dev/null 2>&1 || { echo "bash is not installed: skipped"; exit 77; }
  exec bash "$0" "$@"
fi
TWK=$1
SRC=$2
source "$SRC/tests/integration/lib.sh"
source "$SRC/cli/completion/twinkle.bash"

# complete_words WORD...: what the completion offers for the command line WORD... with the cursor
# at the end of the last word, one candidate a line, sorted.
complete_words() {
  COMP_WORDS=("$@")
  COMP_CWORD=$(($# - 1))
  COMP_LINE="$*"
  COMP_POINT=${#COMP_LINE}
  COMPREPLY=()
  # bash ignores the function's status (compgen's 1 for "no match" ends up there).
  _twinkle twinkle "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD - 1]}" 2>"$TMP/complete.err"
  [ -s "$TMP/complete.err" ] && fail "the completion function printed on '$*': $(cat "$TMP/complete.err")"
  printf '%s\n' "${COMPREPLY[@]}" | sed '/^$/d' | LC_ALL=C sort
}

# expect_words "WANTED" WORD...: the candidates are exactly WANTED (space-separated, any order).
expect_words() {
  local want got
  want=$(printf '%s\n' $1 | LC_ALL=C sort)
  shift
  got=$(complete_words "$@") || exit 1
  [ "$got" = "$want" ] || fail "'$*' offers [$(echo $got)], expected [$(echo $want)]"
}

# help_flags CMD...: the long flags that `twinkle CMD... --help` lists.
help_flags() {
  "$TWK" "$@" --help | grep -oE '^ +(-[a-zA-Z],)?--[a-z][a-z-]*' | sed 's/.*--/--/' | LC_ALL=C sort -u
}

# help_subcommands CMD...: the subcommands that `twinkle CMD... --help` lists.
help_subcommands() {
  "$TWK" "$@" --help | sed -n '/^Subcommands:/,/^$/p' | sed -n 's/^  \([a-z][a-z-]*\) .*/\1/p'
}

case $3 in
  words)
    [ "$(complete -p twinkle)" = "complete -F _twinkle twinkle" ] ||
      fail "sourcing the completion does not register it for twinkle: $(complete -p twinkle 2>&1)"
    expect_words "run topology nodes node inspect submit jobs job logs stop resume quotas dashboard keygen" twinkle ""
    expect_words "topology" twinkle to
    expect_words "--help --version" twinkle --
    expect_words "--set --gpus --log-dir --quiet --ascii --resume --address --key --head-key --insecure --launcher --help" twinkle run --
    expect_words "--launcher --log-dir" twinkle run --l
    expect_words "start stop" twinkle node ""
    expect_words "--pid-file --timeout --help" twinkle node stop --
    expect_words "show" twinkle job ""
    expect_words "--json --address --key --head-key --insecure --help" twinkle job show --
    expect_words "QUEUED" twinkle jobs --state Q
    complete_words twinkle node start -- | grep -qx -- --authorized-keys || fail "node start does not offer --authorized-keys"
    # Job files and folders after run and topology, plugins after inspect, in the current folder.
    mkdir -p "$TMP/cwd/jobs" && cd "$TMP/cwd" || exit 1
    touch job.toml libmodel.so notes.txt jobs/other.toml
    expect_words "job.toml jobs" twinkle run ""
    expect_words "job.toml jobs" twinkle submit --wait ""
    expect_words "jobs" twinkle submit --working-dir ""
    expect_words "jobs/other.toml" twinkle topology --ascii jobs/
    expect_words "jobs libmodel.so" twinkle inspect ""
    expect_words "jobs" twinkle run --log-dir ""
    expect_words "" twinkle run --gpus ""
    # A name with a space stays one candidate.
    touch "two words.toml"
    complete_words twinkle run tw | grep -qx "two words.toml" || fail "'two words.toml' is not offered whole"
    ;;
  flags)
    # Every command and flag that --help lists is offered, so the completion keeps up with the CLI.
    commands=$(help_subcommands)
    [ -n "$commands" ] || fail "twinkle --help lists no subcommands"
    offered=$(complete_words twinkle "") || exit 1
    check_flags() {
      local flag flags
      flags=$(complete_words twinkle "$@" --) || exit 1
      for flag in $(help_flags "$@"); do
        grep -qx -- "$flag" <<<"$flags" || fail "'twinkle $* --' does not offer $flag"
      done
    }
    check_flags
    for cmd in $commands; do
      grep -qx "$cmd" <<<"$offered" || fail "'twinkle ' does not offer the command $cmd"
      subs=$(help_subcommands "$cmd")
      [ -z "$subs" ] && check_flags "$cmd"
      for sub in $subs; do
        grep -qx "$sub" <<<"$(complete_words twinkle "$cmd" "")" || fail "'twinkle $cmd ' does not offer $sub"
        check_flags "$cmd" "$sub"
      done
    done
    ;;
  *) fail "unknown case $3" ;;
esac
echo "ok: $3"
