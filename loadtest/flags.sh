# Sourced by the loadtest scripts: one `--flag VALUE` parser for all of them.
#
#   declare -A FLAGS=([--users]=USERS [--out]=OUT)   # each flag and the variable its value goes to
#   source loadtest/flags.sh
#   parse_flags "$@"
#
# A script that passes arguments on names `--` too ([--]=EXTRA): what follows it goes to that array.
# An unknown flag exits 2 with one line, as each script's own `case` did.

parse_flags() {
  while [ $# -gt 0 ]; do
    local var=
    if [ -n "$1" ]; then
      var=${FLAGS[$1]:-}
    fi
    if [ -z "$var" ]; then
      echo "unknown argument: $1" >&2
      exit 2
    fi
    if [ "$1" = -- ]; then
      shift
      local -n rest=$var
      rest=("$@")
      return
    fi
    printf -v "$var" '%s' "$2"
    shift 2
  done
}
