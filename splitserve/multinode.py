"""Jobs that span several machines (``split.num_nodes`` > 1), and the launch plan a dry run prints.

Every node runs ``draftforge train RECIPE --node-rank N --master-addr NODE0``,
which starts torchrun's *static* rendezvous (``--nnodes --node_rank
--master_addr --master_port``): node ``n`` holds exactly ranks ``n*P ..
n*P+P-1`` (``P = world_size / num_nodes``), so a group pinned to node 0 in the
split is on node 0. (A dynamic c10d rendezvous hands out ranks in join order
and would scatter the groups.) One-machine jobs never come here: draftforge
starts their ranks itself with a loopback-only store (``supervisor``).
"""

from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torchrun's own default
NODE0_PLACEHOLDER = "NODE0_ADDR"  # what a dry run prints until --master-addr is given
# what a multi-node rendezvous waits for the other nodes beyond split.peer_timeout_s: after a
# failure a node may notice a silent peer only after peer_timeout_s, then its torchrun's grace
# (up to 45 s) stops its ranks before its launcher restarts; and nodes started by hand, one
# terminal after the other, come up tens of seconds apart
RENDEZVOUS_MARGIN_S = 60


def rank_command(recipe: str, overrides: Sequence[str]) -> list[str]:
    """What every rank of a one-machine job runs (``draftforge train`` starts one per rank)."""
    return [sys.executable, "-m", "draftforge.train", recipe, *overrides]


def torchrun_command(recipe: str, overrides: Sequence[str], nproc: int,
                     master_addr: str = LOOPBACK) -> list[str]:
    """The torchrun command line that starts the same one-machine job by hand.

    ``--local-addr`` is the address the ranks are told to reach rank 0 at
    (``MASTER_ADDR``): loopback unless ``--master-addr`` opens it deliberately.
    """
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", f"--local-addr={master_addr}",
        "-m", "draftforge.train", recipe, *overrides,
    ]


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks each machine runs: node ``n`` holds ranks ``n*P .. n*P+P-1``."""

    num_nodes: int
    nproc_per_node: int

    def ranks(self, node: int) -> range:
        return range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node)


def node_problems(split) -> list[tuple[tuple[str, ...], str]]:
    """What keeps ``split`` from being laid out over its nodes, as (key path, problem) pairs;
    the recipe loader reports them at the keys' lines."""
    nodes = split.num_nodes
    problems = []
    if split.world_size % nodes:
        problems.append((("split", "num_nodes"), (
            f"{nodes} nodes cannot share world_size {split.world_size} ranks evenly (every node "
            "runs the same number of processes); make world_size a multiple of num_nodes")))
    if nodes > 1:
        for key in ("target_devices", "trainer_devices"):
            if getattr(split, key) is not None:
                problems.append((("split", key), (
                    f"with split.num_nodes {nodes} every rank uses its node-local GPU LOCAL_RANK "
                    f"(rank - node * ranks per node); remove split.{key}, which names the GPUs "
                    "of one machine")))
    return problems


def node_layout(cfg) -> NodeLayout:
    """The split's :class:`NodeLayout` (a loaded recipe's split always has one: the loader
    refuses what :func:`node_problems` finds)."""
    split = cfg.split
    return NodeLayout(num_nodes=split.num_nodes, nproc_per_node=split.world_size // split.num_nodes)


def rendezvous_timeout_s(split) -> int:
    """How long each node's torchrun waits for the others at node 0's rendezvous before it
    fails: ``split.peer_timeout_s`` (how long a rank waits for a silent peer, so also how
    long a node may take to notice a failure) plus :data:`RENDEZVOUS_MARGIN_S` (its ranks'
    stop and restart). torch's own default, 900 s, would apply to every attempt."""
    return math.ceil(split.peer_timeout_s) + RENDEZVOUS_MARGIN_S


def multinode_torchrun_command(recipe: str, overrides: Sequence[str], layout: NodeLayout, *,
                               node_rank: int, master_addr: str,
                               master_port: int = DEFAULT_MASTER_PORT,
                               rendezvous_timeout: int | None = None) -> list[str]:
    """The torchrun command of node ``node_rank`` (static rendezvous at ``master_addr:master_port``);
    with ``rendezvous_timeout`` (seconds) its store waits that long for the other nodes
    (``--rdzv-conf=timeout=``: the static rendezvous's TCPStore timeout) instead of torch's 900 s."""
    timeout = [] if rendezvous_timeout is None else [f"--rdzv-conf=timeout={int(rendezvous_timeout)}"]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={layout.num_nodes}",
        f"--nproc_per_node={layout.nproc_per_node}", f"--node_rank={node_rank}",
        f"--master_addr={master_addr}", f"--master_port={master_port}", *timeout,
        "-m", "draftforge.train", recipe, *overrides,
    ]


