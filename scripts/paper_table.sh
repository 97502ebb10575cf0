#!/usr/bin/env bash
# The six paper configurations modeled with both FLOP formulas (scheduling.cost_formula paper | model),
# skrull policy, as the markdown table in docs/benchmarks.md. Modeled numbers, not measurements.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "| config | formula | vs balanced_packed | vs static CP k=1 | vs static CP packed | vs sorted | bound ratio (feasible) | paper (vs DeepSpeed) |"
echo "|---|---|---|---|---|---|---|---|"
declare -A paper=([qwen2.5-0.5b-wikipedia]=7.54x [qwen2.5-0.5b-lmsys]=~6.17x [qwen2.5-0.5b-chatqa2]=~2.79x
                  [qwen2.5-7b-wikipedia]=~2.60x [qwen2.5-7b-lmsys]=~2.14x [qwen2.5-7b-chatqa2]=~1.35x)
row='import json, sys
name, formula, paper = sys.argv[1:]
r = json.load(sys.stdin)["policies"]["skrull"]
cells = [f"{r[k]:.2f}x" for k in ("speedup_vs_balanced_packed", "speedup_vs_static_cp", "speedup_vs_static_cp_packed",
                                      "speedup_vs_sorted")]
print(" | ".join(["", name, formula, *cells, format(r["bound_ratio_feasible"], ".3f"), paper, ""]).strip())'
for name in qwen2.5-0.5b-wikipedia qwen2.5-0.5b-lmsys qwen2.5-0.5b-chatqa2 \
            qwen2.5-7b-wikipedia qwen2.5-7b-lmsys qwen2.5-7b-chatqa2; do
  for formula in paper model; do
    .venv/bin/python -m app plan --config "configs/paper/$name.yaml" --set "scheduling.cost_formula=$formula" \
        --json 2>/dev/null | .venv/bin/python -c "$row" "$name" "$formula" "${paper[$name]}"
  done
done
