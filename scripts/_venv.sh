# Sourced by scripts/test.sh and scripts/demo.sh (from the repo root): .venv with tfdp installed.
# tfdp_venv EXTRAS [if_missing]: EXTRAS is "" or e.g. "[test]"; with if_missing, skip pip when tfdp imports.
tfdp_venv() {
  local extras="$1" mode="${2:-}"
  if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "${PYTHON:-python3}" -m venv .venv
  fi
  if [ "$mode" = if_missing ] && .venv/bin/python -c "import tfdp" 2>/dev/null; then
    return 0
  fi
  echo "==> installing tfdp${extras} into .venv (TensorFlow is large: a minute or two the first time)"
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  .venv/bin/python -m pip install --quiet -e ".${extras}"
}