def rendezvous_wait_line(layout: NodeLayout, node_rank: int, master_addr: str, master_port: int,
                         timeout: int) -> str:
    """What a node says before its torchrun waits at the rendezvous (silent until it is met)."""
    others = layout.num_nodes - 1
    nodes = f"the other {others} node{'s' if others != 1 else ''}"
    where = "this node's rendezvous" if node_rank == 0 else "node 0's rendezvous"
    return (f"draftforge train: node {node_rank}: waiting up to {timeout} s for {nodes} at "
            f"{master_addr}:{master_port} ({where}; split.peer_timeout_s + "
            f"{RENDEZVOUS_MARGIN_S} s)")


def rendezvous_failure(layout: NodeLayout, node_rank: int, master_addr: str, master_port: int,
                       timeout: int) -> str:
    """What a node says when its torchrun ended, after waiting ``timeout`` s, before any of its
    ranks started: the rendezvous at ``master_addr:master_port`` was not met, and what to check."""
    if node_rank == 0:
        where = (f"the other nodes did not all connect to this node's rendezvous at "
                 f"{master_addr}:{master_port}")
        check = (f"check that every other node was started with the same recipe, --master-addr "
                 f"{master_addr} and --master-port {master_port} and its own --node-rank, that "
                 f"{master_addr} is this machine's address on the cluster network and that no "
                 f"firewall blocks TCP port {master_port} to it (from another node: "
                 f"`nc -zv {master_addr} {master_port}` while this one waits)")
    else:
        where = f"node 0's rendezvous at {master_addr}:{master_port} was not met"
        check = (f"check that node 0 is running the same recipe with --node-rank 0 and "
                 f"--master-port {master_port}, that {master_addr} is node 0's address on the "
                 f"cluster network, reachable from this node (`nc -zv {master_addr} "
                 f"{master_port}` from here while node 0 waits), with TCP port {master_port} not "
                 "firewalled, and that every other node was started")
    return (f"draftforge train: node {node_rank}: {where} after {timeout} s; {check}. The nodes must start "
            f"within {timeout} s of each other (split.peer_timeout_s + "
            f"{RENDEZVOUS_MARGIN_S} s).")


def shown(command: Sequence[str]) -> str:
    """A command line as a user types it (``torchrun`` for ``python -m torch.distributed.run``)."""
    words = list(command)
    if words[1:3] == ["-m", "torch.distributed.run"]:
        words = ["torchrun", *words[3:]]
    return shlex.join(words)


