"""`epdraft run [CONFIG] [--draft DIR --target DIR] [--prompts FILE]`: speculative decoding end to end.

With no arguments: `configs/local-cpu-2.toml` (2 CPU ranks, experts sharded over both) and the tiny
target/draft pair shipped in `epdraft/assets/`, so it runs anywhere with no downloads. It starts the
config's ranks through the launcher (torchrun), each serving its share of the prompts; rank 0 prints
acceptance, throughput, the time split and the lossless check against the target's own greedy decode.
With `--temperature` > 0 (or a prompts line's own `temperature`) requests sample instead, exact in
distribution; the summary then adds each sampling setting's accept rate beside the rate its draft
could expect. `--output` writes every prompt's tokens.

A config of several nodes whose `--master-addr` is loopback (the default) can only run on this host,
so without `--node-rank` every node's torchrun is started here (e.g. configs/local-cpu-disagg.toml:
node 0 the target ranks, node 1 the draft ranks), and the first to fail stops the others; with
`--node-rank N` only node N's.

Before torchrun starts, `epdraft.preflight` checks the flags, the draft, the target, the prompts and
the rendezvous port: a bad input stops the command with one line (exit 2) and no rank starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from epdraft.config.parallel import load_parallel_config
from epdraft.launch import add_node_arguments, check_master_port, run_local_nodes, run_torchrun, torchrun_command
from epdraft.parallel.address import is_loopback
from epdraft.preflight import WEIGHT_CHECK_BYTES, check_run

PACKAGE = Path(__file__).resolve().parent
DEFAULT_CONFIG = PACKAGE / "configs" / "local-cpu-2.toml"
ASSETS = PACKAGE / "assets"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG),
                        help="parallel config: a file, or a shipped config's name (default: local-cpu-2)")  # fmt: skip
    parser.add_argument("--draft", default=str(ASSETS / "tiny-draft"), help="draft export directory (default: tiny pair)")
    parser.add_argument("--target", default=str(ASSETS / "tiny-target"), help="HF target directory (default: tiny pair)")
    parser.add_argument(
        "--prompts",
        default=str(ASSETS / "prompts.jsonl"),
        help='JSON-lines prompts, {"input_ids": [...]} or {"text": "..."} per line, each optionally with its own '
        '"temperature", "top_k", "top_p", "seed" and an "id" (echoed in --output)',
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    parser.add_argument("--max-prompts", type=int, default=0, help="use only the first N prompts (default all)")
    parser.add_argument("--no-lossless-check", action="store_true", help="skip the target-only reference decode")
    parser.add_argument("--json", help="also write the summary as JSON to this path")
    parser.add_argument("--output", metavar="FILE.jsonl",
                        help="write every prompt's generated tokens here, one JSON line per prompt in the prompts "
                             "file's order (its id, output_ids, text, verify steps, accepted drafts, its sampling; "
                             "a refused prompt's error)")  # fmt: skip
    sampling = parser.add_argument_group(
        "sampling (every prompt's defaults; a prompts line's own temperature / top_k / top_p / seed override them)"
    )
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="0 = greedy, checked lossless against the target's own greedy decode (default); "
                               "> 0 samples, exact in distribution (colocated placement only)")  # fmt: skip
    sampling.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: all)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="keep the nucleus of this mass, in (0, 1] (default 1)")
    sampling.add_argument("--seed", type=int, default=0,
                          help="the run's seed: a prompt without its own seed gets one derived from this and its "
                               "index, so a run repeats exactly (default 0)")  # fmt: skip
    parser.add_argument("--show", type=int, default=0, metavar="N",
                        help="print the first N requests' generated text (token ids when the target has no "
                        "tokenizer); also in --json")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="the draft's weights (default: bfloat16 on CUDA, where the fused expert kernels run, "
                             "float32 on CPU)")
    parser.add_argument("--target-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the target's weights (default float32: a bf16 target's batched verify is not bit-equal "
                             "to its own greedy decode, so the lossless check would not hold exactly)")
    parser.add_argument(
        "--check-weights", action=argparse.BooleanOptionalAction, default=None,
        help=f"read the draft's weights once before starting and refuse NaN/inf (default: when the draft is "
        f"under {WEIGHT_CHECK_BYTES >> 30} GiB)",
    )  # fmt: skip
    add_node_arguments(parser)
    # None: this node only on a single-node config or a remote master, every node when the master is loopback.
    parser.set_defaults(node_rank=None)


def main(args: argparse.Namespace) -> int:
    from epdraft.parallel.groups import resolve_backend

    pc = load_parallel_config(args.config, args.set)
    # What this host can run (CUDA or not, the backend `auto` resolves to) is refused here, before any rank starts.
    resolve_backend(pc)
    check_run(args, pc)
    worker_args = [
        "--draft", args.draft,
        "--target", args.target,
        "--prompts", args.prompts,
        "--max-new-tokens", str(args.max_new_tokens),
        "--max-prompts", str(args.max_prompts),
        "--log-level", args.log_level,
        "--master-addr", args.master_addr,
    ]  # fmt: skip
    worker_args += ["--target-dtype", args.target_dtype]
    if args.dtype:
        worker_args += ["--dtype", args.dtype]
    if args.no_lossless_check:
        worker_args.append("--no-lossless-check")
    if args.json:
        worker_args += ["--json", str(Path(args.json).resolve())]
    if args.output:
        worker_args += ["--output", str(Path(args.output).resolve())]
    worker_args += ["--temperature", repr(args.temperature), "--top-p", repr(args.top_p), "--seed", str(args.seed)]
    if args.top_k is not None:
        worker_args += ["--top-k", str(args.top_k)]
    if args.show:
        worker_args += ["--show", str(args.show)]
    local_nodes = args.node_rank is None and pc.cluster.nnodes > 1 and is_loopback(args.master_addr)
    node_ranks = range(pc.cluster.nnodes) if local_nodes else [args.node_rank or 0]
    cmds = [
        torchrun_command(
            pc,
            args.config,
            node_rank=node,
            master_addr=args.master_addr,
            master_port=args.master_port,
            overrides=args.set,
            worker_args=worker_args,
        )
        for node in node_ranks
    ]
    check_master_port(pc, node_ranks, args.master_port)
    if local_nodes:
        return run_local_nodes(cmds, pc, args)
    args.node_rank = node_ranks[0]
    return run_torchrun(cmds[0], pc, args)
