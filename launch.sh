#!/usr/bin/env bash
# One entry point with sane defaults; `bash launch.sh --help` prints the usage (usage() below).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${QWEN_EDIT_VENV:-$ROOT/.venv}
TORCH_SPEC=${QWEN_EDIT_TORCH:-"torch==2.14.1 torchvision==0.29.1"}

cpu_torch_note() {
  # Without a GPU the pin still installs PyPI's torch, whose only Linux build carries ~6 GB of CUDA wheels: no CPU
  # build of torch *and* torchvision that import together is on PyPI (README "Set-up without a GPU" says why).
  if [ -z "${QWEN_EDIT_TORCH:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "== no GPU driver (nvidia-smi) found: installing PyPI's torch anyway, its only Linux build (~6 GB with its" \
         "CUDA wheels); for the ~200 MB CPU build see README \"Set-up without a GPU\" (QWEN_EDIT_TORCH)" >&2
  fi
}

setup() {
  local stamp="$VENV/.qwen-edit-installed"
  local want
  want=$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  echo "== setting up $VENV" >&2
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  cpu_torch_note
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
  # DeepSpeed's CPU ops compile under torch's extensions folder, which is keyed on Python and CUDA but not on the
  # venv: two venvs sharing ~/.cache/torch_extensions rebuild each other's op (minutes each time). One per venv.
  if [ "$PY" = "$VENV/bin/python" ]; then export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}; fi
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}        # no GPU: DeepSpeed's CPU accelerator with gloo
  fi
  # Propagate to every node: DeepSpeed exports each NAME=VALUE line of this file on the remote hosts.
  if [ -z "${DS_ENV_FILE:-}" ]; then
    local env_file
    env_file=$(mktemp "${TMPDIR:-/tmp}/qwen-edit-env.XXXXXX")
    for f in "$HOME/.deepspeed_env" ./.deepspeed_env; do [ -f "$f" ] && cat "$f" >> "$env_file"; done
    for name in HF_HUB_OFFLINE TRANSFORMERS_OFFLINE NCCL_NVLS_ENABLE DS_ACCELERATOR TORCH_EXTENSIONS_DIR; do
      if [ -n "${!name:-}" ] && ! grep -q "^$name=" "$env_file"; then echo "$name=${!name}" >> "$env_file"; fi
    done
    export DS_ENV_FILE=$env_file
  fi
}

