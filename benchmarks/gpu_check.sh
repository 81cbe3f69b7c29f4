#!/usr/bin/env bash
# The vmap runtime and the other CUDA paths on a GPU, checked in under 8 minutes, from the repository root:
#
#     OUT=/some/folder bash benchmarks/gpu_check.sh                 # on the GPU machine
#     OUT=$(mktemp -d) GPT_STEPS=2 DIGITS_STEPS=10 REPEATS=1 bash benchmarks/gpu_check.sh --device cpu
#                                                                    # the same steps on CPU (a dry run)
#
# Needs python3 with torch (CUDA) and meshtrain's core dependencies importable; installs
# nothing and needs no network: meshtrain runs from this checkout through PYTHONPATH. Where
# paramiko is missing (the CLI and `hosts bench` import it), put it on PYTHONPATH first, e.g.
# from wheels downloaded elsewhere: paramiko bcrypt cryptography pynacl cffi pycparser invoke
# (`pip install --no-index --no-deps --target /tmp/site *.whl; export PYTHONPATH=/tmp/site`).
# Writes 5 files to $OUT (a temporary folder if unset):
#   env.txt       python, torch, the GPU, which of meshtrain's dependencies import
#   tests.txt     (a) tests/test_cuda.py (cuda only) and tests/test_vmap_runtime.py's tests that
#                 take a device, on this device
#   simulate.txt  (b) a tiny gpt run, threads runtime then vmap runtime, on the device: through
#                 `python3 -m meshtrain simulate` when paramiko imports (the CLI imports it at
#                 start), else the same run through the library (Trainer.fit), which does not
#   bench.txt     (c) benchmarks/vmap.py --device DEVICE: 16 nodes, threads against vmap, gpt and
#                 the digits MLP, DDP and DiLoCo(H=20), a table at the end
#   summary.txt   each step's exit status and seconds
# Each step has its own time limit, so one that hangs leaves the others their time; all of
# them together are at most 7 minutes 15 s (30 + 160 + 2 x 45 + 110 + 45).
# GPT_STEPS, DIGITS_STEPS and REPEATS (default 20, 100, 2) size the benchmark (smaller for a dry run).
set -u
DEVICE=cuda
if [ "${1:-}" = "--device" ] && [ -n "${2:-}" ]; then DEVICE=$2; fi
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

step() {  # step NAME LIMIT_SECONDS FILE COMMAND...: run it, append its exit status and time
    local name=$1 limit=$2 file=$3
    shift 3
    local started=$SECONDS
    echo "== $name: $*" >> "$file"
    timeout --kill-after=10 "$limit" "$@" >> "$file" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - started)) s (limit $limit s; output in $(basename "$file"))" \
        | tee -a "$SUMMARY"
}

if ! "$PY" -c "import torch" 2> "$OUT/env.txt"; then
    echo "python3 cannot import torch: nothing to check (see env.txt)" | tee -a "$SUMMARY"
    exit 1
fi

step env 30 "$OUT/env.txt" "$PY" - "$DEVICE" <<'EOF'
import importlib, platform, sys
import torch
device = sys.argv[1]
print("python", platform.python_version(), "torch", torch.__version__, "device", device)
if device.startswith("cuda"):
    print("cuda available:", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("gpu:", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("typer", "rich", "yaml", "transformers", "peft", "sklearn", "matplotlib", "paramiko", "jiwer"):
    try:
        importlib.import_module(name)
        print(f"{name}: imports")
    except Exception as exc:  # noqa: BLE001 - report, do not stop
        print(f"{name}: does not import ({type(exc).__name__}: {exc})")
import meshtrain
print("meshtrain from", meshtrain.__file__)
EOF
nvidia-smi --query-gpu=name,memory.total,memory.used,utilization.gpu --format=csv >> "$OUT/env.txt" 2>&1 || true

# (a) the CUDA paths' tests and the vmap tests that take a device, on this one (on cpu: the cpu
# cases); first, so that a call cut short still has them
step "tests" 160 "$OUT/tests.txt" "$PY" -m pytest -q -rA -p no:cacheprovider -n 0 \
    tests/test_cuda.py tests/test_vmap_runtime.py -k "$DEVICE"

# A text for the gpt task: 60,000 characters of a few words in a seeded random order.
"$PY" - "$WORK/text.txt" <<'EOF'
import random, sys
words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()
rng = random.Random(0)
text = " ".join(rng.choice(words) for _ in range(12000))
open(sys.argv[1], "w").write("\n".join(text[i:i + 80] for i in range(0, len(text), 80)))
EOF

# (b) a tiny simulate, threads then vmap, on the device
SIM_ARGS=(--task gpt --data "$WORK/text.txt" --strategy diloco --nodes 4 --steps 10 --batch-size 8
          --device "$DEVICE" --no-progress --out "$WORK/runs")
if "$PY" -c "import paramiko" 2> /dev/null; then
    for runtime in threads vmap; do
        step "simulate-$runtime" 45 "$OUT/simulate.txt" "$PY" -m meshtrain simulate "${SIM_ARGS[@]}" --runtime "$runtime"
    done
else
    echo "paramiko does not import, and the meshtrain CLI imports it at start: the same run goes through the library" \
        | tee -a "$OUT/simulate.txt" "$SUMMARY"
    for runtime in threads vmap; do
        step "simulate-$runtime (library)" 45 "$OUT/simulate.txt" "$PY" - "$WORK/text.txt" "$DEVICE" "$runtime" "$WORK/runs" <<'EOF'
import sys
from meshtrain import Trainer
from meshtrain.strategies import DiLoCo
from meshtrain.tasks import TaskOptions, check_options
from meshtrain.tasks.gpt import TASK
text, device, runtime, out = sys.argv[1:5]
gpt = TASK.build(TaskOptions(data=text, seed=0, options=check_options(TASK, {})))
result = Trainer(gpt.model, gpt.train_data, gpt.val_data).fit(
    DiLoCo(H=20), nodes=4, max_steps=10, batch_size=8, runtime=runtime, device=device,
    val_interval=5, val_size=64, out_dir=out, progress=False)
s = result.summary
print(f"{runtime} on {device}: final train loss {s['final_train_loss']:.6f}, val loss "
      f"{s['final_val_loss']:.6f}, sent {s['bytes_sent_per_node']} bytes per node, run {result.run_dir}")
EOF
    done
fi

# (c) the benchmark: gpt first (the workload that matters on a GPU), then the digits MLP
step "bench-gpt" 110 "$OUT/bench.txt" "$PY" benchmarks/vmap.py --device "$DEVICE" --workloads gpt \
    --steps "${GPT_STEPS:-20}" --repeats "${REPEATS:-2}"
step "bench-digits" 45 "$OUT/bench.txt" "$PY" benchmarks/vmap.py --device "$DEVICE" \
    --workloads "digits MLP" --steps "${DIGITS_STEPS:-100}" --repeats "${REPEATS:-2}"

rm -rf "$WORK"
echo "outputs in $OUT" | tee -a "$SUMMARY"
