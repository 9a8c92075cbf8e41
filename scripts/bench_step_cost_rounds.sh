#!/bin/bash
# Interleaved rounds of step_cost.py variants; JSON lines to $1.
out=$1; shift; rounds=$1; shift; threads=$1; shift
for r in $(seq 1 $rounds); do for v in "$@"; do
  TF_CPP_MIN_LOG_LEVEL=2 timeout 300 ${PYTHON:-.venv/bin/python} scripts/bench_step_cost.py $v $threads 400 2>/dev/null | tail -1 >> $out
done; done
