#!/usr/bin/env bash
# Speculation's own gain, served: one `specd serve --http-port` per drafter and load point,
# the same prompts with speculation on, then off (`--extra-body '{"speculation": {"enabled":
# false}}'`) against that same server. "On" runs first so that the suffix cache has not seen a
# measured answer; each load point gets its own server for the same reason. The prefix cache
# is off: it would hand the second run every prompt's KV cache. For a quiet machine.
#
#   scripts/served_gain.sh OUT_DIR [DRAFTER[:HEAD_DIR] ...]
#
# e.g. scripts/served_gain.sh bench-out/gain suffix+lookup eagle3+suffix:path/to/head
# Environment: DATASET (mt-bench), PROMPTS (16), OUTPUT_LEN (128), CONCURRENCY ("1 8"),
# PORT (8123), SPECD (specd), SERVE_ARGS (more `specd serve` flags, e.g. "--model DIR").
set -euo pipefail
out=${1:?usage: served_gain.sh OUT_DIR [DRAFTER[:HEAD_DIR] ...]}
shift
drafters=("${@:-suffix+lookup}")
dataset=${DATASET:-mt-bench}
prompts=${PROMPTS:-16}
output_len=${OUTPUT_LEN:-128}
port=${PORT:-8123}
specd=${SPECD:-specd}
mkdir -p "$out"

server=""
stop_server() {  # our own server only, through its PID
    if [[ -n "$server" ]] && kill -0 "$server" 2>/dev/null; then
        kill -TERM "$server"
        for _ in $(seq 60); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$server" 2>/dev/null && kill -KILL "$server"
    fi
    server=""
}
trap stop_server EXIT

for spec in "${drafters[@]}"; do
    drafter=${spec%%:*}
    head=""
    [[ "$spec" == *:* ]] && head=${spec#*:}
    for c in ${CONCURRENCY:-1 8}; do
        tag="$dataset-${drafter//+/_}-c$c"
        args=(serve --http-port "$port" --port 0 --drafter "$drafter" --no-prefix-caching)
        [[ -n "$head" ]] && args+=(--drafter-path "$head")
        # shellcheck disable=SC2206
        args+=(${SERVE_ARGS:-})
        # Something else answering on the port would be measured instead of our server.
        if curl -s -o /dev/null "http://127.0.0.1:$port/health"; then
            echo "served_gain.sh: port $port already answers: set PORT" >&2
            exit 1
        fi
        "$specd" "${args[@]}" >"$out/$tag.server.log" 2>&1 &
        server=$!
        for _ in $(seq 600); do
            kill -0 "$server" 2>/dev/null || { cat "$out/$tag.server.log"; exit 1; }
            curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
            sleep 0.5
        done
        # Untimed: the same load on other prompts, so that one-time costs (the adaptive
        # cost model's calibration, the thread and schedule choices' first measurements, new
        # batch shapes) fall outside both measured runs.
        "$specd" bench serve --base-url "http://127.0.0.1:$port/v1" --dataset-name random \
            --num-prompts "$((2 * c))" --output-len 32 --max-concurrency "$c" --disable-tqdm \
            >"$out/$tag-warmup.txt"
        for mode in on off; do
            extra=()
            [[ $mode == off ]] && extra=(--extra-body '{"speculation": {"enabled": false}}')
            "$specd" bench serve --base-url "http://127.0.0.1:$port/v1" --dataset-name "$dataset" \
                --num-prompts "$prompts" --output-len "$output_len" --temperature 0 \
                --max-concurrency "$c" --disable-tqdm "${extra[@]}" \
                --result-json "$out/$tag-$mode.json" >"$out/$tag-$mode.txt"
        done
        stop_server
    done
done

python - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run (category: gain in p50 TPOT)':<36}{'tok/s on':>9}{'off':>8}{'gain':>7}{'TPOT on':>9}{'off':>8}{'acc len':>8}"
      f"{'texts equal':>12}")
for on in sorted(out.glob("*-on.json")):
    a, b = json.loads(on.read_text()), json.loads(on.with_name(on.name[:-8] + "-off.json")
                                                   .read_text())
    same = sum(x == y for x, y in zip(a["generated_texts"], b["generated_texts"]))
    al = a.get("acceptance_length")
    equal = f"{same}/{len(a['generated_texts'])}"
    print(f"{on.name[:-8]:<36}{a['output_throughput']:>9.2f}{b['output_throughput']:>8.2f}"
          f"{a['output_throughput'] / b['output_throughput']:>6.2f}x"
          f"{a['median_tpot_ms']:>9.1f}{b['median_tpot_ms']:>8.1f}"
          f"{al if al is None else round(al, 2)!s:>8}{equal:>12}")
    for cat, m in (a.get("per_category") or {}).items():
        # A category's throughput is its share of the run's: compare its TPOT (off / on).
        n = b["per_category"][cat]
        print(f"  {cat:<34}{'':>17}{n['median_tpot_ms'] / m['median_tpot_ms']:>6.2f}x"
              f"{m['median_tpot_ms']:>9.1f}{n['median_tpot_ms']:>8.1f}"
              f"{str(round(m['acceptance_length'], 2)) if m.get('acceptance_length') else '-':>8}")
EOF
