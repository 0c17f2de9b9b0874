"""libfabric's /dev/shm regions after failures (issue 26): none of a failed
job survives the next init, a recycled pid inits, signal and watchdog exits
leave nothing, a live region of another PID namespace is never swept.

The jobs run as real oneCCL ranks in a sandbox of their own (``python
tests/diagnostics/test_shm_regions.py sandbox PLAN``, as root): a private mount
namespace with its own tmpfs on ``/dev/shm`` (no other test run's regions,
and nobody else's sweep, see or touch these) and a private PID namespace;
each job runs in a fresh nested PID namespace whose ranks get chosen pids
(``/proc/sys/kernel/ns_last_pid``), so the second job's ranks get the first
job's pids, as a recycled pid would. The sweep itself is also tested on
plain files in a directory of its own.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

# tests/ (conftest, world and the other helpers) on the path, also when this
# file runs as a rank's script (python tests/diagnostics/test_shm_regions.py ...)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from world import TORCHRUN_ENV, free_port  # noqa: E402

PID_BASE = 300   # rank r of every job gets pid PID_BASE + r in its PID namespace


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _mapped_regions() -> List[str]:
    """This process's own libfabric regions, as /proc/self/maps shows them."""
    pid = os.getpid()
    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line}
    return sorted(p for p in paths if os.path.basename(p).startswith(f"{pid}:"))


def _shm() -> Dict[str, int]:
    """The sandbox's /dev/shm: name -> bytes resident."""
    return {n: os.stat(os.path.join("/dev/shm", n)).st_blocks * 512 for n in sorted(os.listdir("/dev/shm"))}


# ------------------------------------------------------------ rank programs
def _rank() -> None:
    import torch
    import streamcoll
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("streamcoll.shm").setLevel(logging.INFO)
    scenario, out = os.environ["SHM_SCENARIO"], os.environ["SHM_OUT"]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = os.path.join(out, f"rank{rank}.json")
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=float(os.environ.get("SHM_TIMEOUT", "60")))
    t = torch.ones(1024)
    comm.all_reduce(t)
    res = {"pid": os.getpid(), "regions": _mapped_regions(), "sum": t[0].item()}
    _write(me, res)
    if scenario == "failed":          # rank 2 is killed; 0 ends by the watchdog, 1 by a normal exit
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0:
            comm.all_reduce(t)        # never completes: the watchdog ends the process (86)
        try:
            comm.all_reduce(t, async_op=True).wait()
        except streamcoll.CollectiveTimeout:
            sys.exit(3)               # Python's exit with a oneCCL call still stuck (teardown skipped)
    elif scenario == "signals":       # 0 and 1 stuck in a call rank 2 never joins; 2 in Python
        if rank < 2:
            _write(me, dict(res, entering=time.time()))
            comm.all_reduce(t)
        while True:
            time.sleep(0.01)
    elif scenario == "killed":        # every rank SIGKILLed once all reduced: nobody left to remove a region
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out, f"rank{j}.json")) for j in range(size)):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "hold":          # a live region until told to go
        while not os.path.exists(os.path.join(out, "release")):
            time.sleep(0.05)
    comm.destroy()


def _launch(scenario: str, size: int, out: str, port: int) -> None:
    """PID 1 of a fresh PID namespace: the ranks at pids PID_BASE + r."""
    procs = []
    for r in range(size):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(PID_BASE + r - 1))
        env = dict(os.environ, **TORCHRUN_ENV, RANK=str(r), WORLD_SIZE=str(size), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(size), MASTER_PORT=str(port), SHM_SCENARIO=scenario, SHM_OUT=out)
        err = open(os.path.join(out, f"stderr{r}"), "w")
        procs.append(subprocess.Popen([sys.executable, __file__, "rank"], env=env, stderr=err, stdout=err))
        err.close()
    if scenario == "signals":
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                _read(os.path.join(out, f"rank{r}.json")).get("entering" if r < 2 else "pid") for r in range(3)):
            time.sleep(0.05)
        time.sleep(1.0)                       # well inside the stuck call
        procs[0].send_signal(signal.SIGTERM)  # stuck: the signal watcher ends it by SIGTERM (-15)
        procs[1].send_signal(signal.SIGINT)   # stuck: by SIGINT (-2)
        for p in procs[:2]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        procs[2].send_signal(signal.SIGTERM)  # between calls: -15
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(150))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append(p.wait())
    _write(os.path.join(out, "launcher.json"), {"rcs": rcs, "pids": [p.pid for p in procs]})


