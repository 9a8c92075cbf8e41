# Sourced by scripts/test.sh and scripts/demo.sh (from the repo root): .venv with tfdp installed.
# tfdp_venv EXTRAS [if_missing]: EXTRAS is "" or e.g. "[test]"; with if_missing, skip pip when tfdp is installed.
tfdp_venv() {
  local extras="$1" mode="${2:-}"
  if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "${PYTHON:-python3}" -m venv .venv
  fi
  # Installed, not merely importable: from the repo root `import tfdp` finds ./tfdp (and
  # imports no TensorFlow), so it succeeds in a fresh venv too.
  if [ "$mode" = if_missing ] && [ -x .venv/bin/tfdp-launch ] &&
     .venv/bin/python -c "import importlib.metadata as m; m.version('tfdp')" 2>/dev/null; then
    return 0
  fi
  echo "==> installing tfdp${extras} into .venv (TensorFlow is large: a minute or two the first time)"
  # uv (from PyPI, into the venv) installs and byte-compiles on every core: about 21 s against
  # pip's 51 s here. Byte-compiled, because where PYTHONDONTWRITEBYTECODE is set no process
  # would cache what it compiles. pip is the fallback wherever uv cannot be had or fails.
  if .venv/bin/python -m pip install --quiet "uv>=0.9,<1" >/dev/null 2>&1 &&
     .venv/bin/python -m uv pip install --quiet --python .venv/bin/python --compile-bytecode \
       -e ".${extras}"; then
    return 0
  fi
  echo "==> uv could not install; installing with pip"
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  .venv/bin/python -m pip install --quiet -e ".${extras}"
}