usage() {
  cat <<'EOF'
Usage:
  bash launch.sh demo [--max_steps N] [--variant edit|edit_plus|edit_plus_2511|t2i] [--workdir DIR]
      set up ./.venv if needed, then run the embedded tiny demo (python -m train.demo)
  bash launch.sh test [pytest args]
      set up ./.venv if needed, then run ruff and the test suite
  bash launch.sh [deepspeed launcher args] train/main.py --ds_config ds_configs/zero2.json ...
      set environment defaults, then hand everything to the deepspeed launcher, e.g.
      bash launch.sh --num_gpus 8 train/main.py ...                                one node
      bash launch.sh --num_gpus 8 --master_port 29600 train/main.py ...            a second run on the same node
      bash launch.sh --hostfile hosts train/main.py ...                            many nodes over ssh (pdsh)
      bash launch.sh --hostfile hosts --no_ssh --node_rank R --master_addr H ...   once per node, no ssh
      bash launch.sh --num_gpus 2 train/main.py --ds_config ds_configs/model_parallel.json ...
  bash launch.sh -h | --help
      this text

The environment: training uses the active Python environment when it already has deepspeed, diffusers and
peft (e.g. a cluster's own CUDA build); otherwise ./.venv, created on first use. To run the README's python
commands yourself, `source .venv/bin/activate` first (after one `bash launch.sh demo` or `bash launch.sh test`).
The defaults set here (HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, NCCL_NVLS_ENABLE=0, DS_ACCELERATOR=cpu without
a GPU) also reach other nodes: they are written to a DS_ENV_FILE (DeepSpeed's .deepspeed_env mechanism), after
the entries of ./.deepspeed_env or ~/.deepspeed_env if present.
QWEN_EDIT_VENV=path picks another virtual environment; QWEN_EDIT_TORCH overrides the torch pin, e.g. a CPU build
where the PyTorch index is reachable (README "Set-up without a GPU"):
  QWEN_EDIT_TORCH="torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cpu"
EOF
}

PY=$VENV/bin/python
DS=$VENV/bin/deepspeed
use_active_env() {
  # Training uses the active environment when it already has the stack (e.g. a cluster's own CUDA build).
  if [ -z "${QWEN_EDIT_VENV:-}" ] && command -v deepspeed >/dev/null 2>&1 \
     && python3 -c "import deepspeed, diffusers, peft" >/dev/null 2>&1; then
    PY=python3
    DS=$(command -v deepspeed)
  else
    setup
  fi
}

bench_extra() {
  # The tests of the benchmark's peer need setup.cfg's bench extra; its pins are installed without their own
  # dependencies (diffsynth's imageio, modelscope, ...), which the peer's DiT files do not import.
  "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in \
    ('diffsynth', 'einops', 'torchao')))" && return 0
  local pins
  pins=$("$VENV/bin/python" -c "import configparser, sys; c = configparser.ConfigParser(); c.read(sys.argv[1]); \
    print(' '.join(c['options.extras_require']['bench'].split()))" "$ROOT/setup.cfg")
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --no-deps $pins
}

launcher_args() {
  # The launcher's own info lines (its command, world info, CUDA_VISIBLE_DEVICES) are left out unless the user asks
  # for a level (its errors still show); a --hostfile that is not a file would make it train on this node alone,
  # with a warning that the quieter level hides: refuse it here instead.
  quiet=(--log_level error)
  local prev=""
  for arg in "$@"; do
    case "$arg" in
      --log_level|--log_level=*|-q|--quiet) quiet=() ;;
    esac
    local hostfile=""
    if [ "$prev" = "--hostfile" ] || [ "$prev" = "-H" ]; then hostfile=$arg; fi
    case "$arg" in --hostfile=*) hostfile=${arg#--hostfile=} ;; esac
    if [ -n "$hostfile" ] && [ ! -f "$hostfile" ]; then
      echo "launch.sh: --hostfile $hostfile is not a file; write one line per node ('node-a slots=8')" >&2
      exit 2
    fi
    [ "$arg" = "${arg%.py}" ] || break  # the script: the rest are its own arguments
    prev=$arg
  done
}

cmd=${1:-}
case "$cmd" in
  demo)
    shift; setup; env_defaults
    exec "$VENV/bin/python" -m train.demo "$@" ;;
  test)
    shift; setup; bench_extra; env_defaults
    cd "$ROOT"
    "$VENV/bin/ruff" check .
    set +e
    "$VENV/bin/python" -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" = 5 ]; then echo "pytest collected no tests: treating as a failure" >&2; exit 1; fi
    exit "$rc" ;;
  -h|--help|"")
    usage; exit 0 ;;
  *)
    # The deepspeed launcher's form starts with its options or the script: anything else (a mistyped subcommand,
    # a script path that does not exist) would reach deepspeed as a script to run.
    if [[ $cmd != -* && ! -f $cmd ]]; then
      echo "launch.sh: '$cmd' is neither a subcommand (demo, test) nor a script file; see bash launch.sh --help" >&2
      exit 2
    fi
    launcher_args "$@"
    use_active_env; env_defaults
    # DeepSpeed's single-node runner exits on SIGTERM without passing it on, and the ranks trained on: run it in a
    # process group of its own and forward SIGTERM/SIGINT to that whole group, whose ranks save a checkpoint and
    # stop (train/runtime/preempt.py). Wait until the runner has really exited, then exit with its status.
    set -m
    "$DS" "${quiet[@]}" "$@" &
    ds_pid=$!
    trap 'kill -TERM -- "-$ds_pid" 2>/dev/null || true' TERM INT
    while true; do
      set +e
      wait "$ds_pid"
      rc=$?
      set -e
      kill -0 "$ds_pid" 2>/dev/null || exit "$rc"
    done ;;
esac
