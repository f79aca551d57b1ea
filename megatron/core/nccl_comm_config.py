"""NCCL communicator settings per process group (`--nccl-communicator-config-path`), as Megatron Core reads them.

The file is YAML: a mapping from Megatron's process-group names (`dp`, `dp_cp`, `tp`, `pp`, `mp`, `cp`, `ep`,
`ep_tp`, `ep_dp`, `tp_dp`, ...) to settings among `is_high_priority_stream`, `cga_cluster_size`, `max_ctas`,
`min_ctas` and `net_name` (`IB` or `socket`). A setting left out keeps NCCL's default; a group left out gets
no options. `parallel_state.initialize_model_parallel` reads the file on every backend (so a bad file fails the
same way on CPU), and hands the options only to groups that use NCCL: gloo groups take none.
"""
from typing import Any, Dict, Iterable, Optional

import torch

_NET_NAMES = ("ib", "socket")

# parallel_state's group names -> the names Megatron's config file uses for them.
MEGATRON_GROUP_NAMES = {
    "dp": "dp", "dp_cp": "dp_cp", "intra_partial_dp_cp": "intra_dp_cp", "cp": "cp", "mp": "mp", "tp": "tp",
    "pp": "pp", "embd": "embd", "pos_embd": "pos_embd", "tp_dp_cp": "tp_dp_cp", "tp_dp": "tp_dp", "tp_cp": "tp_cp",
    "ep": "ep", "expt_tp": "ep_tp", "tp_ep": "tp_ep_mp", "tp_ep_pp": "tp_ep_pp", "expt_dp": "ep_dp",
    "intra_partial_expt_dp": "intra_ep_dp", "inter_partial_expt_dp": "inter_ep_dp",
    "intra_dist_opt": "intra_dist_opt_instance",
}
"""Group names without an entry (hierarchical CP levels are `hcp`) get no options."""


def megatron_group_name(name: str) -> Optional[str]:
    """The config-file name of the parallel_state group `name` (`hcp_0`, `hcp_1`, ... are all `hcp`)."""
    if name.startswith("hcp_"):
        return "hcp"
    return MEGATRON_GROUP_NAMES.get(name)


def _check_net_name(pg_name: str, settings: Dict[str, Any]) -> None:
    net_name = settings.get("net_name")
    if net_name is not None and str(net_name).lower() not in _NET_NAMES:
        raise RuntimeError(f"net_name ({net_name}) of process group {pg_name!r} is not supported. "
                           f"Accepted values: 'IB' or 'socket'.")


def load_nccl_comm_cfgs(path: Optional[str]) -> Dict[str, Dict[str, Any]]:
    """The settings in the YAML file `path` (`{}` for None), checked: a mapping of group names to mappings,
    `net_name` IB or socket. Needs PyYAML, as Megatron does."""
    if path is None:
        return {}
    try:
        import yaml
    except ImportError as error:
        raise RuntimeError("--nccl-communicator-config-path needs the yaml package (pip install pyyaml).") from error
    with open(path, "r") as stream:
        cfgs = yaml.safe_load(stream)
    if not isinstance(cfgs, dict) or not all(isinstance(v, dict) for v in cfgs.values()):
        raise ValueError(f"--nccl-communicator-config-path ({path}) must hold a mapping from process-group names "
                         f"to mappings of NCCL settings (e.g. 'tp: {{max_ctas: 8}}'), got {cfgs!r}.")
    for pg_name, settings in cfgs.items():
        _check_net_name(pg_name, settings)
    return cfgs


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs: Dict[str, Dict[str, Any]], pg_name: str, key_value_pair) -> None:
    """Set one setting (`(key, value)`) of group `pg_name`, creating its entry."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value


def mark_high_priority_stream_groups(nccl_comm_cfgs: Dict[str, Dict[str, Any]],
                                     groups: Optional[Iterable[str]]) -> None:
    """`high_priority_stream_groups` of `initialize_model_parallel`: those groups get high-priority streams."""
    for pg_name in groups or ():
        overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, ("is_high_priority_stream", True))


def get_nccl_options(pg_name: str, nccl_comm_cfgs: Dict[str, Dict[str, Any]]):
    """`ProcessGroupNCCL.Options` for group `pg_name` from `nccl_comm_cfgs`, or None when the group has no entry
    (NCCL's defaults then apply) or this torch has no NCCL (the settings were still checked).

    RuntimeError for a `net_name` other than IB or socket (Megatron's error).
    """
    if pg_name not in nccl_comm_cfgs:
        return None
    settings = nccl_comm_cfgs[pg_name]
    _check_net_name(pg_name, settings)
    if not torch.distributed.is_nccl_available():
        return None
    options = torch.distributed.ProcessGroupNCCL.Options(
        is_high_priority_stream=settings.get("is_high_priority_stream", False))
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in settings:
            setattr(options.config, key, settings[key])
    return options


__all__ = ["load_nccl_comm_cfgs", "get_nccl_options", "overwrite_nccl_comm_cfgs", "mark_high_priority_stream_groups",
           "megatron_group_name", "MEGATRON_GROUP_NAMES"]
