#!/usr/bin/env bash
# The main job: set up, generate ./demo (PyTorch, data parallel), train it with 2 processes on
# the CPU under horovodrun, tracked in the project's embedded MLflow store.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# torch only by default: on Python 3.12+ pip's torch is a CUDA build, and Horovod's TensorFlow GPU
# ops no longer load beside it (TF 2.21), so install-horovod refuses that pair. On 3.11 the test
# command's torch+TensorFlow wheel also serves this torch-only environment when it is built first.
export HVDGEN_FRAMEWORKS="${HVDGEN_FRAMEWORKS:-torch}"
source "$ROOT/scripts/setup.sh"

cd "$ROOT"
step "generating ./demo (afresh: the demo trains from scratch every time)"
rm -rf demo
hvdgen new demo --no-input
cd demo
step "training: horovodrun -np 2 -H localhost:2 --gloo python train.py"
horovodrun -np 2 -H localhost:2 --gloo python train.py "$@"

step "done"
cat <<MSG
  metrics (one line per epoch):  demo/runs/latest/metrics.jsonl
  trained model (safetensors):   demo/runs/latest/model.safetensors
  checkpoints (rank 0):          demo/checkpoints/
  MLflow runs:                   cd demo && $VENV/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db
  train again (resumes):         cd demo && horovodrun -np 2 -H localhost:2 --gloo python train.py --train.epochs 30
MSG