def _job(scenario: str, size: int, out: str, timeout: float = 60) -> dict:
    """Run one job in a fresh PID namespace; its ranks' results."""
    os.makedirs(out, exist_ok=True)
    # a call stuck on the comm thread (async, whatever its size: none inline)
    env = dict(os.environ, SHM_TIMEOUT=str(timeout), STREAMCOLL_INLINE_ASYNC_BYTES="0")
    subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, __file__, "launch", scenario,
                    str(size), out, str(free_port())], env=env, timeout=240)
    res = _read(os.path.join(out, "launcher.json"))
    res["ranks"] = [_read(os.path.join(out, f"rank{r}.json")) for r in range(size)]
    res["stderr"] = []
    for r in range(size):
        try:
            with open(os.path.join(out, f"stderr{r}")) as f:
                res["stderr"].append(f.read()[-6000:])
        except OSError:
            res["stderr"].append("")
    return res



def _sweeper(module: str, d: str, rounds: int) -> None:
    """One of several sweepers started together: ``shm_regions.py`` loaded by
    path (no torch, starts in milliseconds), then for each round, as soon as
    the test writes ``go<k>``, one sweep of ``d``; ``done<k>.<pid>`` lists what
    it removed."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("shm_regions_under_test", module)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
    spec.loader.exec_module(mod)
    for k in range(rounds):
        go = os.path.join(d, f"go{k}")
        deadline = time.monotonic() + 120
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                sys.exit(2)
            time.sleep(0.0002)
        removed = [os.path.basename(r.path) for r in mod.sweep(d)]
        _write(os.path.join(d, f"done{k}.{os.getpid()}.json"), {"removed": removed})


def _sandbox(plan: str, out: str) -> None:
    """PID 1 of the sandbox (private /dev/shm): run ``plan``, write what was seen."""
    res: dict = {}
    if plan == "failed_then_next":
        res["failed"] = _job("failed", 3, os.path.join(out, "failed"), timeout=5)
        res["after_failed"] = _shm()
        res["killed"] = _job("killed", 3, os.path.join(out, "killed"))
        res["after_killed"] = _shm()
        res["next"] = _job("clean", 3, os.path.join(out, "next"))
        res["after_next"] = _shm()
    elif plan == "signals":
        res["signals"] = _job("signals", 3, os.path.join(out, "signals"), timeout=120)
        res["after"] = _shm()
    elif plan == "other_namespace":
        d = os.path.join(out, "hold")
        os.makedirs(d)
        env = dict(os.environ, SHM_TIMEOUT="60")
        p = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, __file__, "launch",
                              "hold", "1", d, str(free_port())], env=env)
        deadline = time.monotonic() + 120
        while not _read(os.path.join(d, "rank0.json")) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        res["held"] = _read(os.path.join(d, "rank0.json"))
        res["before"] = _shm()
        res["pid_here"] = os.path.exists(f"/proc/{PID_BASE}")
        from streamcoll.diagnostics import shm_regions
        res["swept"] = [r.path for r in shm_regions.sweep()]
        res["after_sweep"] = _shm()
        open(os.path.join(d, "release"), "w").close()
        p.wait(120)
        res["after_end"] = _shm()
    _write(os.path.join(out, "sandbox.json"), res)


if __name__ != "__main__":
    import pytest

    from conftest import needs_oneccl

    def _can_sandbox() -> str:
        if os.geteuid() != 0:
            return "needs root (a private /dev/shm and PID namespaces)"
        if not shutil.which("unshare"):
            return "needs unshare (util-linux)"
        return ""

    sandboxed = pytest.mark.skipif(bool(_can_sandbox()), reason=_can_sandbox() or "-")

    def _run_sandbox(plan: str, tmp_path) -> dict:
        cmd = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "sh", "-c",
               'mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm && exec "$@"', "sh",
               sys.executable, __file__, "sandbox", plan, str(tmp_path)]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        res = _read(os.path.join(tmp_path, "sandbox.json"))
        assert res, f"the sandbox wrote nothing (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return res

    def _info(job: dict) -> str:
        return "\n".join(f"--- rank {r}: exit {rc}\n{err}"
                         for r, (rc, err) in enumerate(zip(job.get("rcs", []), job["stderr"])))

    @needs_oneccl
    @pytest.mark.world
    @sandboxed
    def test_failed_job_leaves_no_region_and_its_recycled_pids_init(tmp_path):
        """A 3-rank job: rank 2 SIGKILLed, rank 0 ended by the watchdog (86),
        rank 1 by Python's exit with a call stuck (3). The survivors' regions
        are gone when they end, and so is the dead rank's: a survivor that
        maps it removes it at its end (issue 36: before, it stayed until the
        next init on the host). Then a job whose ranks are all SIGKILLed
        leaves theirs (nobody is left to remove them) until the next job's
        init, whose ranks have the same pids (a recycled pid: before,
        oneCCL's init failed with "failed to initialize ATL", fi_enable
        -EBUSY). After the next job: nothing."""
        res = _run_sandbox("failed_then_next", tmp_path)
        failed, killed, nxt = res["failed"], res["killed"], res["next"]
        info = _info(failed) + "\n" + _info(killed) + "\n" + _info(nxt)
        assert failed["rcs"] == [86, 3, -signal.SIGKILL], info
        assert failed["pids"] == [PID_BASE, PID_BASE + 1, PID_BASE + 2], failed["pids"]
        mine = {r: failed["ranks"][r]["regions"] for r in range(3)}
        assert all(len(v) >= 1 for v in mine.values()), mine
        assert res["after_failed"] == {}, (res["after_failed"], mine, info)
        for r in (0, 1):
            assert f"removed this process's libfabric shm region {mine[r][0]}" in failed["stderr"][r], info
        by_survivor = "".join(failed["stderr"][:2])
        for p in mine[2]:
            assert f"removed the libfabric shm region {p} of pid {PID_BASE + 2}, a peer that has ended" \
                in by_survivor, info
        assert killed["rcs"] == [-signal.SIGKILL] * 3 and killed["pids"] == failed["pids"], info
        theirs = sorted(os.path.basename(p) for r in range(3) for p in killed["ranks"][r]["regions"])
        assert theirs and sorted(res["after_killed"]) == theirs, (res["after_killed"], theirs, info)
        # the next job: same pids, inits, reduces, and the killed job's regions are gone
        assert nxt["pids"] == failed["pids"], nxt["pids"]
        assert nxt["rcs"] == [0, 0, 0], info
        assert [r["sum"] for r in nxt["ranks"]] == [3.0, 3.0, 3.0], info
        assert res["after_next"] == {}, res["after_next"]
        logs = "".join(nxt["stderr"])
        for name in theirs:
            assert f"removed stale libfabric shm region /dev/shm/{name}" in logs and "MB freed" in logs, logs

    @needs_oneccl
    @pytest.mark.world
    @sandboxed
    def test_signal_exits_leave_no_region(tmp_path):
        """SIGTERM and SIGINT on ranks stuck in a call (the signal watcher
        ends them by the signal: -15 and -2) and SIGTERM between calls (-15,
        as before): no region is left."""
        res = _run_sandbox("signals", tmp_path)
        job = res["signals"]
        info = _info(job)
        assert job["rcs"] == [-signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM], info
        assert res["after"] == {}, (res["after"], info)

    @needs_oneccl
    @pytest.mark.world
    @sandboxed
    def test_a_live_region_of_another_pid_namespace_is_kept(tmp_path):
        """A 1-rank job in a nested PID namespace holds its region (named by
        a pid that is not running in the sweeper's namespace, where a sweep by
        pid would remove it); the sweep keeps it; the job's destroy removes it."""
        res = _run_sandbox("other_namespace", tmp_path)
        (region,) = [os.path.basename(p) for p in res["held"]["regions"]]
        assert region in res["before"] and not res["pid_here"], res
        assert res["swept"] == [] and region in res["after_sweep"], res
        assert res["after_end"] == {}, res

    # ------------------------------------------------ the sweep on plain files
    def _region_file(d: str, name: str, mb: int = 1) -> str:
        p = os.path.join(d, name)
        with open(p, "wb") as f:
            f.write(b"\1" * (mb << 20))
        return p

    def test_sweep_removes_only_unused_regions_of_this_user(tmp_path, caplog):
        from streamcoll.diagnostics import shm_regions
        d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="sweeptest-")
        try:
            dead = _region_file(d, "4000001:0:0", 2)
            old = _region_file(d, "4000002:1000:0:0")           # libfabric 1.10's four-part name
            own_pid = _region_file(d, f"{os.getpid()}:0:0")    # a recycled pid: this process's, before its init
            mapped = _region_file(d, "4000003:0:0")
            held = subprocess.Popen([sys.executable, "-c",
                                     "import mmap, os, sys, time\n"
                                     f"fd = os.open({mapped!r}, os.O_RDWR)\n"
                                     "m = mmap.mmap(fd, 0, mmap.MAP_SHARED)\n"
                                     "os.close(fd)\nprint('ready', flush=True)\ntime.sleep(60)\n"],
                                    stdout=subprocess.PIPE, text=True)
            assert held.stdout.readline().strip() == "ready"
            msg = _region_file(d, "4000004:0:0_7")              # a message of the mmap protocol
            other = _region_file(d, "torch_4000005")
            target = _region_file(d, "target")
            os.symlink(target, os.path.join(d, "4000006:0:0"))
            nobody = None
            if os.geteuid() == 0:
                nobody = _region_file(d, "4000007:0:0")
                os.chown(nobody, 65534, 65534)
            with caplog.at_level(logging.INFO, logger="streamcoll.shm"):
                removed = shm_regions.sweep(d)
            held.kill()
            held.wait()
            assert sorted(r.path for r in removed) == sorted([dead, old, own_pid])
            for p in (mapped, msg, other, target, os.path.join(d, "4000006:0:0")) + ((nobody,) if nobody else ()):
                assert os.path.lexists(p), p
            assert f"removed stale libfabric shm region {dead}" in caplog.text, caplog.text
            assert "2.1 MB freed" in caplog.text and "pid 4000001 not running here" in caplog.text, caplog.text
            assert f"pid {os.getpid()} running here" in caplog.text or "reused" in caplog.text, caplog.text
            # now unused: the next sweep takes it
            assert [r.path for r in shm_regions.sweep(d)] == [mapped]
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def test_sweepers_started_together_all_survive(tmp_path):
        """Six processes sweep the same stale regions at once, 12 rounds of
        500 (the restart after a crashed job: every rank sweeps before its
        first init). Before, a sweeper's lease was broken by another's
        ``O_NONBLOCK`` open and the holder died of SIGIO (issue 33: one killed
        in 10 of 10 rounds of 3000). Now none dies, every stale region goes,
        each removed by exactly one of them, and the regions a live process
        maps stay."""
        module = os.path.join(ROOT, "streamcoll", "diagnostics", "shm_regions.py")
        d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="sweeprace-")
        n, rounds, per_round = 6, 12, 500
        held = None
        try:
            live = [_region_file(d, f"{4100000 + i}:0:0", 0) for i in range(2)]
            for p in live:
                with open(p, "wb") as f:
                    f.write(b"\1" * 4096)
            held = subprocess.Popen([sys.executable, "-c",
                                     "import mmap, os, sys, time\n"
                                     f"ms = [mmap.mmap(os.open(p, os.O_RDWR), 0, mmap.MAP_SHARED) for p in {live!r}]\n"
                                     "print('ready', flush=True)\ntime.sleep(600)\n"],
                                    stdout=subprocess.PIPE, text=True)
            assert held.stdout.readline().strip() == "ready"
            procs = [subprocess.Popen([sys.executable, __file__, "sweeper", module, d, str(rounds)],
                                      stderr=subprocess.PIPE, text=True) for _ in range(n)]
            try:
                for k in range(rounds):
                    stale = {f"{4200000 + k * per_round + i}:0:0" for i in range(per_round)}
                    for name in stale:
                        open(os.path.join(d, name), "wb").close()
                    open(os.path.join(d, f"go{k}"), "w").close()
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        done = [f for f in os.listdir(d) if f.startswith(f"done{k}.") and f.endswith(".json")]
                        # a sweeper that finished its last round exits 0 (a race with this look, seen in CI)
                        dead = [p.returncode for p in procs if p.poll() not in (None, 0)]
                        if len(done) == n or dead:
                            break
                        time.sleep(0.01)
                    done = [f for f in os.listdir(d) if f.startswith(f"done{k}.") and f.endswith(".json")]
                    dead = [p.poll() for p in procs if p.poll() not in (None, 0)]
                    assert not dead, (f"round {k}: sweeper(s) ended with {dead} (-{int(signal.SIGIO)}: SIGIO)",
                                      [p.stderr.read()[-2000:] for p in procs if p.poll() is not None])
                    removed = [name for f in done for name in _read(os.path.join(d, f))["removed"]]
                    assert sorted(removed) == sorted(stale), (k, len(removed), len(set(removed)), len(stale))
                    left = {f for f in os.listdir(d) if ":" in f}
                    assert left == {os.path.basename(p) for p in live}, (k, sorted(left)[:10])
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
                    p.stderr.close()
        finally:
            if held is not None:
                held.kill()
                held.wait()
            shutil.rmtree(d, ignore_errors=True)

    def test_region_names():
        from streamcoll.diagnostics.shm_regions import region_pid
        assert region_pid("123:0:0") == 123 and region_pid("7:1000:0:1") == 7
        assert region_pid("123:0:0_5") is None and region_pid("nccl-abc") is None and region_pid("123") is None

    @needs_oneccl
    def test_own_regions_at_exit_of_a_one_rank_job(tmp_path):
        """A plain 1-rank job that exits without destroy while the watchdog
        skips the native teardown (as after a stuck call): its region goes."""
        code = ("import os, streamcoll, torch\n"
                "from streamcoll.diagnostics import watchdog\n"
                "c = streamcoll.init(backend='oneccl', device='cpu')\n"
                "c.all_reduce(torch.ones(4))\n"
                "import json\n"
                "print(json.dumps(sorted({l.split()[-1] for l in open('/proc/self/maps') if '/dev/shm/%d:' % os.getpid() in l})))\n"
                "watchdog.skip_native_teardown()\n")
        env = dict(os.environ, **TORCHRUN_ENV, MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
                   PYTHONPATH=ROOT)
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stderr[-3000:]
        regions = json.loads(p.stdout.strip().splitlines()[-1])
        assert regions, p.stdout
        assert not any(os.path.exists(r) for r in regions), regions

else:
    cmd = sys.argv[1]
    if cmd == "rank":
        _rank()
    elif cmd == "launch":
        _launch(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    elif cmd == "sandbox":
        _sandbox(sys.argv[2], sys.argv[3])
    elif cmd == "sweeper":
        _sweeper(sys.argv[2], sys.argv[3], int(sys.argv[4]))
