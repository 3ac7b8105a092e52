#!/bin/bash
# Issue #21's GPU budget jobs, run one after another in a detached process (a 40-step 720p video of a 14B model
# outlasts one device call): `bash benchmarks/budget_suite.sh SUITE DIR` starts SUITE in the background and
# returns; DIR/log and DIR/budget.jsonl grow as jobs finish, DIR/done appears at the end.
#   14b    Wan2.1-14B 720x1280x81 CFG 5: 40-step video at 24 GiB (measured end to end), no budget (4-step runs)
#   a14b   Wan2.2-A14B (T2V layout): no budget (one 4-step run), then 40 steps at 24 GiB; a14b-short: both at 4
#   vsa    14B 480x832x81, VIDEO_SPARSE_ATTN 0.9, 2 steps, 24 GiB against no budget, frames saved to compare
# `bash benchmarks/budget_suite.sh --dry-run SUITE DIR` prints the suite's budget_bench commands, one a line, and
# runs nothing (CI checks that budget_bench takes each one).
set -u
DRY=
if [ "${1:-}" = --dry-run ]; then
    DRY=1
    shift
elif [ -z "${BUDGET_SUITE_CHILD:-}" ]; then  # detach in a session of its own: the call's process group is killed
    BUDGET_SUITE_CHILD=1 setsid nohup bash "$0" "$@" >/dev/null 2>&1 </dev/null &
    exit 0
fi
SUITE=${1:-}
D=${2:-/tmp/bsuite}
job() {
    if [ -n "$DRY" ]; then
        printf 'python -m benchmarks.budget_bench --out %q' "$D/budget.jsonl"
        printf ' %q' "$@"
        echo
        return
    fi
    echo "== $(date +%T) $*" >>"$D/log"
    python -m benchmarks.budget_bench --out "$D/budget.jsonl" "$@" >>"$D/log" 2>&1 || echo "!! exit $?" >>"$D/log"
}
suite() {
    if [ -z "$DRY" ]; then
        source /tmp/fastwan-site/env.sh
        export PYTHONPATH=.:${PYTHONPATH:-} HF_HUB_OFFLINE=1
    fi
    case $SUITE in
    14b)
        job --ckpt /tmp/wan14b --budget 24GiB --steps 40 --repeats 1 --label "14B bf16 24GiB 40 steps"
        job --ckpt /tmp/wan14b --steps 4 --repeats 2 --label "14B bf16 no budget" ;;
    a14b)
        job --ckpt /tmp/a14b --steps 4 --repeats 1 --label "A14B bf16 no budget"
        job --ckpt /tmp/a14b --budget 24GiB --steps 40 --repeats 1 --label "A14B bf16 24GiB 40 steps" ;;
    a14b-short)
        job --ckpt /tmp/a14b --steps 4 --repeats 1 --label "A14B bf16 no budget"
        job --ckpt /tmp/a14b --budget 24GiB --steps 4 --repeats 1 --label "A14B bf16 24GiB" ;;
    vsa)
        for b in 24GiB ""; do
            job --ckpt /tmp/wan14b --video 480x832x81 --backend VIDEO_SPARSE_ATTN ${b:+--budget $b} --steps 2 \
                --repeats 1 --frames-out "$D/vsa${b:-none}.npy" --label "14B VSA 480p budget=${b:-none}"
        done ;;
    *) echo "unknown suite '$SUITE': use 14b, a14b, a14b-short or vsa" >&2
       return 2 ;;
    esac
    [ -n "$DRY" ] || touch "$D/done"
}
if [ -n "$DRY" ]; then
    suite
else
    mkdir -p "$D"
    suite >>"$D/log" 2>&1
fi
