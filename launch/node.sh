#!/usr/bin/env bash
# Start this node's epdraft ranks: run once on every node of a multi-node config.
#
#   NODE_RANK=0 MASTER_ADDR=node0 CONFIG=configs/2node-h200x16-dp16-ep16.toml launch/node.sh
#   NODE_RANK=1 MASTER_ADDR=node0 CONFIG=configs/2node-h200x16-dp16-ep16.toml launch/node.sh
#
# Env: NODE_RANK (0..nnodes-1), MASTER_ADDR (host of node 0, reachable from every node),
# MASTER_PORT (default 29500), CONFIG (a parallel config). Extra arguments go to `epdraft launch`,
# e.g. `--set cluster.timeout_s=300`. Exits with the launch's exit code.
set -euo pipefail

: "${NODE_RANK:?set NODE_RANK to the index of this node (0 on the master)}"
: "${MASTER_ADDR:?set MASTER_ADDR to the host of node 0}"
: "${CONFIG:?set CONFIG to a parallel config, e.g. configs/2node-h200x16-dp16-ep16.toml}"

exec epdraft launch "$CONFIG" \
  --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" \
  --master-port "${MASTER_PORT:-29500}" \
  "$@"
