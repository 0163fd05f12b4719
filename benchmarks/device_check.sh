#!/usr/bin/env bash
# The speed issue's accelerator checks as one prepared script, for a session lent a GPU through
# the `device` tool (15 minutes of device time in all; each command below has its own limit):
#
#   run(command="bash benchmarks/device_check.sh", timeout_s=590)
#
# Each command's whole output goes to $OUT/<name>.txt (the tool brings $OUT back); the last
# lines of each are echoed. Sizes and limits can be lowered for a dry run on a CPU:
#
#   PARTICIPANTS=100 CLIENTS=20 LIMIT=300 OUT=/tmp/device_dry bash benchmarks/device_check.sh
#
# Record the tables in docs/performance.md ("On a GPU") with the device's line printed first.
set -u
out=${OUT:-device_out}
participants=${PARTICIPANTS:-1000,10000,100000}
clients=${CLIENTS:-100}
limit=${LIMIT:-135}  # 4 commands x 135 s + start-up < the 590 s of one run call
mkdir -p "$out"

run() {
  local name=$1
  shift
  echo "== $name: $*"
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "rc=$? ($name)"
  grep -v '^[IW][0-9]' "$out/$name.txt" | tail -14
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2> /dev/null
python -c "import jax, sys; print('JAX', jax.__version__, jax.devices(), 'Python', sys.version.split()[0])"
# Work B at 1,000-100,000 participants per round: scan and vmap, plain and private
# ('aggregate'), peak device memory per row; the plain-scan reference beside it.
run cross_device python -m benchmarks.peers.cross_device --participants="$participants" \
  --strategies=scan,vmap --rounds=5 --private --secagg_simulations=aggregate --notorch
# The same work in pfl-research and the PyTorch loop (pfl and torch as installed there).
run cross_device_peers python -m benchmarks.peers.cross_device --participants="${participants%%,*}" \
  --strategies=scan --rounds=5 --pfl
# Work A and pFedES's CIFAR-shaped work with the PyTorch loop on the GPU too.
run compare_frameworks python -m benchmarks.peers.compare_frameworks --work=fedavg,pfedes \
  --clients="$clients" --rounds=5 --strategies=loop,vmap,scan
# The cross-device work and pfl-research's own CIFAR-10 setting beside the PyTorch peers.
run compare_cross_device python -m benchmarks.peers.compare_frameworks --work=cross_device,pfl_cifar \
  --rounds=5 --strategies=scan,vmap,loop