def _span(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def launch_plan(cfg, recipe: str, overrides: Sequence[str], *, master_addr: str | None,
                master_port: int = DEFAULT_MASTER_PORT, max_restarts: int | None = None) -> str:
    """The dry run's last section: which ranks run on which node, and the command each node
    runs (with ``--max-restarts`` when the dry run was given it, as every node needs it)."""
    layout = node_layout(cfg)
    split = cfg.split
    lines = ["launch:"]
    if layout.num_nodes == 1:
        host = master_addr or LOOPBACK
        where = "loopback only" if is_loopback(host) else f"opened on {host} by --master-addr"
        lines.append(
            f"  one node, {split.world_size} processes (ranks 0-{split.world_size - 1}), each "
            f"running: {shown(rank_command(recipe, overrides))}"
        )
        lines.append(f"  rendezvous store hosted by draftforge train on {host} ({where})")
        lines += filter(None, [_one_node_gpus(cfg)])
        by_hand = torchrun_command(recipe, overrides, split.world_size, master_addr=host)
        lines.append(f"  the same job by hand: {shown(by_hand)} (its store listens on every interface)")
        return "\n".join(lines)
    unusable = master_addr is None or is_loopback(master_addr) or is_unspecified(master_addr)
    addr = NODE0_PLACEHOLDER if unusable else master_addr
    from draftforge.splitserve.roles import comm_backend

    gpu = "GPUs" if comm_backend(cfg, gpus_visible=True) == "nccl" else "processes"
    timeout = rendezvous_timeout_s(split)
    lines.append(
        f"  {layout.num_nodes} nodes x {layout.nproc_per_node} processes; torchrun static "
        f"rendezvous at {addr}:{master_port} (node 0)"
    )
    for node in range(layout.num_nodes):
        ranks = layout.ranks(node)
        target = [r for r in ranks if r in split.target_ranks]
        trainer = [r for r in ranks if r in split.trainer_ranks]
        local = (f"local {'GPU' if gpu == 'GPUs' else 'process'} 0 (LOCAL_RANK)" if layout.nproc_per_node == 1
                 else f"local {gpu} 0-{layout.nproc_per_node - 1} (LOCAL_RANK)")
        lines.append(
            f"  node {node}: ranks {_span(ranks)}: target ranks {_span(target)}, trainer ranks "
            f"{_span(trainer)}; {local}"
        )
    for node in range(layout.num_nodes):
        user = ["draftforge", "train", recipe, *overrides, "--node-rank", str(node),
                "--master-addr", addr]
        if master_port != DEFAULT_MASTER_PORT:
            user += ["--master-port", str(master_port)]
        if max_restarts is not None:
            user += ["--max-restarts", str(max_restarts)]
        command = multinode_torchrun_command(recipe, overrides, layout, node_rank=node,
                                             master_addr=addr, master_port=master_port,
                                             rendezvous_timeout=timeout)
        lines.append(f"  on node {node}: {shlex.join(user)}")
        lines.append(f"    which runs: {shown(command)}")
    lines.append(
        f"  rendezvous timeout: every node waits up to {timeout} s for the others "
        f"(--rdzv-conf=timeout={timeout}: split.peer_timeout_s + {RENDEZVOUS_MARGIN_S} s), "
        "then fails; start the nodes within that of each other"
    )
    if addr == NODE0_PLACEHOLDER:
        lines.append(
            f"  {NODE0_PLACEHOLDER}: node 0's address on the cluster network, given with "
            "--master-addr (nothing is opened by default)"
        )
    lines.append(
        f"  note: node 0's rendezvous store (torch's TCPStore) listens on every interface at port "
        f"{master_port}; firewall it to the cluster network. Set GLOO_SOCKET_IFNAME (and "
        "NCCL_SOCKET_IFNAME) to that network's interface on every node."
    )
    return "\n".join(lines)


MOST_GPUS_PER_NODE = 8  # an HGX/DGX node; a split needing more on one node is named as such


def _one_node_gpus(cfg) -> str:
    """The GPUs a one-node plan needs (what ``planned_gpus`` assumes the machine has), so
    that a split of more ranks than a node has GPUs is seen before the node is rented:
    the dry run plans for the machine the recipe names and cannot refuse it."""
    from draftforge.splitserve.launch import planned_gpus
    from draftforge.splitserve.roles import comm_backend

    gpus = planned_gpus(cfg)
    if gpus == 0:
        return ""
    split = cfg.split
    line = f"  GPUs: this machine needs {gpus} ({'GPU 0' if gpus == 1 else f'GPUs 0-{gpus - 1}'})"
    if split.comm_backend == "auto" and cfg.train.device == "auto":
        line += " where GPUs are visible (comm_backend auto); without GPUs every rank runs on the CPU"
    elif comm_backend(cfg, gpus_visible=True) != "nccl":
        line += " for its trainer ranks (gloo: the target ranks run on the CPU)"
        if cfg.train.device == "auto":
            line += "; where no GPU is visible the trainers run on the CPU too (train.device auto)"
    if gpus > MOST_GPUS_PER_NODE:
        line += (f"; more than the {MOST_GPUS_PER_NODE} of most GPU nodes: on {MOST_GPUS_PER_NODE}-GPU "
                 "nodes spread the ranks with split.num_nodes (each node then runs "
                 "split.world_size / split.num_nodes of them), or use fewer ranks")
    return line


# names that mean this machine wherever they resolve (RFC 6761 reserves *.localhost too)
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "localhost6", "localhost6.localdomain6",
                  "ip6-localhost", "ip6-loopback")


