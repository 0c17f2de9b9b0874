"""The launcher table (streamcoll/startup/launchers.py) as pure logic over
environment dicts: which launcher is detected, what it says, the SLURM
nodelist and tasks-per-node forms, the rendezvous each derives, and the
refusals that keep a job from becoming a silent 1-rank world. The real
launchers (srun, mpiexec, Ray Train, Lightning) are tests/startup/test_launchers.py."""
from __future__ import annotations

import pytest

from streamcoll.startup import launchers
from streamcoll._ffi.errors import RendezvousError
from streamcoll.startup.launchers import Launch, adopt, detect, first_host, slurm_port, tasks_on_node

# What srun -n 2 and mpiexec -n 2 set here (measured: SLURM 22.05, MPICH 5.0.2 hydra).
SRUN = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "vm", "SLURM_JOB_NODELIST": "vm"}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "11"}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture(autouse=True)
def _no_mpi4py(monkeypatch):
    """Pure logic: the mpi4py and hydra's PMI ways are tested with the real mpiexec."""
    monkeypatch.setattr(launchers, "_mpi4py", lambda: None)
    monkeypatch.setattr(launchers, "_pmi_wanted", lambda env: False)


@pytest.mark.parametrize("env, want", [
    ({}, None),
    (TORCHRUN, Launch("torchrun", 1, 2, 1, 2, 0)),
    ({"RANK": "0", "WORLD_SIZE": "3"}, Launch("environment", 0, 3)),
    (SRUN, Launch("slurm", 1, 2, 1, 2, 0)),
    (HYDRA, Launch("mpich-hydra", 1, 2, 1, 2)),
    (OMPI, Launch("open-mpi", 3, 4, 1, 2)),
    ({"PMIX_RANK": "2"}, Launch("pmix", 2, None)),
])
def test_each_launcher_is_detected_with_what_it_says(env, want):
    assert detect(env) == want


def test_torchrun_and_explicit_variables_win_over_an_outer_launcher():
    # torchrun inside an srun step; Ray's workers inside a SLURM job: theirs is the word.
    assert detect({**SRUN, **TORCHRUN}).launcher == "torchrun"
    got = detect({**SRUN, "RANK": "5", "WORLD_SIZE": "8"})
    assert (got.launcher, got.rank, got.world_size) == ("environment", 5, 8)
    assert detect({**SRUN, **HYDRA}).launcher == "slurm"


def test_a_batch_script_or_salloc_shell_is_one_process():
    # sbatch -n 2 / salloc -n 2 (measured): SLURM_PROCID=0 and SLURM_NTASKS=2 but no step: not a 2-rank world.
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "3", "SLURM_LOCALID": "0"}) is None


@pytest.mark.parametrize("nodelist, first", [
    ("vm", "vm"), ("host[5-9,12]", "host5"), ("host[12,5-9]", "host12"), ("a[01-03],b7", "a01"),
    ("node1,node2", "node1"), ("r[1-2]-n[3-4]", "r1-n3"), ("gpu-[007-009]", "gpu-007"), ("", None),
    ("host[", None), ("host[a-b]", None),
])
def test_first_host_of_a_compact_nodelist(nodelist, first):
    assert first_host(nodelist) == first


