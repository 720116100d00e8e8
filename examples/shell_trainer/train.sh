#!/bin/sh
# A trainer in plain shell, made spot-safe by two calls: `trainpod checkpoint latest` at start and
# `trainpod checkpoint commit` after writing a checkpoint folder. A Rust or C++ trainer does the same.
#
#   trainpod run command --config examples/shell_trainer/command.yaml
#
# Its "model" is a hash chain: state(n) = sha256(state(n-1) + n), so any resume from the wrong or a
# damaged checkpoint would change the final state. The kit gives it TRAINPOD_RUN_DIR and forwards
# SIGTERM to this script (a wrapper would `exec` its trainer); the trap runs once the step's command
# returns, and it commits the step it finished and exits 143. No `set -e`: a step's command ended by
# the group's SIGTERM (sent once this script has exited, or by hand) is no failure.
TRAINPOD=${CHECKPOINT_CLI:-trainpod}  # tests put a crashing wrapper here
MAX_STEPS=${MAX_STEPS:-20}
COMMIT_EVERY=${COMMIT_EVERY:-5}
run_dir=${TRAINPOD_RUN_DIR:?run me under the command workload, or set TRAINPOD_RUN_DIR}

stop=0
trap 'stop=1' TERM INT

latest=$($TRAINPOD checkpoint latest "$run_dir") || exit 75
if [ -n "$latest" ]; then
  step=$(cat "$latest/step")
  state=$(cat "$latest/state")
  echo "resumed from $latest (step $step)"
else
  step=0
  state=seed
fi

commit() {
  out="$run_dir/scratch/step-$step"  # any folder on the volume; commit moves its files into the store
  rm -rf "$out" && mkdir -p "$out"
  echo "$step" >"$out/step"
  echo "$state" >"$out/state"
  $TRAINPOD checkpoint commit "$run_dir" --step "$step" "$out" >/dev/null || exit 75
}

while [ "$step" -lt "$MAX_STEPS" ]; do
  step=$((step + 1))
  state=$(printf '%s %s' "$state" "$step" | sha256sum | cut -c1-64)
  echo "step $step state $state"
  sleep "${SLEEP_PER_STEP:-0}"
  if [ $((step % COMMIT_EVERY)) -eq 0 ] || [ "$stop" = 1 ]; then
    commit
  fi
  if [ "$stop" = 1 ]; then
    echo "stopped at step $step, committed"
    exit 143
  fi
done
mkdir -p "$run_dir/export"
echo "$state" >"$run_dir/export/final.txt.tmp" && mv "$run_dir/export/final.txt.tmp" "$run_dir/export/final.txt"
echo "finished: $state"
