#!/usr/bin/env bash
# The GPU checks in one script, for a GPU machine whose Python has torch, transformers and peft but not this venv
# and no network (docs/guides/scale-out.md): `make test-gpu` with the bundle `make gpu-bundle` wrote into .gpu/, then
# the hf rows of the bench (full and LoRA) on a ~1B random-init Llama, then `rlhf-lab plan` for the same rows.
# Logs and the bench's JSON go to $OUT (default outputs/gpu_check). Each part has its own time limit, so a hang in
# one still leaves the others' figures, and the limits add up to 480 s (a lent device's first call, with time left
# to run it again after a fix): SETUP_S 30 + TEST_GPU_S 200 + BENCH_S 130 + ROW_S 60 + 2 × PLAN_S 30.
#
#     bash benchmarks/gpu_check.sh            # PYTHON=python3 by default
#
# DEVICE=cpu DIMS="model.tiny.hidden_size=64 ..." NEW_TOKENS=16 try the script's own plumbing without a GPU.
set -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false

SETUP_S=${SETUP_S:-30} TEST_GPU_S=${TEST_GPU_S:-200} BENCH_S=${BENCH_S:-130} ROW_S=${ROW_S:-60} PLAN_S=${PLAN_S:-30}
echo "time limits: setup $SETUP_S + test-gpu $TEST_GPU_S + bench $BENCH_S + row $ROW_S + plans 2 x $PLAN_S =" \
     "$((SETUP_S + TEST_GPU_S + BENCH_S + ROW_S + 2 * PLAN_S)) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "the image's own: $($PYTHON -c "import torch, transformers; print('torch', torch.__version__, '| transformers',
transformers.__version__)")"

# The bundle (the pinned transformers among it); pyarrow from .gpu/fallback only where the image's is too old for the
# bundle's datasets.
timeout "$SETUP_S" $PYTHON -m pip install -q --no-index --no-deps --no-compile --upgrade --target .gpu/site \
    .gpu/wheels/*.whl || exit 1
if ! PYTHONPATH=.gpu/site $PYTHON -c "import datasets" 2>/dev/null && ls .gpu/fallback/*.whl >/dev/null 2>&1; then
    echo "datasets does not import with this image's pyarrow: installing .gpu/fallback"
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --upgrade --target .gpu/site .gpu/fallback/*.whl
fi
# What every figure below was measured with (plans made with other versions do not hold: docs/guides/plan.md).
PYTHONPATH="$PWD/.gpu/site:$PWD" $PYTHON -c "
import json, torch
from rlhf_lab.runtime.versions import environment
print(json.dumps({**environment('cuda' if torch.cuda.is_available() else 'cpu', None), 'cuda': torch.version.cuda}))" | tee "$OUT/versions.json"

# The 1B step's allocation history (torch.cuda.memory._dump_snapshot), for where its peak's bytes come from.
case $OUT in /*) SNAPSHOT_DIR=$OUT ;; *) SNAPSHOT_DIR=$PWD/$OUT ;; esac
export RLHF_LAB_GPU_SNAPSHOT="$SNAPSHOT_DIR/1b_step_memory.pickle"
if command -v make >/dev/null; then
    timeout "$TEST_GPU_S" make test-gpu GPU_PYTHON="$PYTHON" GPU_BUNDLE=.gpu ARGS="-rA --durations=0" 2>&1 \
        | tee "$OUT/test_gpu.log"
else  # the same steps as the Makefile's target
    timeout "$TEST_GPU_S" env PYTHONPATH="$PWD/.gpu/site:$PWD" RLHF_LAB_CACHE="$PWD/.gpu/cache" \
        $PYTHON -m pytest -q -s -m gpu tests/gpu -rA --durations=0 2>&1 | tee "$OUT/test_gpu.log"
fi
echo "test-gpu exit status: $?"
[ -f "$RLHF_LAB_GPU_SNAPSHOT" ] && gzip -f "$RLHF_LAB_GPU_SNAPSHOT"
unset RLHF_LAB_GPU_SNAPSHOT

export PYTHONPATH="$PWD/.gpu/site:$PWD" RLHF_LAB_CACHE="$PWD/.gpu/cache"
DIMS=${DIMS:-"model.tiny.hidden_size=2048 model.tiny.num_hidden_layers=16 model.tiny.num_attention_heads=16
      model.tiny.num_key_value_heads=8 model.tiny.intermediate_size=5632"}  # a ~1B Llama
ROW=(model=tiny $DIMS hardware=default reward=length trainer.device=${DEVICE:-cuda} trainer.precision=bf16-mixed
     trainer.prompts_per_step=8 algorithm.group_size=8 trainer.max_new_tokens=${NEW_TOKENS:-128})
timeout "$BENCH_S" $PYTHON -m benchmarks.bench --lora --steps 2 --warmup 1 --json "$OUT/bench_1b.json" \
    -- "${ROW[@]}" 2>&1 | grep -v '^[ {}]' | tee "$OUT/bench_1b.log"
echo "bench exit status: $?"

# The full row once more as a plain run, 2 steps: where it fails, the whole traceback (the bench keeps its last line).
timeout "$ROW_S" $PYTHON -m rlhf_lab "${ROW[@]}" trainer.steps=2 trainer.eval_prompts=0 logger=none \
    trainer.progress_bar=false trainer.output_dir="$OUT/row_run" 2>&1 | tail -60 | tee "$OUT/row_run.log"
echo "row run exit status: $?"
rm -rf "$OUT/row_run"

# The plan of each row: the bench's own overrides (benchmarks/bench.py), then the row's.
BENCH=(algorithm=grpo kl=k3 kl.coef=0.04 kl.placement=loss)
for row in full lora; do
    lora=(model.lora.enabled=false); [ "$row" = lora ] && lora=(model.lora.enabled=true model.lora.r=16 model.lora.alpha=32)
    timeout "$PLAN_S" $PYTHON -m rlhf_lab plan "${BENCH[@]}" "${ROW[@]}" "${lora[@]}" --device "${DEVICE:-cuda}" \
        --versions "$OUT/versions.json" 2>&1 \
        | tee "$OUT/plan_1b_$row.log"
done
