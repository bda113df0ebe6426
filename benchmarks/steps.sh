# Timed steps for the device scripts (sourced by run_1gpu.sh, run_2gpu.sh, run_4gpu.sh).
# step T CMD...: run CMD under a T-second timeout, printing the time since the script began.
# bstep T CMD...: the same under the stage's BUDGET (seconds from the start): its timeout is cut to
# what is left, and it is skipped (said so) when less than 30 s are, so a stage ends inside one
# device call.  left: the seconds of the budget still left.  logged NAME T CMD...: bstep with its output in
# $BURST_RESULTS/log_NAME.txt (back in the stage's tarball), its last lines shown.
T0=$(date +%s)
BUDGET=${BUDGET:-540}
step() { local t=$1; shift; echo "=== [+$(( $(date +%s) - T0 ))s] $*"; timeout --signal=TERM --kill-after=10 "$t" "$@"; echo "=== rc=$? [+$(( $(date +%s) - T0 ))s]"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
bstep() {
  local t=$1 rest; rest=$(left); shift
  if [ "$rest" -lt 30 ]; then echo "=== skipped, ${rest}s of the budget left: $*"; return; fi
  [ "$t" -gt "$rest" ] && t=$rest
  step "$t" "$@"
}
logged() { local name=$1; shift; bstep "$@" > "$BURST_RESULTS/log_$name.txt" 2>&1; tail -4 "$BURST_RESULTS/log_$name.txt"; }
