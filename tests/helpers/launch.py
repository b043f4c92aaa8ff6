"""Run a recipe the way users do (`accelerate launch --config_file ...`) and read its outputs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common.launch import accelerate_cmd
from benchmarks.common.launch import env as launch_env

ROOT = Path(__file__).resolve().parents[2]
RECIPE_RUNS = str(ROOT / "tests" / "helpers" / "recipe_runs.py")  # many recipe runs in one launch (its docstring)
RANK_ZYGOTES = 4  # one per local rank (tests/helpers/rank_zygote.py): the suite's launches have up to 4 processes


# Set in the pytest process by torch's inductor when a test compiles in-process (cpp_builder loads an OpenMP runtime
# with KMP_DUPLICATE_LIB_OK=TRUE): a user's launch does not carry it, so the launches keep the session's start value
# (a launch after such a test is the same as one before it, and its ranks still fork: rank_zygote.py)
_SET_BY_TESTS = {key: os.environ.get(key) for key in ("KMP_DUPLICATE_LIB_OK",)}


def env() -> dict:
    """The suite's launches compare CPU + gloo runs with each other (the parity contract): on a machine with a GPU
    they are kept on the CPU too, since a 2-process launch on a one-GPU machine is refused (one CUDA device per
    process) and a GPU reference would add device-numerics noise. HFPAR_TEST_CUDA=1 launches on the GPUs instead."""
    # PYTHONFAULTHANDLER: a worker killed by a fatal signal (SIGABRT, SIGSEGV) prints every thread's Python stack
    e = {**launch_env(cpu=os.environ.get("HFPAR_TEST_CUDA") != "1"), "PYTHONFAULTHANDLER": "1"}
    for key, value in _SET_BY_TESTS.items():
        if value is None:
            e.pop(key, None)
        else:
            e[key] = value
    return e


_BAR = re.compile(r"(it/s|s/it)(, [^\]]*)?\]\s*$|^\s*$")


def log_tail(text: str, n: int) -> str:
    """The last n characters of a launch's output without its progress-bar redraws (tqdm's \\r lines), which
    otherwise fill a failure message and push out the lines that say why."""
    lines = [line for line in re.split(r"[\r\n]", text) if not _BAR.search(line)]
    return "\n".join(lines)[-n:]


def launch_cmd(
    config: str,
    nproc: int,
    recipe: str,
    args: list[str],
    extra_launch: list[str] | None = None,
    launcher: str = "accelerate.commands.launch",
) -> list[str]:
    """recipe: a name of recipes/ ("sft"), or a script's path (ending .py), e.g. RECIPE_RUNS. launcher: the module
    run with -m, Accelerate's or hfpar.launch (the same launch, the workers' exit code, no launcher traceback)."""
    cmd = accelerate_cmd(config, nproc, recipe, args, extra_launch)  # [python, -m, accelerate.commands.launch, ...]
    return [cmd[0], "-m", launcher, *cmd[3:]]


class _Zygote:
    """Client of tests/helpers/zygote.py: `python -m accelerate.commands.launch ARGS` run by a fork of one
    process that has imported accelerate and torch already (saves ~3 CPU-s per launch; same entry point, argv,
    env and cwd). HFPAR_TEST_LAUNCHER=subprocess runs every launch as a new process instead."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._tmp: str | None = None  # made with the server: a process that launches nothing leaves no folder
        self.ranks = ""  # the rank zygotes' sockets and logs (rank_zygote.py), in it
        self._n = 0

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="hfpar-launch-")
                self.ranks = os.path.join(self._tmp, "ranks")
                atexit.register(self.close)
            os.makedirs(self.ranks, exist_ok=True)
            server = [sys.executable, str(Path(__file__).with_name("zygote.py")), self.ranks, str(RANK_ZYGOTES)]
            self._proc = subprocess.Popen(
                server, cwd=ROOT, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        return self._proc

    def rank_forks(self, timeout: float = 120) -> str:
        """rank_decisions of this launcher's rank zygotes (they start with it)."""
        self._server()
        return rank_decisions(self.ranks, timeout)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def run(self, cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        assert cmd[1] == "-m" and cmd[2] in ("accelerate.commands.launch", "hfpar.launch", "torch.distributed.run"), cmd
        with self._lock:
            server = self._server()
            self._n += 1
            base = os.path.join(self._tmp, str(self._n))
            req = {
                "argv": cmd[3:],
                "env": env,
                "cwd": str(ROOT),
                "out": base + ".out",
                "err": base + ".err",
                "rc": base + ".rc",
                "module": cmd[2],
            }
            server.stdin.write(json.dumps(req) + "\n")
            server.stdin.flush()
            pid = json.loads(server.stdout.readline())["pid"]
        deadline = time.monotonic() + timeout
        while not os.path.exists(req["rc"]):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        rc = int(Path(req["rc"]).read_text())
        out, err = (Path(req[k]).read_text(errors="replace") for k in ("out", "err"))
        for k in ("out", "err", "rc"):
            os.unlink(req[k])
        return subprocess.CompletedProcess(cmd, rc, out, err)


_ZYGOTE = _Zygote()


class Started:
    """A `python ARGS` started by start_python: communicate(timeout) -> (stdout, stderr), then returncode, as
    subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True) gives them."""

    def __init__(self, popen: subprocess.Popen | None = None, future=None):
        self._popen, self._future, self.returncode = popen, future, None

    def communicate(self, timeout: float) -> tuple[str, str]:
        if self._popen is not None:
            out, err = self._popen.communicate(timeout=timeout)
            self.returncode = self._popen.returncode
            return out, err
        proc = self._future.result(timeout=timeout)
        self.returncode = proc.returncode
        return proc.stdout, proc.stderr


_STARTS = ThreadPoolExecutor(4, thread_name_prefix="start_python")


def start_python(args: list[str], env: dict, timeout: float = 600) -> Started:
    """`python ARGS` in ROOT as the examples and own-code tests run them (torchrun or one process), its processes
    forked from the pre-imported zygotes where they can be, as the recipe launches' are: `-m torch.distributed.run
    ...` through the launch zygote (its workers through the rank trampoline), a script through the trampoline
    (forking_python). HFPAR_TEST_LAUNCHER=subprocess: a plain subprocess."""
    if os.environ.get("HFPAR_TEST_LAUNCHER") != "subprocess" and args[:2] == ["-m", "torch.distributed.run"]:
        _ZYGOTE.rank_forks()  # the rank zygotes accept requests (until then a trampoline runs a fresh interpreter)
        return Started(future=_STARTS.submit(_ZYGOTE.run, [sys.executable, *args], env, timeout))
    python, env = forking_python(env) if not args[0].startswith("-") else (sys.executable, env)
    return Started(popen=_popen([python, *args], env))


def forking_python(env: dict) -> tuple[str, dict]:
    """(python, env) that run `python SCRIPT ARGS` as a fork of the rank zygote of env's LOCAL_RANK (0 when unset):
    the trampoline (rank_trampoline.py; a fresh interpreter where the zygote refuses the environment); sys.executable
    and env as they are with HFPAR_TEST_LAUNCHER=subprocess or HFPAR_TEST_RANKS=fresh."""
    if os.environ.get("HFPAR_TEST_LAUNCHER") == "subprocess":
        return sys.executable, env
    _ZYGOTE.rank_forks()
    trampoline = Path(_ZYGOTE.ranks, "python")
    if not trampoline.exists():
        return sys.executable, env
    return str(trampoline), {**env, "HFPAR_TEST_RANK_ZYGOTES": f"{_ZYGOTE.ranks}:{RANK_ZYGOTES}"}


def _popen(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rank_decisions(folder: str | Path, timeout: float = 120) -> str:
    """The decision logs of the rank zygotes in `folder` ("fork PID ..." / "fresh WHY" lines, rank_zygote.py), once
    all RANK_ZYGOTES of them accept requests (each imports the stack first)."""
    deadline = time.monotonic() + timeout
    while not all(Path(folder, f"rank-{k}.sock").exists() for k in range(RANK_ZYGOTES)):
        assert time.monotonic() < deadline, f"the rank zygotes in {folder} did not start"
        time.sleep(0.05)
    return "".join(p.read_text() for p in sorted(Path(folder).glob("rank-*.sock.log")))


def launch(
    config: str,
    nproc: int,
    recipe: str,
    args: list[str],
    *,
    check: bool = True,
    timeout: int = 600,
    extra_launch: list[str] | None = None,
    extra_env: dict | None = None,
    launcher: str = "accelerate.commands.launch",
) -> subprocess.CompletedProcess:
    cmd = launch_cmd(config, nproc, recipe, args, extra_launch, launcher)
    run_env = {**env(), **(extra_env or {})}
    if os.environ.get("HFPAR_TEST_LAUNCHER") == "subprocess":
        proc = subprocess.run(cmd, check=False, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)
    else:
        proc = _ZYGOTE.run(cmd, run_env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"launch failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{log_tail(proc.stdout, 4000)}"
            f"\n--- stderr\n{log_tail(proc.stderr, 8000)}"
        )
    return proc


def launch_all(
    jobs: dict, workers: int = 2, extra_launch: list[str] | None = None, group: bool = True, fresh: bool = False
) -> None:
    """{name: (config, nproc, recipe, args[, copy])} launched `workers` at a time (a launch is mostly process start-up
    and rendezvous, which overlap well on 2 cores); raises the first failure.

    group: jobs of one recipe with the same accelerate config and process count run in ONE launch, one after the
    other in the same workers (tests/helpers/recipe_runs.py: `hfpar.recipe.main` per argv, as users' launches run it,
    bit-identical to separate launches), so the workers' start-up (imports: most of a tiny run's CPU time) is paid
    once per group. group=False for jobs that measure their process (peak RSS) or must each start fresh.

    copy: (src, dst), a directory copied just before the job runs: a resume from a checkpoint that an earlier job of
    the same (config, nproc, recipe) group writes (jobs of a group run in the dict's order; grouped jobs only).
    fresh: every rank a fresh interpreter, not a fork of a rank zygote (HFPAR_TEST_RANKS=fresh: runs that measure
    their process's memory measure what a user's process holds)."""
    assert group or all(len(job) == 4 for job in jobs.values()), "a job with a copy step needs group=True"
    extra_env = {"HFPAR_TEST_RANKS": "fresh"} if fresh else None
    with tempfile.TemporaryDirectory(prefix="hfpar-runs-") as specs, ThreadPoolExecutor(workers) as pool:
        launches = _grouped(jobs, Path(specs)) if group else list(jobs.values())
        launches.sort(key=lambda job: -job[4] if len(job) > 4 else 0)  # the longest groups first: better packing
        done = [
            pool.submit(launch, *job[:4], extra_launch=extra_launch, timeout=_timeout(job), extra_env=extra_env)
            for job in launches
        ]
        for f in done:
            f.result()


def parity_launches(root: Path, kind: str, cases: dict, argv, bf16=(), bf16_env=None, resumed=None) -> dict:
    """The launches of a recipe's parity module, one per (accelerate config, processes), its cases run one after
    the other in the same workers (RECIPE_RUNS): cases {name: (config, processes, ...)}, argv(name, tag="") their
    command lines; each of `bf16` again in <name>_bf16 under `bf16_env`; resumed (name, step): <name>_resumed
    resumed from <name>'s checkpoint-<step>, after the run that writes it (same launch)."""
    groups: dict = {}
    for name, (cfg, n, *_) in cases.items():
        groups.setdefault((cfg, n), []).append(argv(name))
    for name in bf16:
        cfg, n, *_ = cases[name]
        groups[(cfg, n)].append({"argv": argv(name, tag="_bf16"), "env": bf16_env})
    if resumed is not None:
        name, step = resumed
        cfg, n, *_ = cases[name]
        groups[(cfg, n)].append(
            {
                "argv": [*argv(name, tag="_resumed"), "--resume_from_checkpoint", "latest"],
                "copy": [str(root / name / f"checkpoint-{step}"), str(root / f"{name}_resumed" / f"checkpoint-{step}")],
            }
        )
    jobs = {}
    for (cfg, n), runs in groups.items():
        spec = root / f"runs_{cfg}_{n}.json"
        spec.write_text(json.dumps({"kind": kind, "runs": runs}))
        jobs[f"{cfg}_{n}"] = (cfg, n, RECIPE_RUNS, [str(spec)])
    return jobs


def _timeout(job: tuple) -> int:
    """600 s per launch, 240 s per run for a launch of several runs (a spec file of RECIPE_RUNS)."""
    runs = job[4] if len(job) > 4 else 1
    if job[2] == RECIPE_RUNS and len(job) <= 4:
        runs = len(json.loads(Path(job[3][0]).read_text())["runs"])
    return max(600, 240 * runs)


def _grouped(jobs: dict, spec_dir: Path) -> list[tuple]:
    """(config, nproc, RECIPE_RUNS, [spec], n_runs) per (config, nproc, recipe); a lone job stays as it is."""
    groups: dict[tuple, list] = {}
    for config, nproc, recipe, args, *copy in jobs.values():
        run = {"argv": list(args), "copy": [str(p) for p in copy[0]]} if copy else list(args)
        groups.setdefault((config, nproc, recipe), []).append(run)
    out = []
    for i, ((config, nproc, recipe), runs) in enumerate(groups.items()):
        if len(runs) == 1 or recipe.endswith(".py"):
            assert all(isinstance(run, list) for run in runs), f"a copy step without the run that writes it: {runs}"
            out += [(config, nproc, recipe, args, 1) for args in runs]
            continue
        spec = spec_dir / f"group{i}.json"
        spec.write_text(json.dumps({"kind": recipe, "runs": runs}))
        out.append((config, nproc, RECIPE_RUNS, [str(spec)], len(runs)))
    return out


def read_metrics(out: str | Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) from metrics.jsonl."""
    rows = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r], [
        r for r in rows if "loss" not in r and any(k.startswith("eval_") for k in r)
    ]


def read_run_info(out: str | Path) -> dict:
    return json.loads(Path(out, "run_info.json").read_text())


def model_with_unreadable_weights(src: str | Path, dst: str | Path) -> str:
    """A copy of a saved model (config, tokenizer) whose weights file is not safetensors: any run that reads a
    weight fails on it, so a clean one-line refusal proves the refusal came before the weights were read."""
    shutil.copytree(src, dst)
    Path(dst, "model.safetensors").write_bytes(b"these are not weights")
    return str(dst)


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the reference b (the parity files' per-step measure)."""
    return abs(a - b) / max(abs(b), 1e-12)


def rel_close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)
