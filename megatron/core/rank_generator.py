"""Pure rank-layout math for `parallel_state`: which global ranks form each process group.

Nothing here touches `torch.distributed`, so layouts of any size are unit-tested without processes.

Layout note: the parallel dimensions are laid out like the axes of a C-ordered array read backwards,
i.e. the FIRST token of `order` varies fastest. With the default `tp-cp-ep-dp-pp`:
`global_rank = tp + cp*TP + dp*TP*CP + pp*TP*CP*DP` (EP is 1 in the dense layout).

Orders (Megatron's rules): any '-'-joined arrangement of tp, cp, ep, dp, pp is accepted; a dimension
of size 1 may be left out (it is appended), one of size > 1 may not. The dense generator has ep = 1 and
the expert generator cp = 1, both read the same order, and `initialize_model_parallel` requires their
pipeline groups to coincide (with an order that does not end in pp, also the same DP size).
"""
import functools
import operator
from typing import Dict, List, Sequence

_DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")


def _prefix_products(sizes: Sequence[int]) -> List[int]:
    """[1, s0, s0*s1, ...] of length len(sizes) + 1."""
    products = [1]
    for size in sizes:
        products.append(products[-1] * size)
    return products


def _decompose(index: int, shape: Sequence[int]) -> List[int]:
    """Mixed-radix digits of `index` for `shape`, first axis fastest."""
    digits = []
    for size in shape:
        digits.append(index % size)
        index //= size
    return digits


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> List[List[int]]:
    """Groups of global ranks that vary only along the masked dimensions.

    `parallel_size` lists the size of every dimension (first = fastest varying, product = world_size);
    `mask[i]` says whether dimension i varies inside one group. The result lists every group, each
    group's ranks in increasing masked-index order, groups in increasing unmasked-index order.
    Example: sizes [tp=2, dp=2, pp=2], mask [True, False, False] gives the TP groups
    [[0, 1], [2, 3], [4, 5], [6, 7]]; mask [False, True, False] gives DP groups [[0, 2], [1, 3], [4, 6], [5, 7]].
    """
    if len(parallel_size) != len(mask):
        raise ValueError(f"parallel_size {list(parallel_size)} and mask {list(mask)} must have the same length")
    strides = _prefix_products(parallel_size)[:-1]
    if _prefix_products(parallel_size)[-1] != world_size:
        raise ValueError(f"product of parallel sizes {list(parallel_size)} must equal world_size {world_size}")
    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    masked_strides = [st for st, m in zip(strides, mask) if m]
    unmasked_strides = [st for st, m in zip(strides, mask) if not m]
    group_size = _prefix_products(masked_shape)[-1]
    groups = []
    for group_index in range(world_size // group_size):
        base = sum(d * st for d, st in zip(_decompose(group_index, unmasked_shape), unmasked_strides))
        groups.append(
            [
                base + sum(d * st for d, st in zip(_decompose(i, masked_shape), masked_strides))
                for i in range(group_size)
            ]
        )
    return groups


class RankGenerator:
    """Rank groups of a `tp x cp x ep x dp x pp` layout in a given order, offset by `rank_offset`.

    `get_ranks('tp-pp')` returns every group whose members differ only in their TP and PP index.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0) -> None:
        if ep != 1 and cp != 1:
            raise ValueError(
                f"RankGenerator: expert parallel size ({ep}) and context parallel size ({cp}) cannot both be > 1 "
                "in one generator: use a separate expert generator with cp=1."
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * dp * pp * cp * ep
        self.name_to_size: Dict[str, int] = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        self.order = self._complete_order(order.lower())
        self.ordered_size = [self.name_to_size[token] for token in self.order.split("-")]

    def _complete_order(self, order: str) -> str:
        tokens = order.split("-")
        unknown = [t for t in tokens if t not in self.name_to_size]
        if unknown or len(set(tokens)) != len(tokens):
            raise ValueError(
                f"order {order!r} must be '-'-separated distinct names from {list(_DIMENSIONS)} (bad: {unknown})"
            )
        for name, size in self.name_to_size.items():
            if name not in tokens:
                if size != 1:
                    raise ValueError(
                        f"order {order!r} lacks {name!r} whose size is {size}: list every dimension of size > 1"
                    )
                tokens.append(name)
        return "-".join(tokens)

    def get_mask(self, order: str, token: str) -> List[bool]:
        """Which dimensions of `order` are named in `token` (e.g. 'tp-dp')."""
        wanted = token.split("-")
        ordered = order.split("-")
        unknown = [t for t in wanted if t not in ordered]
        if unknown:
            raise ValueError(f"token {token!r} names {unknown}, which are not in order {order!r}")
        return [name in wanted for name in ordered]

    def get_ranks(self, token: str) -> List[List[int]]:
        """Every group of global ranks varying along the dimensions in `token` (order of tokens irrelevant)."""
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        if self.rank_offset:
            groups = [[rank + self.rank_offset for rank in group] for group in groups]
        return groups

    def coordinates(self, rank: int) -> Dict[str, int]:
        """Index of global `rank` along every dimension (e.g. {'tp': 1, 'cp': 0, 'ep': 0, 'dp': 1, 'pp': 0})."""
        local = rank - self.rank_offset
        if not 0 <= local < self.world_size:
            raise ValueError(f"rank {rank} is outside this layout [{self.rank_offset}, {self.rank_offset + self.world_size})")
        digits = _decompose(local, self.ordered_size)
        return dict(zip(self.order.split("-"), digits))


def check_parallel_sizes(world_size, tp, pp, cp, ep, etp, num_instances, encoder_tp, encoder_pp, order) -> int:
    """Validate an `initialize_model_parallel` layout (every problem in one ValueError); return the DP size."""
    errors = []
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                        ("context_parallel_size", cp), ("expert_model_parallel_size", ep),
                        ("expert_tensor_parallel_size", etp), ("num_distributed_optimizer_instances", num_instances)):
        if value < 1:
            errors.append(f"{name} ({value}) must be >= 1")
    if encoder_tp or encoder_pp:
        errors.append(
            f"encoder_tensor_model_parallel_size ({encoder_tp}) / encoder_pipeline_model_parallel_size "
            f"({encoder_pp}): a separate encoder pipeline is not supported; leave both at 0"
        )
    errors.extend(_order_problems(order))
    if not errors and world_size % (tp * pp * cp) != 0:
        errors.append(
            f"world size ({world_size}) must be divisible by tensor ({tp}) x pipeline ({pp}) x context ({cp}) "
            "parallel sizes: change the sizes or the number of processes"
        )
    dp = world_size // (tp * pp * cp) if not errors else 1
    if not errors and world_size % (etp * ep * pp) != 0:
        errors.append(
            f"world size ({world_size}) must be divisible by expert tensor ({etp}) x expert ({ep}) x pipeline ({pp}) "
            "parallel sizes"
        )
    if not errors and (dp * cp) % num_instances != 0:
        errors.append(
            f"data x context parallel size ({dp * cp}) must be divisible by num_distributed_optimizer_instances "
            f"({num_instances})"
        )
    if not errors and (world_size // (etp * ep * pp)) % num_instances != 0:
        errors.append(
            f"expert data parallel size ({world_size // (etp * ep * pp)}) must be divisible by "
            f"num_distributed_optimizer_instances ({num_instances})"
        )
    if errors:
        raise ValueError("initialize_model_parallel: invalid parallel layout:\n  - " + "\n  - ".join(errors))
    return dp


def _order_problems(order: str) -> List[str]:
    """Spelling problems of an order string (sizes are checked when the generators are built)."""
    if not isinstance(order, str) or not order:
        return [f"order ({order!r}) must be a non-empty '-'-joined list of {list(_DIMENSIONS)}"]
    tokens = order.lower().split("-")
    unknown = [t for t in tokens if t not in _DIMENSIONS]
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if unknown or repeated:
        return [f"order {order!r} must name each of {list(_DIMENSIONS)} at most once (unknown: {unknown}, "
                f"repeated: {repeated})"]
    return []


def build_rank_generators(world_size: int, tp: int, pp: int, cp: int, ep: int, etp: int, order: str):
    """The dense (ep = 1) and expert (cp = 1) generators of a layout, checked the way Megatron checks them.

    Raises ValueError when the order leaves out a dimension of size > 1, when an order not ending in pp
    would give the expert layout another DP size, or when the two layouts' pipeline groups differ.
    """
    dp = world_size // (tp * pp * cp)
    expert_dp = world_size // (etp * ep * pp)
    errors = []
    generators = []
    for kind, sizes in (("dense", dict(tp=tp, ep=1, dp=dp, pp=pp, cp=cp)),
                        ("expert", dict(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1))):
        try:
            generators.append(RankGenerator(order=order, **sizes))
        except ValueError as err:
            errors.append(f"{kind} layout: {err}")
    if not errors and not (order.lower().endswith("pp") or pp == 1 or expert_dp == dp):
        errors.append(
            f"order {order!r} does not end in 'pp': the expert data-parallel size ({expert_dp}) must then equal "
            f"the data-parallel size ({dp}); change the expert sizes or use an order ending in pp"
        )
    if not errors and generators[0].get_ranks("pp") != generators[1].get_ranks("pp"):
        errors.append(
            f"order {order!r}: the expert layout's pipeline groups must equal the dense layout's; "
            "choose expert sizes that keep pipeline groups aligned"
        )
    if errors:
        raise ValueError("initialize_model_parallel: invalid parallel layout:\n  - " + "\n  - ".join(errors))
    return generators[0], generators[1]


def intra_distributed_optimizer_instance_rank_lists(expert_gen: "RankGenerator", num_instances: int):
    """Ranks of every distributed-optimizer instance, as Megatron builds them: the expert layout's
    tensor x expert x pipeline groups taken in order and concatenated, expert-DP / instances at a time
    (so the member order is group by group, not sorted)."""
    groups = expert_gen.get_ranks("tp-ep-pp")
    per_instance = expert_gen.dp // num_instances
    return [
        [rank for group in groups[i:i + per_instance] for rank in group]
        for i in range(0, len(groups), per_instance)
    ]


def partial_data_parallel_rank_lists(rank_lists: List[List[int]], num_instances: int):
    """Intra-instance (contiguous chunks) and inter-instance (strided) sub-lists of each DP rank list."""
    intra, inter = [], []
    for ranks in rank_lists:
        size = len(ranks) // num_instances
        intra.extend(ranks[i * size:(i + 1) * size] for i in range(num_instances))
        inter.extend(ranks[i::size] for i in range(size))
    return intra, inter


def hierarchical_context_parallel_rank_lists(cp_ranks: List[List[int]], sizes: List[int]) -> List[List[List[int]]]:
    """For each level, the sub-groups of every CP group that vary only along that level's index."""
    levels = []
    cp_size = functools.reduce(operator.mul, sizes, 1)
    for level in range(len(sizes)):
        mask = [i == level for i in range(len(sizes))]
        local = generate_masked_orthogonal_rank_groups(cp_size, sizes, mask)
        levels.append([[ranks[i] for i in sub] for ranks in cp_ranks for sub in local])
    return levels