@pytest.mark.parametrize("value, node, n", [
    ("2", 0, 2), ("2(x3),1", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("2(x3),1", 4, None), ("x", 0, None),
    ("4,2", 1, 2),
])
def test_tasks_on_node(value, node, n):
    assert tasks_on_node(value, node) == n


def test_local_size_of_a_slurm_step_over_nodes():
    env = {**SRUN, "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6", "SLURM_NODEID": "2",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2),1(x2)", "SLURM_LOCALID": "0"}
    assert detect(env) == Launch("slurm", 5, 6, 0, 1, 2)


def test_slurm_port_is_per_step_and_outside_the_ephemeral_range():
    ports = {slurm_port(job, step) for job in range(1, 200) for step in range(4)}
    assert all(15000 <= p < 32768 for p in ports)
    assert slurm_port(7, 0) != slurm_port(7, 1)
    assert slurm_port(123456, 0) == slurm_port(123456, 0)


def test_slurm_ports_of_neighbouring_jobs_do_not_collide_by_construction():
    """Before (issue 33): ``15000 + (job * 64 + step) % 17000``: job J step
    64 had job J+1 step 0's port (28064 for job 1000)."""
    assert slurm_port(1000, 64) != slurm_port(1001, 0)
    assert sum(slurm_port(j, 64) == slurm_port(j + 1, 0) for j in range(1, 5001)) <= 3  # chance: 1 in 17000
    # the steps of one job never share a port (they may run at once on one first host)
    assert all(len({slurm_port(j, s) for s in range(300)}) == 300 for j in (1, 7, 1000, 123456789))


def test_slurm_ports_spread_over_the_whole_range():
    """Step 0 of 20000 consecutive jobs: the distinct ports a uniform hash
    gives (about 11800; before, 2125: gcd(64, 17000) = 8), every block of
    1000 ports about as full as the others."""
    lo, hi = launchers.SLURM_PORTS
    assert (lo, hi) == (15000, 32000)
    ports = [slurm_port(j, 0) for j in range(100000, 120000)]
    assert all(lo <= p < hi for p in ports)
    assert len(set(ports)) > 11000, len(set(ports))
    blocks = [0] * ((hi - lo) // 1000)
    for p in ports:
        blocks[(p - lo) // 1000] += 1
    mean = len(ports) / len(blocks)
    assert all(abs(b - mean) < 0.12 * mean for b in blocks), blocks


def test_the_job_scope_names_the_slurm_job_and_step():
    assert launchers.job_scope(SRUN) == "slurm7.0/"
    assert launchers.job_scope({**SRUN, "SLURM_STEP_ID": "3"}) == "slurm7.3/"
    assert launchers.job_scope(HYDRA) == "" and launchers.job_scope({}) == ""
    assert launchers.job_scope({**SRUN, "TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}) == ""


@pytest.mark.parametrize("env, var", [
    ({**HYDRA, "PMI_RANK": "one"}, "PMI_RANK"),
    ({**HYDRA, "PMI_SIZE": "2.0"}, "PMI_SIZE"),
    ({**SRUN, "SLURM_LOCALID": "-1"}, "SLURM_LOCALID"),
    ({**HYDRA, "PMI_RANK": "2"}, "PMI_RANK"),  # not below the size
])
def test_a_malformed_launcher_variable_names_itself(env, var):
    with pytest.raises(ValueError, match=var):
        detect(env)


def test_slurm_adopts_the_first_host_and_a_port_from_the_job_and_step():
    env = {**SRUN, "SLURM_STEP_NODELIST": "host[5-9,12]"}
    got = adopt(environ=env)
    assert (got.address, got.port) == ("host5", str(slurm_port(7, 0)))
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
        "MASTER_ADDR": "host5", "MASTER_PORT": str(slurm_port(7, 0))}
    assert "host5" in got.describe() and "SLURM_STEP_NODELIST" in got.describe()


def test_master_addr_and_port_override_slurm_and_are_not_parsed_here():
    env = {**SRUN, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "not-a-port"}
    got = adopt(environ=env)
    assert (got.address, got.port) == ("10.0.0.9", "not-a-port")  # bootstrap parses it when it makes the store


def test_a_bad_master_port_that_is_not_needed_breaks_nothing():
    for base in (HYDRA, SRUN, {}):
        env = {**base, "MASTER_PORT": "abc"}
        adopt(rendezvous=False, environ=env)  # a store was given: no rendezvous
        assert env["MASTER_PORT"] == "abc"
    detect({**HYDRA, "MASTER_PORT": "abc"})


def test_mpi_without_an_address_or_mpi4py_fails_naming_both_ways():
    with pytest.raises(RendezvousError) as e:
        adopt(environ=dict(HYDRA))
    msg = str(e.value)
    assert "mpich-hydra" in msg and "rank 1 of 2" in msg and "MASTER_ADDR" in msg and "mpi4py" in msg
    with pytest.raises(RendezvousError, match="world size"):
        adopt(environ={"PMIX_RANK": "0"})


def test_mpi_with_master_addr_uses_it_and_torchruns_default_port():
    env = {**HYDRA, "MASTER_ADDR": "127.0.0.1"}
    got = adopt(environ=env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(launchers.DEFAULT_PORT))
    # No node from hydra: LOCAL_WORLD_SIZE < WORLD_SIZE would make the topology guess one.
    assert "LOCAL_WORLD_SIZE" not in env and "GROUP_RANK" not in env
    assert got.launcher == "mpich-hydra"


def test_a_torchrun_variable_that_disagrees_with_the_launcher_is_refused():
    with pytest.raises(ValueError, match=r"RANK=0 disagrees.*rank 1 of 2"):
        adopt(environ={**HYDRA, "MASTER_ADDR": "127.0.0.1", "RANK": "0"})
    with pytest.raises(ValueError, match=r"WORLD_SIZE=1 disagrees"):
        adopt(environ={**SRUN, "WORLD_SIZE": "1"})


def test_no_launcher_changes_nothing():
    env = {"MASTER_ADDR": "127.0.0.1"}
    assert adopt(environ=env) is None and env == {"MASTER_ADDR": "127.0.0.1"}


def test_info_shows_the_detected_launcher(monkeypatch, capsys):
    from streamcoll.__main__ import _launcher_report
    import io
    for k, v in HYDRA.items():
        monkeypatch.setenv(k, v)
    out = io.StringIO()
    _launcher_report(out)
    assert "launcher: mpich-hydra" in out.getvalue() and "rank 1 of 2, local rank 1 of 2" in out.getvalue()


def test_the_public_launchers_name_imports_as_a_module():
    import importlib.util
    import os

    import streamcoll
    assert streamcoll.launchers.adopt is adopt  # the attribute: works
    spec = importlib.util.find_spec("streamcoll.launchers")  # looked up, not run (see the reason)
    pkg = os.path.dirname(os.path.abspath(streamcoll.__file__))
    assert spec is not None and os.path.abspath(spec.origin or "").startswith(pkg + os.sep), spec