def _ip_address(address: str):
    """``address`` as the IP address a socket would take it for, or None for a host name.

    Normalised as the resolver reads it: IPv4 shorthand (``127.1``, ``0``, ``0x7f.1``: what
    ``inet_aton`` and so getaddrinfo accept) in full, and an IPv4-mapped IPv6 address
    (``::ffff:127.0.0.1``) as the IPv4 address it maps; an IPv6 address's brackets dropped."""
    import ipaddress
    import socket

    text = address.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        if not text or any(ch.isspace() for ch in text):  # inet_aton ignores what follows a space
            return None
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None  # a host name: resolved by torchrun on each node
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback(address: str) -> bool:
    """Whether ``address`` is this machine only (``localhost``, 127.0.0.0/8 in any spelling,
    ``127.1`` and ``::ffff:127.0.0.1`` included, ``::1``)."""
    name = address.strip().lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    ip = _ip_address(address)
    return ip is not None and ip.is_loopback


def is_unspecified(address: str) -> bool:
    """Whether ``address`` is the wildcard (``0.0.0.0``, ``0``, ``::``, ``::ffff:0.0.0.0``): a
    bind address, not one to reach."""
    ip = _ip_address(address)
    return ip is not None and ip.is_unspecified


def check_master_port(port: int) -> None:
    """Refuse node 0's rendezvous port when it cannot listen there (another job or a torchrun
    left running holds it): torchrun would end in a traceback, and each restart the same way.
    Raises :class:`~draftforge.errors.InputError` naming the port."""
    import errno
    import socket

    from draftforge.errors import InputError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store: TIME_WAIT is free
        try:
            probe.bind(("", port))  # every interface, as torch's TCPStore listens
        except OSError as exc:
            held = (" another process listens on it (another job, or a torchrun left running: "
                    f"`ss -ltnp 'sport = :{port}'` names it);" if exc.errno == errno.EADDRINUSE else "")
            raise InputError(
                f"--master-port {port}: node 0's rendezvous cannot listen on this port "
                f"({exc.strerror or exc});{held} pass a free port with --master-port, the same on "
                "every node") from None


def node_rank_problem(layout: NodeLayout, node_rank: int | None, *, needed: bool) -> str | None:
    """What is wrong with ``--node-rank`` for ``layout``, or None: on one node any rank but 0;
    on several a rank out of range, or none where ``needed`` (a start; a dry run plans every
    node). The start and the dry run give the same advice."""
    if layout.num_nodes == 1:
        if node_rank in (None, 0):
            return None
        return (f"--node-rank {node_rank}: the recipe runs on one node (split.num_nodes 1); drop "
                "--node-rank or set split.num_nodes")
    if node_rank is None and not needed or node_rank is not None and 0 <= node_rank < layout.num_nodes:
        return None
    return (
        f"--node-rank: split.num_nodes is {layout.num_nodes}; give this machine's node rank "
        f"(0..{layout.num_nodes - 1}; node n runs the {layout.nproc_per_node} ranks from "
        f"n*{layout.nproc_per_node})"
        + ("" if node_rank is None else f", got {node_rank}")
    )


def check_node_args(cfg, *, node_rank: int | None, master_addr: str) -> NodeLayout:
    """The layout, after refusing a multi-node start without a node rank or a reachable node 0
    (:class:`InputError`, every problem on a line: the options do not fit the recipe's split)."""
    from draftforge.errors import InputError

    layout = node_layout(cfg)
    problem = node_rank_problem(layout, node_rank, needed=True)
    if layout.num_nodes == 1:
        if problem is not None:
            raise InputError(problem)
        return layout
    problems = ([] if problem is None else [problem]) + master_addr_problems(layout, master_addr)
    if problems:
        raise InputError("\n".join(problems))
    return layout


def master_addr_problems(layout: NodeLayout, master_addr: str) -> list[str]:
    """Why ``--master-addr`` cannot be node 0's address for the other nodes of a multi-node
    layout (the wildcard, a loopback address); nothing on one node."""
    if layout.num_nodes == 1:
        return []
    if is_unspecified(master_addr):
        return [f"--master-addr: {master_addr} is the wildcard address, which other nodes cannot "
                "reach; pass node 0's address on the cluster network (the same on every node)"]
    if is_loopback(master_addr):
        return [f"--master-addr: split.num_nodes is {layout.num_nodes}, so the other nodes must reach "
                f"node 0's rendezvous, which {master_addr} (loopback) cannot offer; pass node 0's "
                "address on the cluster network (the same on every node)"]
    return []
