# Sourced by the .ci/install_*.sh scripts that keep a virtual environment of their own: the one rule
# for keeping one. The caller defines `check`, which imports what the venv is for and prints the
# installed versions on its last line.

# reuse_venv NAME VENV WANT [exact]: 0, saying so, when VENV can be kept as it is: it is stamped with
# WANT, or `check` passes in it (with `exact`: and its last line equals WANT), after which it is
# stamped. 1 when it must be (re)built.
reuse_venv() {
  local name=$1 venv=$2 want=$3 exact=${4:-} versions
  [ -x "$venv/bin/python" ] || return 1
  if [ -f "$venv/.rljax-installed" ] && grep -qxF -- "$want" "$venv/.rljax-installed"; then
    echo "$name: reusing $venv ($want)"
    return 0
  fi
  versions=$(check 2>/dev/null) || return 1
  if [ -n "$exact" ] && [ "${versions##*$'\n'}" != "$want" ]; then
    return 1
  fi
  echo "$name: reusing $venv (${versions##*$'\n'})"
  stamp_venv "$venv" "$want"
}

# stamp_venv VENV WANT: records that VENV holds WANT and passed `check`.
stamp_venv() {
  echo "$2" > "$1/.rljax-installed"
}
