set -x
export DIRECTKV_CACHE_DIR=/tmp/dkc
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 200 python3 -m pytest -q -m gpu tests -x -k "multi_token or link or decode_matches" 2>&1 | tail -6
B='"consumer_wgs": 2, "carveout": 100, "ctas_per_sm": 1'
CFGS="[{\"tile_n\":128,\"stages\":3,\"chunk_tiles\":2,$B,\"max_inflight\":1},
{\"tile_n\":128,\"stages\":3,\"chunk_tiles\":2,$B,\"max_inflight\":1,\"link_credits\":4},
{\"tile_n\":128,\"stages\":3,\"chunk_tiles\":2,$B,\"max_inflight\":1,\"link_credits\":8},
{\"tile_n\":128,\"stages\":3,\"chunk_tiles\":2,$B,\"max_inflight\":1,\"link_credits\":16},
{\"tile_n\":128,\"stages\":3,\"chunk_tiles\":2,$B,\"max_inflight\":1,\"link_credits\":32},
{\"tile_n\":64,\"stages\":6,\"chunk_tiles\":5,$B,\"max_inflight\":1,\"link_credits\":8},
{\"tile_n\":64,\"stages\":6,\"chunk_tiles\":5,$B,\"max_inflight\":1,\"link_credits\":24}]"
timeout 330 python3 -m bench prefill --contexts 8192,32768 --q-lens 512,2048 --hbm-fractions 0,1 --no-plot --no-progress --max-rep-s 0.6 --out-dir $OUT/ab --compare-configs "$CFGS" 2>&1 | tail -80
