#!/usr/bin/env bash
# The long-context evaluation matrix (issue 38) as a queue of `kvq run-eval` commands, the
# ones a user types. Each (cache, task set) writes OUT/<tasks>_<cache>.json and its PNGs
# under OUT/plots/<tasks>_<cache>/; a report already there is skipped, so the queue can be
# stopped and resumed. Every finished cell of passkey/needle/decode/speculative is kept in
# MEMO (--result-cache): the unquantized side is computed once for the whole matrix, and a
# run stopped halfway resumes at the cell it stopped in.
#
#   bash bench/eval_long.sh [STAGE ...]     stages: needle decode passkey ppl8k (default: all, in this order)
#
# MEMO defaults to a folder beside the reports, committed with them: the baseline's cells
# are keyed by the model, inputs and library versions, not by kvq's source, so a later
# checkout resumes a grid where the last one stopped instead of recomputing hours of it.
#
# Caches: CACHES="name=--artifact:DIR name=--policy:NAME ..." (default below). On a 2-core
# CPU a 1K-8K retrieval grid (5 depths x 8 trials) takes about 15 min a cache, the
# baseline once as long again; an 8K KLD window about 4 min a side.
set -u
cd "$(dirname "$0")/.."
KVQ=${KVQ:-.venv/bin/kvq}
OUT=${OUT:-bench/results/cpu/eval_long}
MEMO=${MEMO:-$OUT/memo}
MODEL=${MODEL:-gemma3-270m}
CACHES=${CACHES:-"demo=--artifact:artifacts/demo auto3=--artifact:artifacts/auto3 int8=--policy:int8 kivi2=--policy:kivi2 auto2=--artifact:artifacts/auto2"}
export KVQ_DATA_DIR=${KVQ_DATA_DIR:-$(cd .. && pwd)/shared/data}
STAGES=${*:-needle decode passkey ppl8k}
mkdir -p "$OUT/plots"

run() {  # run NAME CACHE-FLAGS TAG ARGS...
  local name=$1 flags=$2 tag=$3
  shift 3
  local report="$OUT/${tag}_${name}.json"
  if [ -f "$report" ]; then echo "skip $report (there)"; return; fi
  echo "== $(date -u +%H:%M:%S) $tag $name: $KVQ run-eval ${flags/:/ } $*"
  # shellcheck disable=SC2086
  "$KVQ" run-eval --model "$MODEL" ${flags/:/ } --json "$report" \
    --plot "$OUT/plots/${tag}_${name}" "$@" || echo "!! $tag $name failed (rc $?)"
}

for stage in $STAGES; do
  for entry in $CACHES; do
    name=${entry%%=*} flags=${entry#*=}
    case $stage in
      needle|passkey)
        run "$name" "$flags" "$stage" --tasks "$stage" --contexts 1024,2048,4096,8192 \
          --trials 8 --result-cache "$MEMO" ;;
      decode)
        run "$name" "$flags" decode --tasks decode,speculative --new-tokens 512 --prompts 4 \
          --contexts 1024 --result-cache "$MEMO" ;;
      ppl8k)
        run "$name" "$flags" ppl8k --tasks ppl,kld,bytes --windows 2 --seqlen 8192 ;;
      *) echo "unknown stage $stage"; exit 2 ;;
    esac
  done
done
