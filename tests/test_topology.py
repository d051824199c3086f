"""Launcher detection, SLURM parsing and host-name-derived world layout (shoal.core.topology)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from shoal.core import config, topology
from shoal.core.errors import TopologyError
from shoal.core.topology import (
    LaunchInfo,
    World,
    check_consistent,
    detect,
    expand_hostlist,
    parse_tasks_per_node,
)

NO_SAGEMAKER = Path("/nonexistent/shoal-tests/resourceconfig.json")


def run(env: dict[str, str], **kwargs: object) -> LaunchInfo:
    """detect() on a dict environment, never looking at a real SageMaker config."""
    kwargs.setdefault("sagemaker_config", NO_SAGEMAKER)
    return detect(env, **kwargs)  # type: ignore[arg-type]


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "run42"}
OMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "m0", "MASTER_PORT": "5000"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "SHOAL_RENDEZVOUS_ADDR": "p0"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_NNODES": "4", "SLURM_TASKS_PER_NODE": "2(x3),1",
         "SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_JOB_ID": "12345", "SLURM_STEP_ID": "0"}
SHOALRUN = {"SHOAL_RANK": "1", "SHOAL_SIZE": "4", "SHOAL_LOCAL_RANK": "1", "SHOAL_LOCAL_SIZE": "2",
            "SHOAL_CROSS_RANK": "0", "SHOAL_CROSS_SIZE": "2", "SHOAL_RENDEZVOUS_ADDR": "s0",
            "SHOAL_RENDEZVOUS_PORT": "7000", "SHOAL_JOB_ID": "job-7", "SHOAL_SECRET": "ab12"}
SAGEMAKER = {"SM_HOSTS": '["algo-2", "algo-1", "algo-3"]', "SM_CURRENT_HOST": "algo-2"}

LAUNCHERS = [
    pytest.param({}, {"rank": 1, "size": 4, "local_rank": 1, "local_size": 2,
                      "rendezvous_addr": "e0", "rendezvous_port": 1234},
                 dict(launcher="explicit", rank=1, size=4, local_rank=1, local_size=2,
                      cross_rank=None, rendezvous_addr="e0", rendezvous_port=1234,
                      job_id="e0-1234"), id="explicit"),
    pytest.param(SHOALRUN, {},
                 dict(launcher="shoalrun", rank=1, size=4, local_rank=1, local_size=2,
                      cross_rank=0, cross_size=2, rendezvous_addr="s0", rendezvous_port=7000,
                      job_id="job-7", secret="ab12", secret_is_derived=False), id="shoalrun"),
    pytest.param(TORCHRUN, {},
                 dict(launcher="torchrun", rank=3, size=8, local_rank=1, local_size=2,
                      cross_rank=1, cross_size=4, rendezvous_addr="h0", rendezvous_port=29501,
                      job_id="run42", secret_is_derived=True), id="torchrun"),
    pytest.param({**TORCHRUN, "WORLD_SIZE": "7", "GROUP_WORLD_SIZE": "4"}, {},
                 dict(cross_size=4), id="torchrun-group-world-size"),
    pytest.param({**TORCHRUN, "WORLD_SIZE": "7"}, {}, dict(cross_size=None),
                 id="torchrun-uneven"),
    pytest.param({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "SHOAL_RENDEZVOUS_PORT": "6000"}, {},
                 dict(rendezvous_port=6000, job_id="h0-6000"), id="torchrun-port-override"),
    pytest.param(OMPI, {},
                 dict(launcher="openmpi", rank=2, size=4, local_rank=0, local_size=2,
                      cross_rank=None, cross_size=None, rendezvous_addr="m0",
                      rendezvous_port=5000), id="openmpi"),
    pytest.param({k: v for k, v in OMPI.items() if k != "MASTER_PORT"}, {},
                 dict(rendezvous_port=29400), id="openmpi-default-port"),
    pytest.param(MPICH, {},
                 dict(launcher="mpich", rank=1, size=2, local_rank=None, local_size=None,
                      rendezvous_addr="p0", rendezvous_port=29400), id="mpich"),
    pytest.param({**MPICH, "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, {},
                 dict(local_rank=1, local_size=2), id="mpich-local"),
    pytest.param(SLURM, {},
                 dict(launcher="slurm", rank=5, size=7, local_rank=1, local_size=2,
                      cross_rank=2, cross_size=4, rendezvous_addr="node01",
                      rendezvous_port=29400 + 345, job_id="12345.0"), id="slurm"),
    pytest.param({**SLURM, "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "gpu[7-8]",
                  "MASTER_PORT": "4000"}, {},
                 dict(local_size=2, rendezvous_addr="gpu7", rendezvous_port=4000),
                 id="slurm-step-nodelist"),
    pytest.param({**SLURM, "MASTER_ADDR": "head", "SLURM_JOB_NODELIST": "bad["}, {},
                 dict(rendezvous_addr="head"), id="slurm-master-addr-wins"),
    pytest.param(SAGEMAKER, {},
                 dict(launcher="sagemaker", rank=1, size=3, local_rank=0, local_size=1,
                      cross_rank=1, cross_size=3, rendezvous_addr="algo-1",
                      rendezvous_port=29400), id="sagemaker"),
    pytest.param({}, {},
                 dict(launcher="single", rank=0, size=1, local_rank=0, local_size=1,
                      rendezvous_addr="127.0.0.1", rendezvous_port=0,
                      secret_is_derived=True), id="single"),
    pytest.param({"WORLD_SIZE": "1", "RANK": "0"}, {},
                 dict(launcher="torchrun", rendezvous_addr="127.0.0.1", rendezvous_port=0),
                 id="torchrun-size-1"),
]


@pytest.mark.parametrize(("env", "kwargs", "expected"), LAUNCHERS)
def test_launchers(env: dict[str, str], kwargs: dict[str, object],
                   expected: dict[str, object]) -> None:
    info = run(env, **kwargs)
    assert {k: getattr(info, k) for k in expected} == expected


def test_sagemaker_resource_config(tmp_path: Path) -> None:
    path = tmp_path / "resourceconfig.json"
    path.write_text(json.dumps({"current_host": "algo-1", "hosts": ["algo-2", "algo-1"]}))
    info = run({}, sagemaker_config=path)
    assert (info.launcher, info.rank, info.size, info.rendezvous_addr) == (
        "sagemaker", 0, 2, "algo-1")
    assert run(OMPI, sagemaker_config=path).launcher == "openmpi"  # SageMaker's MPI mode
    path.write_text('{"current_host": "algo-9", "hosts": ["algo-1"]}')
    with pytest.raises(TopologyError, match=r"'current_host' in .*algo-9"):
        run({}, sagemaker_config=str(path))
    path.write_text("{not json")
    with pytest.raises(TopologyError, match="resource config"):
        run({}, sagemaker_config=path)


@pytest.mark.parametrize(("text", "hosts"), [
    ("node[01-03,07],gpu5,rack[1-2]-n[3-4]",
     ["node01", "node02", "node03", "node07", "gpu5", "rack1-n3", "rack1-n4", "rack2-n3",
      "rack2-n4"]),
    ("single", ["single"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("a[1],b[2-3]x", ["a1", "b2x", "b3x"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[01-03", "node]1", "a,,b", "n[3-1]", "n[a-b]",
                                  "n[[1-2]]", "n[]"])
def test_expand_hostlist_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


@pytest.mark.parametrize(("text", "counts"), [
    ("4", [4]), ("4(x2)", [4, 4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]),
])
def test_parse_tasks_per_node(text: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "x", "0", "2(x0)", "2(3)", "2(x2"])
def test_parse_tasks_per_node_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_tasks_per_node(text)


@pytest.mark.parametrize(("node", "local_size"), [(0, 2), (1, 2), (2, 2), (3, 1)])
def test_slurm_local_size_per_node(node: int, local_size: int) -> None:
    env = {**SLURM, "SLURM_NODEID": str(node), "SLURM_LOCALID": "0"}
    assert run(env).local_size == local_size


ERRORS = [
    ({"RANK": "0"}, {}, "WORLD_SIZE is missing"),
    ({}, {"rank": 0}, "size= argument of shoal.init"),
    ({}, {"size": 2}, "rank= argument of shoal.init"),
    ({}, {"rank": "0", "size": 1}, r"rank='0'"),
    ({"SHOAL_RANK": "0"}, {}, "SHOAL_SIZE is missing"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": ""}, {}, "LOCAL_RANK and LOCAL_WORLD_SIZE"),
    ({**MPICH, "MPI_LOCALNRANKS": "2"}, {}, "MPI_LOCALRANKID and MPI_LOCALNRANKS"),
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "two"}, {}, "OMPI_COMM_WORLD_RANK='two' is not an integer"),
    ({**MPICH, "PMI_RANK": "2"}, {}, "PMI_RANK=2 must be smaller than PMI_SIZE=2"),
    ({**SLURM, "SLURM_PROCID": "-1"}, {}, "SLURM_PROCID=-1 must be >= 0"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, {}, "WORLD_SIZE=0 must be >= 1"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, {}, "LOCAL_RANK=2 must be smaller than LOCAL_WORLD_SIZE"),
    ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, {},
     "OMPI_COMM_WORLD_LOCAL_SIZE=8 must be at most OMPI_COMM_WORLD_SIZE=4"),
    ({**SLURM, "SLURM_NODEID": "4"}, {}, "SLURM_TASKS_PER_NODE=.* no entry for SLURM_NODEID=4"),
    ({**SLURM, "SLURM_NODEID": "2", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "3"}, {},
     "SLURM_NODEID=2 must be smaller than SLURM_NNODES=2"),
    ({**SLURM, "SLURM_TASKS_PER_NODE": "2(3)"}, {}, "SLURM_TASKS_PER_NODE='2\\(3\\)' is malformed"),
    ({**SLURM, "SLURM_JOB_NODELIST": "node[01-"}, {}, "SLURM_JOB_NODELIST='node\\[01-'"),
    ({**SLURM, "SLURM_JOB_ID": "12a"}, {}, "SLURM_JOB_ID='12a' is not an integer"),
    ({**SAGEMAKER, "SM_CURRENT_HOST": "algo-9"}, {}, "SM_CURRENT_HOST='algo-9' is not in SM_HOSTS"),
    ({**SAGEMAKER, "SM_HOSTS": "[algo-1"}, {}, "SM_HOSTS must be a non-empty JSON list"),
    ({**SAGEMAKER, "SM_HOSTS": '["a", "a"]'}, {}, "SM_HOSTS must be .* distinct"),
    ({"SM_HOSTS": '["a"]'}, {}, "SM_HOSTS and SM_CURRENT_HOST must be set together"),
    ({k: v for k, v in OMPI.items() if k != "MASTER_ADDR"}, {}, "-x MASTER_ADDR=<host of rank 0>"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, {}, "-genv MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, {}, "no rendezvous address.*MASTER_ADDR"),
    ({}, {"rank": 0, "size": 2}, "rendezvous_addr="),
    ({**OMPI, "MASTER_PORT": "x"}, {}, "MASTER_PORT='x' is not an integer"),
    ({**OMPI, "MASTER_PORT": "70000"}, {}, "70000 \\(from MASTER_PORT\\) is outside"),
    ({**TORCHRUN, "MASTER_PORT": "65535"}, {}, "from MASTER_PORT\\+1"),
    ({**TORCHRUN, "SHOAL_RENDEZVOUS_PORT": "0"}, {}, "port 0 .* single process"),
]


@pytest.mark.parametrize(("env", "kwargs", "match"), ERRORS)
def test_errors(env: dict[str, str], kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        run(env, **kwargs)


@pytest.mark.parametrize(("env", "kwargs", "launcher"), [
    ({**TORCHRUN, **SHOALRUN}, {"rank": 0, "size": 1}, "explicit"),
    ({**TORCHRUN, **SHOALRUN, **OMPI, **MPICH, **SLURM, **SAGEMAKER}, {}, "shoalrun"),
    ({**TORCHRUN, **OMPI, **MPICH, **SLURM, **SAGEMAKER}, {}, "torchrun"),
    ({**OMPI, **MPICH, **SLURM, **SAGEMAKER}, {}, "openmpi"),
    ({**MPICH, **SLURM, **SAGEMAKER}, {}, "mpich"),
    ({**SLURM, **SAGEMAKER}, {}, "slurm"),
    ({"SHOAL_SIZE": "4", "SHOAL_LOCAL_RANK": "0"}, {}, "single"),  # present = rank var set
])
def test_precedence(env: dict[str, str], kwargs: dict[str, object], launcher: str) -> None:
    assert run(env, **kwargs).launcher == launcher


def test_explicit_values_beat_shoal_variables() -> None:
    info = run(SHOALRUN, hostname="hx", secret="s3", job_id="j/1", rendezvous_addr="a1",
               rendezvous_port=9)
    assert (info.launcher, info.hostname, info.secret, info.job_id, info.rendezvous_addr,
            info.rendezvous_port) == ("shoalrun", "hx", "s3", "j_1", "a1", 9)


def test_config_object_is_used_for_shoalrun() -> None:
    cfg = config.load({"SHOAL_RANK": "1", "SHOAL_SIZE": "2", "SHOAL_RENDEZVOUS_ADDR": "c0",
                       "SHOAL_RENDEZVOUS_PORT": "1"})
    info = run({}, cfg=cfg)
    assert (info.launcher, info.rank, info.rendezvous_addr) == ("shoalrun", 1, "c0")


def test_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topology.socket, "gethostname", lambda: "real-host")
    assert run({}).hostname == "real-host"
    assert run({"SHOAL_HOSTNAME": "sim-node-1"}).hostname == "sim-node-1"


def test_derived_secret_and_job_id() -> None:
    info = run(OMPI)
    assert info.job_id == "m0-5000" and info.secret_is_derived
    want = hashlib.sha256(b"shoal-unauthenticated:m0-5000:m0:5000").hexdigest()
    assert info.secret == want == run(OMPI).secret  # every rank derives the same one
    assert run({**OMPI, "SHOAL_JOB_ID": "other"}).secret != want
    assert run({**OMPI, "SHOAL_JOB_ID": "a b:c/d"}).job_id == "a_b_c_d"
    ipv6 = run({**OMPI, "MASTER_ADDR": "fe80::1"})
    assert ipv6.job_id == "fe80__1-5000"


@pytest.mark.parametrize(("hosts", "rank", "expected"), [
    ("a a a a", 2, dict(local_rank=2, local_size=4, cross_rank=0, cross_size=1,
                        local_ranks=(0, 1, 2, 3), cross_peers=(2,), homogeneous=True)),
    ("a b a b", 2, dict(local_rank=1, local_size=2, cross_rank=0, cross_size=2,
                        local_ranks=(0, 2), cross_peers=(2, 3), homogeneous=True)),
    ("a b a b", 1, dict(local_rank=0, local_size=2, cross_rank=1, cross_size=2,
                        local_ranks=(1, 3), cross_peers=(0, 1), homogeneous=True)),
    ("a a a b", 3, dict(local_rank=0, local_size=1, cross_rank=1, cross_size=2,
                        local_ranks=(3,), cross_peers=(0, 3), homogeneous=False)),
    ("a a a b", 2, dict(local_rank=2, local_size=3, cross_rank=0, cross_size=2,
                        local_ranks=(0, 1, 2), cross_peers=(2,), homogeneous=False)),
])
def test_world_from_hostnames(hosts: str, rank: int, expected: dict[str, object]) -> None:
    world = World.from_hostnames(rank, hosts.split())
    assert (world.rank, world.size, world.hosts) == (rank, 4, tuple(hosts.split()))
    assert {k: getattr(world, k) for k in expected} == expected


def test_world_node_ranks_and_single() -> None:
    world = World.from_hostnames(0, ["b", "a", "b", "c"])
    assert [world.node_ranks(n) for n in range(3)] == [(0, 2), (1,), (3,)]
    with pytest.raises(IndexError):
        world.node_ranks(3)
    with pytest.raises(TopologyError, match="rank 4"):
        World.from_hostnames(4, ["a"] * 4)
    single = World.single("h")
    assert (single.size, single.local_ranks, single.cross_peers, single.homogeneous) == (
        1, (0,), (0,), True)


def test_check_consistent() -> None:
    info = run({**TORCHRUN, "SHOAL_HOSTNAME": "n1"})  # rank 3 of 8, 2 per node, node 1
    check_consistent(info, World.from_hostnames(3, [f"n{r // 2}" for r in range(8)]))
    check_consistent(run(OMPI), World.from_hostnames(2, ["x", "x", "y", "y"]))  # cross unknown
    with pytest.raises(TopologyError, match=r"LOCAL_WORLD_SIZE=2.*local_size=1.*SHOAL_HOSTNAME"):
        check_consistent(info, World.from_hostnames(3, [f"n{r}" for r in range(8)]))
    with pytest.raises(TopologyError, match=r"says GROUP_RANK=1, but .* imply cross_rank=0 .*'a'"):
        check_consistent(info, World.from_hostnames(3, list("abcabcdd")))  # only cross_rank off
