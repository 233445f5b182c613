#!/usr/bin/env bash
# Launch an example N times in a row under torchrun (2 CPU ranks, tiny sizes) and count the launches that exit
# non-zero or print "terminate called" (the gloo exit race, docs/own-loop.md: A clean exit). Run from the checkout:
#   scripts/launch_loop.sh 50 examples/plain_torch.py [extra flags]
set -u
n=$1 script=$2; shift 2
data=${DATA:-../shared/data/cifar10-jpg/test}
bad=0 term=0
for i in $(seq 1 "$n"); do
  out=$(OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \
        --log-dir=/dev/null "$script" --data "$data" --subset 256 --global-batch 64 --epochs 1 --size 16 "$@" 2>&1)
  rc=$?
  [ "$rc" -ne 0 ] && bad=$((bad + 1))
  grep -q "terminate called" <<<"$out" && term=$((term + 1))
  echo "launch $i: exit $rc (non-zero so far: $bad, 'terminate called': $term)"
done
echo "$script: $n launches, $bad non-zero, $term with 'terminate called'"
[ "$bad" -eq 0 ]
