# bash completion for twinkle(1): commands, their flags, job files (*.toml) after run, topology
# and submit, plugin files (*.so) after inspect, job states after jobs --state, folders, key files
# and quotas files after the flags that take them. Installed where bash-completion loads it on
# first use; or source it from ~/.bashrc.
# Keep the flags in step with cli/*.cpp: the completion_flags test compares them with --help.

_twinkle_flags() {
  case $1 in
    run)
      echo "--set --gpus --log-dir --quiet --ascii --resume --address --key --head-key --insecure" \
        "--launcher --help"
      ;;
    topology)
      echo "--gpus --set --json --ascii --address --key --head-key --insecure --launcher --help"
      ;;
    nodes) echo "--json --address --key --head-key --insecure --help" ;;
    inspect) echo "--json --help" ;;
    submit)
      echo "--set --name --working-dir --max-retries --priority --after --wait --max-upload --json" \
        "--address --key --head-key --insecure --help"
      ;;
    jobs) echo "--all --user --state --json --address --key --head-key --insecure --help" ;;
    "job show") echo "--json --address --key --head-key --insecure --help" ;;
    job) echo "--help" ;;
    logs)
      echo "--follow --rank --driver --grep --tail --address --key --head-key --insecure --help"
      ;;
    stop) echo "--now --address --key --head-key --insecure --help" ;;
    resume) echo "--address --key --head-key --insecure --help" ;;
    quotas | "quotas reload") echo "--json --address --key --head-key --insecure --help" ;;
    dashboard) echo "--no-open --address --key --head-key --insecure --help" ;;
    keygen) echo "--out --name --force --help" ;;
    "node start")
      echo "--head --port --bind --no-agent --address --gpus --cpus --labels --node-id --node-ip" \
        "--cache-dir --state-dir --keep-jobs --job-log-mb --dashboard --tls-cert --tls-key" \
        "--dashboard-name --quotas --run-as --key --authorized-keys --head-key --insecure" \
        "--daemon --pid-file --log-file --help"
      ;;
    "node stop") echo "--pid-file --timeout --help" ;;
    node) echo "--help" ;;
    "") echo "--help --version" ;;
  esac
}

# Files whose names end in $1 (any file when empty) and folders to reach them; folders only with
# --dirs. One name a line, so that names with spaces stay whole.
_twinkle_files() {
  local IFS=$'\n'
  compopt -o filenames 2>/dev/null
  if [[ $1 == --dirs ]]; then
    COMPREPLY=($(compgen -d -- "$2"))
  elif [[ -z $1 ]]; then
    COMPREPLY=($(compgen -f -- "$2"))
  else
    COMPREPLY=($(compgen -f -X "!*$1" -- "$2") $(compgen -d -- "$2"))
  fi
}

_twinkle() {
  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD - 1]}
  local cmd="" i w
  COMPREPLY=()

  # The command is the first word that is not a flag; `node` takes one more (start, stop), `job`
  # one more (show), and `quotas` one more (reload).
  for ((i = 1; i < COMP_CWORD; i++)); do
    w=${COMP_WORDS[i]}
    [[ $w == -* ]] && continue
    if [[ -z $cmd ]]; then
      cmd=$w
    elif [[ $cmd == node || $cmd == job || $cmd == quotas ]]; then
      cmd="$cmd $w"
      break
    fi
  done

  # The value of a flag that takes one.
  case $prev in
    --log-dir | --out | --working-dir | --state-dir | --cache-dir)
      _twinkle_files --dirs "$cur"
      return
      ;;
    --key | --authorized-keys | --head-key | --pid-file | --log-file | --tls-cert | --tls-key | \
      --quotas)
      _twinkle_files "" "$cur"
      return
      ;;
    --state)
      COMPREPLY=($(compgen -W "QUEUED RUNNING PREEMPTED SUCCEEDED FAILED STOPPED DROPPED ENDED" \
        -- "$cur"))
      return
      ;;
    --set | --gpus | --cpus | --port | --address | --labels | --node-id | --node-ip | --name | \
      --max-retries | --after | --max-upload | --user | --rank | --grep | --tail | --keep-jobs | \
      --job-log-mb | --timeout | --priority)
      return
      ;;
  esac

  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "$(_twinkle_flags "$cmd")" -- "$cur"))
    return
  fi
  case $cmd in
    "")
      COMPREPLY=($(compgen -W "run topology nodes node inspect submit jobs job logs stop resume \
        quotas dashboard keygen" -- "$cur"))
      ;;
    node) COMPREPLY=($(compgen -W "start stop" -- "$cur")) ;;
    job) COMPREPLY=($(compgen -W "show" -- "$cur")) ;;
    quotas) COMPREPLY=($(compgen -W "reload" -- "$cur")) ;;
    run | topology | submit) _twinkle_files .toml "$cur" ;;
    inspect) _twinkle_files .so "$cur" ;;
  esac
}

complete -F _twinkle twinkle
