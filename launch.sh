#!/usr/bin/env bash
# One entry point with sane defaults.
#   bash launch.sh demo [--max_steps N] [--variant edit|edit_plus]
#        set up ./.venv if needed, then run the embedded tiny demo (train.demo)
#   bash launch.sh test [pytest args]
#        set up ./.venv if needed, then run the test suite
#   bash launch.sh [deepspeed launcher args] train/main.py --ds_config ds_configs/zero2.json ...
#        set environment defaults, then hand everything to the deepspeed launcher
# QWEN_EDIT_VENV=path picks another virtual environment; QWEN_EDIT_TORCH overrides the torch pin.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${QWEN_EDIT_VENV:-$ROOT/.venv}
TORCH_SPEC=${QWEN_EDIT_TORCH:-"torch==2.14.1 torchvision==0.29.1"}

setup() {
  local stamp="$VENV/.qwen-edit-installed"
  local want
  want=$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  echo "== setting up $VENV" >&2
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first and pinned: an unpinned resolve may pull a different multi-GB build.
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q $TORCH_SPEC
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  echo "$want" > "$stamp"
}

env_defaults() {
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}            # weights come from local directories only
  export TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}        # NVLink SHARP off: unsupported on many shared hosts
  if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}        # no GPU: DeepSpeed's CPU accelerator with gloo
  fi
}

cmd=${1:-}
case "$cmd" in
  demo)
    shift; setup; env_defaults
    exec "$VENV/bin/python" -m train.demo "$@" ;;
  test)
    shift; setup; env_defaults
    cd "$ROOT"
    "$VENV/bin/ruff" check .
    set +e
    "$VENV/bin/python" -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" = 5 ]; then echo "pytest collected no tests: treating as a failure" >&2; exit 1; fi
    exit "$rc" ;;
  -h|--help|"")
    sed -n '2,9p' "$0"; exit 0 ;;
  *)
    setup; env_defaults
    exec "$VENV/bin/deepspeed" "$@" ;;
esac
