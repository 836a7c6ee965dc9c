#!/usr/bin/env bash
# What tg checks on a machine with a CUDA GPU, in one go (CI has none, so this is run by hand
# when one is at hand):
#   1. the tests that need a GPU, among them the executor on CUDA against transformers' Mixtral;
#   2. every schedule of a Mixtral-shaped model (scenarios/mixtral-2layer.yaml) executed on the
#      GPU, checked against the sequential reference, with a Perfetto trace of S1;
#   3. with two GPUs or more: tensor parallel and pipeline runs, a process per GPU over NCCL;
#   4. `tg calibrate --device cuda`: this machine's profile, and `tg validate` with it;
#   5. the expert-level schedules (EP, EC, ECP) of Mixtral-8x7B's layers at batch 1, executed
#      and simulated (`tg validate`) with PROFILE (default: the profile step `mixtral` wrote,
#      else the H100's of 2026-11-26);
#   6. (`mixtral`) `tg calibrate` on Mixtral-8x7B's layers (with the batch-1 EP and EC runs
#      that fit the expert kinds), then the held-out S1, S2, S4 validated with it, twice each;
#   7. (`models`) the families after Mixtral on the GPU against transformers (Qwen2/3-MoE,
#      OLMoE, DeepSeek-V2/V3, gpt-oss) and 8- and 4-bit experts, then Qwen3-30B-A3B's layers
#      (128 fine-grained experts, top-8) at batch 1 under EP, EC and ECP, measured and simulated
#      with PROFILE;
#   8. (`quantized`) the same Qwen3-30B-A3B layers with Q4_0 experts (EP: the CPU dequantizes;
#      EC: the GPU does); the tiny model's experts in blocks under S1 (streamed in pages) on one
#      GPU and in tensor parallel over two (one device), at Q4_0, Q4_K and MXFP4, against the
#      dequantized reference; and DeepSeek-V2-Lite's layers (MLA) under S1 and S2, whose CPU
#      attention projects every cached latent (as transformers computes it), with PROFILE.
# On a lent machine, first `. bench/device_setup.sh`.
# Everything lands in OUT (default cuda-check/): log, JSON summaries, the profile, the trace.
#
#     bash bench/cuda_check.sh [OUT] [STEPS]      STEPS: any of tests,execute,validate,mixtral,
#                                                 experts,models,quantized (mixtral before the
#                                                 rest: they run in this order)
#     SCHEDULES="S1 S4" bash bench/cuda_check.sh ...  (the schedules `execute` runs)
set -uo pipefail
OUT=${1:-cuda-check}
STEPS=${2:-tests,execute,validate}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1

# Each schedule's decode layer, measured and simulated, and per kind, from `tg validate --json`.
print_pairs() {
    python3 - "$1" <<'EOF'
import json, sys
for p in json.load(open(sys.argv[1]))["pairs"]:
    print(p["schedule"], "decode layer ms: measured", p["measured"]["decode_layer_ms"],
          "simulated", p["simulated"]["decode_layer_ms"], "error", p["error"]["decode_layer"])
    print("   per kind (simulated, measured) ms:", p["per_kind_median_ms"])
EOF
}

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
nproc

if [[ $STEPS == *tests* ]]; then
    echo "== tests that use the GPU"
    python3 -m pytest -q -p no:cacheprovider -rs -k cuda tests/test_streams.py \
        tests/test_transformers_parity.py tests/test_calibrate_validate.py \
        tests/test_expert_exec.py tests/test_prefetch_exec.py
fi

if [[ $STEPS == *execute* ]]; then
    echo "== Mixtral-shaped layers executed on the GPU"
    for s in ${SCHEDULES:-S1 S2 S3 S4}; do
        extra=()
        [[ $s == S1 ]] && extra=(--trace "$OUT/mixtral-2layer-S1.json.gz" --trace-steps all)
        tg execute scenarios/mixtral-2layer.yaml --device cuda --schedule "$s" --json \
            "${extra[@]}" > "$OUT/execute-$s.json"
        python3 - "$OUT/execute-$s.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(s["schedule"], "tokens_match", s["tokens_match"], "max_abs_err", s["max_abs_err"],
      "decode_layer_ms", s["decode_layer_ms"], "hrm_layer_ms", s["hrm_layer_ms"],
      "prefill_s", s["prefill_s"], "wall_s", s["wall_s"], s["warnings"])
EOF
    done
fi

if [[ $STEPS == *execute* ]] && (( $(nvidia-smi -L | wc -l) >= 2 )); then
    echo "== two GPUs, a process each, over NCCL (tensor parallel S1, pipeline PP)"
    for s in S1 PP; do
        tg execute scenarios/small.yaml --device cuda --schedule "$s" --processes \
            --set hardware.gpu.count=2 --json > "$OUT/processes-$s.json" \
            && python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(s['schedule'], 'tokens_match', s['tokens_match'], 'max_abs_err', s['max_abs_err'])" "$OUT/processes-$s.json"
    done
fi

