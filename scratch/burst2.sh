export DIRECTKV_CACHE_DIR=/tmp/dkc
timeout 240 python3 -m pytest -q -m gpu tests -k "multi_token or link" > $OUT/pytest.txt 2>&1; tail -3 $OUT/pytest.txt
B='"consumer_wgs": 2, "carveout": 100, "ctas_per_sm": 1, "max_inflight": 1'
CFGS="[{\"tile_n\":64,\"stages\":6,\"chunk_tiles\":5,$B,\"link_credits\":8},
{\"tile_n\":64,\"stages\":6,\"chunk_tiles\":5,$B,\"link_credits\":8,\"edge_tiles\":1},
{\"tile_n\":64,\"stages\":6,\"chunk_tiles\":5,$B,\"link_credits\":8,\"edge_tiles\":2},
{\"tile_n\":64,\"stages\":6,\"chunk_tiles\":4,$B,\"link_credits\":8,\"edge_tiles\":1},
{\"tile_n\":128,\"stages\":3,\"chunk_tiles\":2,$B,\"link_credits\":16},
{\"tile_n\":128,\"stages\":3,\"chunk_tiles\":2,$B,\"link_credits\":16,\"edge_tiles\":1}]"
timeout 300 python3 -m bench prefill --contexts 8192,32768 --q-lens 512,2048 --hbm-fractions 0,1 --no-plot --no-progress --max-rep-s 0.6 --out-dir $OUT/ab --compare-configs "$CFGS" > $OUT/ab.log 2>&1; tail -2 $OUT/ab.log
C='{"tile_n":64,"stages":6,"chunk_tiles":5,"consumer_wgs":2,"carveout":100,"ctas_per_sm":1,"max_inflight":1,"link_credits":8,"edge_tiles":1}'
for h in 0 1; do timeout 100 python3 -m bench timeline --context 32768 --q-len 2048 --hbm-fraction $h --config "$C" 2>&1 | tail -40; done
