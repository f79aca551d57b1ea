"""Flags of Megatron's "distributed" group: parallel sizes, pipeline layout, DDP and FSDP.

Option strings, dests, types, defaults, choices and nargs are Megatron-LM 0.13.1's; whether a
flag has an effect here is recorded in `manifest.json`.
"""
from megatron.training.arguments._spec import add_group, flag
from megatron.training.arguments.manifest import flag_help

DISTRIBUTED_FLAGS = (
    flag("--tensor-model-parallel-size", type=int, default=1, help="TP."),
    flag("--encoder-tensor-model-parallel-size", type=int, default=0),
    flag("--pipeline-model-parallel-size", type=int, default=1, help="PP."),
    flag("--encoder-pipeline-model-parallel-size", type=int, default=0),
    flag("--pipeline-model-parallel-split-rank", type=int),
    flag("--decoder-first-pipeline-num-layers", type=int, help="Uneven PP."),
    flag("--decoder-last-pipeline-num-layers", type=int, help="Uneven PP."),
    flag("--pipeline-model-parallel-layout", type=str, help='E.g. "E|(t|)*3,m|m||L".'),
    flag("--model-parallel-size", type=int),
    flag("--num-layers-per-virtual-pipeline-stage", type=int, help="VPP (interleaved 1F1B)."),
    flag("--num-virtual-stages-per-pipeline-rank", type=int, help="VPP (interleaved 1F1B)."),
    flag(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        dest="microbatch_group_size_per_vp_stage",
        type=int,
        help="VPP microbatch grouping.",
    ),
    flag(
        "--no-overlap-p2p-communication",
        action="store_false",
        dest="overlap_p2p_comm",
        help=(
            "Disables the p2p overlap; it is forced False without VPP. The config's batch_p2p_comm = not "
            "overlap_p2p_comm."
        ),
    ),
    flag("--overlap-p2p-communication-warmup-flush", action="store_true", dest="overlap_p2p_comm_warmup_flush"),
    flag("--distributed-backend", default="nccl", choices=["nccl", "gloo"], help="Nccl|gloo."),
    flag("--distributed-timeout-minutes", type=int, default=10, help="PG timeout."),
    flag("--overlap-grad-reduce", action="store_true", help="Comm overlap."),
    flag("--defer-embedding-wgrad-compute", action="store_true", help="Output-layer wgrad deferral."),
    flag("--wgrad-deferral-limit", type=int, default=0, help="Output-layer wgrad deferral."),
    flag(
        "--no-align-grad-reduce",
        action="store_false",
        dest="align_grad_reduce",
        help=(
            "Launch the reduce or gather independently per PP stage instead of aligned; "
            "align_param_gather is forced False without VPP."
        ),
    ),
    flag("--ddp-num-buckets", type=int, help="DDP buckets."),
    flag("--ddp-bucket-size", type=int, help="DDP buckets."),
    flag("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true", help="DDP buckets."),
    flag("--ddp-average-in-collective", action="store_true", help="DDP buckets."),
    flag("--overlap-param-gather", action="store_true", help="Comm overlap."),
    flag("--overlap-param-gather-with-optimizer-step", action="store_true", help="Needs VPP + dist-opt."),
    flag(
        "--no-align-param-gather",
        action="store_false",
        dest="align_param_gather",
        help=(
            "Launch the reduce or gather independently per PP stage instead of aligned; "
            "align_param_gather is forced False without VPP."
        ),
    ),
    flag("--no-scatter-gather-tensors-in-pipeline", action="store_false", dest="scatter_gather_tensors_in_pipeline"),
    flag("--use-ring-exchange-p2p", action="store_true"),
    flag("--local-rank", type=int, default=0, help="Device index."),
    flag("--lazy-mpu-init", type=bool),
    flag(
        "--account-for-embedding-in-pipeline-split",
        action="store_true",
        help="Count the embedding/loss as a layer.",
    ),
    flag("--account-for-loss-in-pipeline-split", action="store_true", help="Count the embedding/loss as a layer."),
    flag("--use-distributed-optimizer", action="store_true", help="ZeRO-1 style sharded optimizer."),
    flag("--use-nccl-ub", action="store_true", dest="nccl_ub"),
    flag("--use-sharp", action="store_true"),
    flag(
        "--use-custom-fsdp",
        action="store_true",
        help="Megatron FSDP (no_shard|optim|optim_grads|optim_grads_params).",
    ),
    flag("--init-model-with-meta-device", action="store_true"),
    flag(
        "--data-parallel-sharding-strategy",
        type=str,
        default="no_shard",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
        help="Megatron FSDP (no_shard|optim|optim_grads|optim_grads_params).",
    ),
    flag("--no-gradient-reduce-div-fusion", action="store_false", dest="gradient_reduce_div_fusion"),
    flag("--fsdp-double-buffer", action="store_true"),
    flag("--suggested-communication-unit-size", type=int),
    flag("--keep-fp8-transpose-cache-when-using-custom-fsdp", action="store_true"),
    flag("--num-distributed-optimizer-instances", type=int, default=1,
         help="Copies of the distributed optimizer across the data-parallel domain (partial sharding)."),
    flag("--use-torch-fsdp2", action="store_true", help="PyTorch FSDP2."),
    flag("--torch-fsdp2-no-reshard-after-forward", action="store_false", dest="torch_fsdp2_reshard_after_forward"),
    flag("--context-parallel-size", type=int, default=1, help="Degree of context parallelism (sequence split across ranks)."),
    flag(
        "--cp-comm-type",
        type=str,
        nargs="+",
        default=["p2p"],
        help="p2p|all_gather|a2a|a2a+p2p: one for all layers or one per layer (indexed by the 1-based layer number).",
    ),
    flag("--hierarchical-context-parallel-sizes", type=int, nargs="+", help="For a2a+p2p."),
    flag("--nccl-communicator-config-path", type=str),
    flag("--use-tp-pp-dp-mapping", action="store_true", help="Order tp-cp-ep-pp-dp."),
    flag("--replication", action="store_true"),
    flag("--replication-jump", type=int),
    flag("--replication-factor", type=int, default=2),
)


def _add_distributed_args(parser):
    """Register the "distributed" group."""
    return add_group(parser, "distributed", DISTRIBUTED_FLAGS, flag_help)
