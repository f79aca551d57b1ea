#!/bin/bash
# One torchrun agent per node, rendezvous through c10d on the first node of the SLURM allocation.
# Usage (from an sbatch script, once per node): srun --ntasks-per-node 1 bash examples/slurm/launch.sh SCRIPT ARGS...
# Reads what SLURM sets: SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST (and SLURM_GPUS_ON_NODE).
# Overrides: GPUS_PER_NODE (default: SLURM_GPUS_ON_NODE, else the visible GPUs, else 1 CPU process),
# MASTER_ADDR (default: the first host of SLURM_JOB_NODELIST), MASTER_PORT (default 29500),
# LOCAL_ADDR (this node's address as the others reach it; default: torchrun's choice),
# RDZV_TIMEOUT (seconds to wait for all nodes, default 900).
set -euo pipefail
cd "$(dirname "$0")/../.."

NNODES=${SLURM_NNODES:-1}
NODE_RANK=${SLURM_NODEID:-0}
JOB_ID=${SLURM_JOB_ID:-local}
if [ -z "${MASTER_ADDR:-}" ]; then
    if command -v scontrol >/dev/null 2>&1 && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    else
        # A plain list "host1,host2" (or one host) needs no scontrol.
        MASTER_ADDR=${SLURM_JOB_NODELIST:-localhost}
        MASTER_ADDR=${MASTER_ADDR%%,*}
    fi
fi
MASTER_PORT=${MASTER_PORT:-29500}
if [ -z "${GPUS_PER_NODE:-}" ]; then
    GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
fi
# The first node hosts the rendezvous store; saying so explicitly keeps two agents on one host (tests, or a
# node listed twice) from both trying to serve it.
IS_HOST=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)

RDZV_ARGS=(--nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d
           --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$JOB_ID"
           --rdzv-conf "is_host=$IS_HOST,join_timeout=${RDZV_TIMEOUT:-900}" --max-restarts 0)
if [ -n "${LOCAL_ADDR:-}" ]; then
    RDZV_ARGS+=(--local-addr "$LOCAL_ADDR")
fi
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "[launch] node $NODE_RANK/$NNODES, $GPUS_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT id $JOB_ID" >&2
exec torchrun "${RDZV_ARGS[@]}" "$@"