if [[ $STEPS == *validate* ]]; then
    echo "== this machine's profile, and the model against it"
    tg calibrate scenarios/small.yaml --device cuda --out "$OUT/cuda-profile.yaml"
    tg validate scenarios/small.yaml --device cuda --set hardware="$OUT/cuda-profile.yaml" \
        --repeats 2 --json > "$OUT/validate-small.json" && tg validate scenarios/small.yaml \
        --device cuda --set hardware="$OUT/cuda-profile.yaml" --repeats 1 --mu 2
    tg validate scenarios/mixtral-2layer.yaml --device cuda --mu 2 --repeats 1 \
        --set hardware="$OUT/cuda-profile.yaml" --json > "$OUT/validate-mixtral.json" \
        && python3 -c "import json,sys; [print(p['schedule'], p['error']) for p in json.load(open(sys.argv[1]))['pairs']]" "$OUT/validate-mixtral.json"
fi

if [[ $STEPS == *mixtral* ]]; then
    echo "== this machine's profile from Mixtral-8x7B's layers, and held-out S1, S2, S4 with it"
    tg calibrate scenarios/mixtral-2layer.yaml --device cuda --out "$OUT/profile-mixtral.yaml"
    tg validate scenarios/mixtral-2layer.yaml --device cuda --schedules S1,S2,S4 --mu 4 \
        --repeats 2 --set policy.N=8 --set hardware="$OUT/profile-mixtral.yaml"
fi

if [[ $STEPS == *experts* ]]; then
    echo "== expert-level offloading at batch 1: Mixtral-8x7B's layers, measured and simulated"
    if [[ -z ${PROFILE:-} && -f $OUT/profile-mixtral.yaml ]]; then
        PROFILE=$OUT/profile-mixtral.yaml
    fi
    PROFILE=${PROFILE:-bench/results/h100-2026-11-26/profile-from-mixtral-2layer.yaml}
    tg validate scenarios/mixtral-2layer.yaml --device cuda --schedules EP,EC,ECP --mu 1 \
        --repeats 1 --set policy.N=1 --set policy.mu=1 --set policy.experts_gpu=2 \
        --set workload.gen_len=8 --set hardware="$PROFILE" --json > "$OUT/validate-experts.json" \
        && print_pairs "$OUT/validate-experts.json"
fi

if [[ $STEPS == *models* ]]; then
    echo "== the families after Mixtral, and quantized experts, on the GPU against transformers"
    python3 -c 'import transformers; print("transformers", transformers.__version__)'
    python3 -m pytest -q -p no:cacheprovider -rs -k "cuda or quantized" tests/test_families.py \
        tests/test_quantized_experts.py
    echo "== Qwen3-30B-A3B's layers at batch 1 (128 experts, 8 a token): measured and simulated"
    PROFILE=${PROFILE:-bench/results/h100-2026-11-26/profile-from-mixtral-2layer.yaml}
    tg validate scenarios/mixtral-2layer.yaml --device cuda --schedules EP,EC,ECP --mu 1 \
        --repeats 1 --set model.preset=qwen3-30b-a3b --set model.L=2 --set policy.N=1 \
        --set policy.mu=1 --set policy.experts_gpu=32 --set policy.prefetch=0.5 \
        --set workload.gen_len=8 --set hardware="$PROFILE" --json > "$OUT/validate-qwen3.json" \
        && print_pairs "$OUT/validate-qwen3.json"
fi

if [[ $STEPS == *quantized* ]]; then
    PROFILE=${PROFILE:-bench/results/h100-2026-11-26/profile-from-mixtral-2layer.yaml}
    echo "== Qwen3-30B-A3B's layers at batch 1 with Q4_0 experts: measured and simulated"
    tg validate scenarios/mixtral-2layer.yaml --device cuda --schedules EP,EC --mu 1 \
        --repeats 1 --set model.preset=qwen3-30b-a3b --set model.L=2 --set policy.N=1 \
        --set policy.mu=1 --set policy.experts_gpu=32 --set model.precision.experts=q4_0 \
        --set workload.gen_len=8 --set hardware="$PROFILE" --json > "$OUT/validate-qwen3-q4_0.json" \
        && print_pairs "$OUT/validate-qwen3-q4_0.json"
    echo "== experts in blocks streamed in a layer's pages (S1) and split over two GPUs' shards"
    for fmt in q4_0 q4_k mxfp4; do
        for hw in t4 2xt4; do
            tg execute scenarios/tiny.yaml --device cuda --schedule S1 --set hardware=$hw \
                --set model.precision.experts=$fmt --set policy.r_w=0.5 --json \
                > "$OUT/execute-S1-$hw-$fmt.json" \
                && python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print('S1', sys.argv[2], sys.argv[3], 'tokens_match', s['tokens_match'], 'max_abs_err', s['max_abs_err'])" \
                    "$OUT/execute-S1-$hw-$fmt.json" "$hw" "$fmt"
        done
    done
    echo "== DeepSeek-V2-Lite's layers (MLA) with CPU attention over 512-token prompts"
    tg validate scenarios/mixtral-2layer.yaml --device cuda --schedules S1,S2 --mu 4 \
        --repeats 1 --set model.preset=deepseek-v2-lite --set model.L=2 --set policy.N=8 \
        --set policy.mu=4 --set workload.prompt_len=512 --set workload.gen_len=4 \
        --set hardware="$PROFILE" --json > "$OUT/validate-mla.json" \
        && print_pairs "$OUT/validate-mla.json"
fi
