#!/usr/bin/env bash
# The checks that need a GPU, in one go, from the repository's root; what each prints and
# writes goes under OUT_DIR (docs/benchmarks.md says what to read in it):
#
#   bash scripts/gpu_checks.sh OUT_DIR [PART ...]
#
# parts, in this order by default:
#   agentic the multi-turn engine's tests on the GPU (tests/test_turns.py: parked and prefilled
#           sequences, batch-invariant steps as CUDA graphs) and the agentic flow's tests; the
#           tiny agentic preset trained on the GPU, its checkpoint evaluated (m2flow eval), and
#           the preset again under placement=auto over the GPU made two devices, and
#           disaggregated there one step ahead (weights reach the rollout between decode steps)
#   restart the tiny GRPO preset disaggregated over the GPU made two devices, its rollout's
#           process killed after the checkpoint of step 4: the run restarts from it (the living
#           processes kept) and finishes
#   tests   the CUDA tests: devices, CUDA IPC and NCCL (tests/test_gpu.py); the engine's
#           decode steps as CUDA graphs, with weights taken in flight and prompts joining a
#           call in progress (tests/test_engine.py)
#   engine  SmolLM2's rollout engine on the GPU: decode steps as CUDA graphs against eager
#           ones, and continuous generation across steps against draining each step
#   pair    asynchronous GRPO against on-policy GRPO on SmolLM2, both sides planned
#           (placement=auto) over the GPU made two devices, the decode steps as CUDA graphs
#           (benchmarks/async_reasoning.py); its journal (JOURNAL, default
#           runs/gpu/pairs.jsonl) keeps each side as it ends, so a pair cut short by its time
#           limit is finished by running this part again
#
# Each part's commands have a time limit each (AGENTIC_S, RESTART_S, TESTS_S, ENGINE_S, PAIR_S
# seconds), and a part that fails or runs out does not stop the next; the script's status is
# that of the last part that failed.
# SEED picks the pair's seed (default 3), PYTHON the interpreter.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_checks.sh OUT_DIR [agentic] [restart] [tests] [engine] [pair]}
shift
parts=${*:-agentic restart tests engine pair}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
status=0

{
    date -u
    uptime
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c "import sys, torch, ray, transformers; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, ray.__version__, transformers.__version__)"
    git rev-parse --short HEAD 2>/dev/null
} >"$out/machine.txt" 2>&1

run() {  # run NAME LIMIT_S COMMAND...: output to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee -a "$out/$name.log"
    timeout "$limit" "$@" >>"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc" | tee -a "$out/$name.log"
    [ "$rc" -eq 0 ] || status=$rc
}

for part in $parts; do
    case $part in
    agentic)
        runs=${RUNS:-runs/gpu}
        run agentic "${AGENTIC_S:-300}" "$py" -m pytest -q -p no:cacheprovider -rs tests/test_turns.py \
            tests/test_agentic.py
        run agentic "${AGENTIC_S:-300}" "$py" -m m2flow train agentic/tool_arith_tiny \
            runner.out_dir="$runs/tool_arith_tiny"
        run agentic "${AGENTIC_S:-300}" "$py" -m m2flow eval agentic/tool_arith_tiny checkpoint=auto \
            runner.out_dir="$runs/tool_arith_tiny" out="$out/agentic_eval.json"
        run agentic "${AGENTIC_S:-300}" "$py" -m m2flow train agentic/tool_arith_tiny placement=auto \
            cluster.gpu_slots=2 runner.out_dir="$runs/tool_arith_tiny_auto"
        run agentic "${AGENTIC_S:-300}" "$py" -m m2flow train agentic/tool_arith_tiny placement.mode=disaggregated \
            cluster.gpu_slots=2 runner.max_staleness=1 runner.steps=6 runner.out_dir="$runs/tool_arith_tiny_ahead"
        cp "$runs/tool_arith_tiny_ahead/metrics.csv" "$out/agentic_ahead_metrics.csv" 2>/dev/null
        cp "$runs/tool_arith_tiny/metrics.csv" "$out/agentic_metrics.csv" 2>/dev/null
        cp "$runs/tool_arith_tiny_auto/metrics.csv" "$out/agentic_auto_metrics.csv" 2>/dev/null
        ;;
    restart)
        runs=${RUNS:-runs/gpu}
        dir="$runs/restart"
        rm -rf "$dir"
        echo "== restart: the tiny GRPO preset disaggregated over the GPU made two devices, its rollout killed" \
            | tee -a "$out/restart.log"
        timeout "${RESTART_S:-300}" "$py" -m m2flow train reasoning/grpo_arith_tiny runner.steps=10 \
            runner.checkpoint_every=2 runner.eval_every=0 cluster.gpu_slots=2 placement.mode=disaggregated \
            runner.out_dir="$dir" >>"$out/restart.log" 2>&1 &
        train=$!
        others="^ray::(LMActorWorker|InferenceWorker|RewardWorker)"
        for _ in $(seq 1500); do [ -e "$dir/checkpoints/step_000004.safetensors" ] && break; sleep 0.2; done
        before=$(pgrep -f -d " " "$others")
        pkill -9 -f "^ray::LMRolloutWorker" && echo "killed the rollout's process" | tee -a "$out/restart.log"
        for _ in $(seq 1500); do [ -e "$dir/checkpoints/step_000008.safetensors" ] && break; sleep 0.2; done
        echo "the other components' processes before the kill: $before; after the restart: $(pgrep -f -d " " \
            "$others")" | tee -a "$out/restart.log"
        wait "$train"
        rc=$?
        echo "== restart: exit $rc" | tee -a "$out/restart.log"
        grep -h " restart [0-9]" "$dir/log.txt" | tee -a "$out/restart.log"
        cp "$dir/metrics.csv" "$out/restart_metrics.csv" 2>/dev/null
        [ "$rc" -eq 0 ] || status=$rc
        ;;
    tests)
        run tests "${TESTS_S:-300}" "$py" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
        run tests "${TESTS_S:-300}" "$py" -m pytest -q -p no:cacheprovider -rs tests/test_engine.py \
            -k "cuda or more_prompts or weights_loaded_between_steps"
        ;;
    engine)
        run engine "${ENGINE_S:-240}" "$py" benchmarks/rollout_engine.py --device cuda --graphs \
            --sides engine_steps engine_continuous --temperature 0.7
        run engine "${ENGINE_S:-240}" "$py" benchmarks/rollout_engine.py --device cuda --sides engine engine_graphs
        ;;
    pair)
        journal=${JOURNAL:-runs/gpu/pairs.jsonl}
        mkdir -p "$(dirname "$journal")"
        run pair "${PAIR_S:-560}" "$py" benchmarks/async_reasoning.py --steps 24 --eval-every 4 --seed "${SEED:-3}" \
            --override cluster.gpu_slots=2 rollout.cuda_graphs=true --journal "$journal"
        cp "$journal" "$out/" 2>/dev/null
        ;;
    *)
        echo "unknown part $part: agentic, restart, tests, engine or pair" >&2
        exit 2
        ;;
    esac
done
exit $status
