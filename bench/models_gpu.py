"""Real-size models on a GPU: eager, torch.compile and gjit, and where each one's time goes.

    python bench/models_gpu.py --json out.json                 # on a GPU: every workload, about 5 min
    python bench/models_gpu.py --models gpt2 bert --compilers eager gjit
    .venv/bin/python bench/models_gpu.py --small               # dry run on CPU: tiny configs, 1 round

Workloads (random weights from transformers' configs, HF's default attention, SDPA): GPT-2 small
fp16 8 x 512; a Llama shape (TinyLlama-1.1B's widths, 8 layers, GQA 32/4) bf16 4 x 1024;
BERT-base bf16 32 x 128; GPT-2 small fp16 `generate()` (batch 1, a 32-token prompt, 64 new tokens,
greedy, ms per token) with the dynamic cache, with transformers' static cache, and with the static
cache and `mode="reduce-overhead"` (CUDA graphs; gjit's row says n/a while `gjit.compile` has no
`mode=`). Each (workload, compiler) runs in a fresh process (bench/models_gpu_child.py) with empty
caches of its own (gjit's, Triton's, Inductor's), in four phases this parent paces so that the
slow part overlaps and no timing does:

1. setup, all processes at once: build the model, a float32 reference, eager's first calls;
2. eager before, one process at a time: eager's ms before its compiler compiled in the process;
3. compile, `--compile-jobs` processes at once: the first compiled call (cold compile s = it minus
   eager's first call), its output checked; measurements a compile makes on the GPU (gjit's tuning,
   Inductor's autotuning) take a lock, so no two overlap, and the wait is not counted;
4. measure, one process at a time, most important rows first, while the budget lasts: eager and
   compiled rounds alternately (ms per call, eager after), the host's ms to enqueue a call and the
   syncs inside it, a torch.profiler run (kernels, launches, GPU ms split into matmul, attention
   and other, the slowest kernels), gjit's compile stages.

A failed, hung or skipped process is a row with its reason (its log's tail in the JSON), never the
end of the run. Printed last: the markdown tables (bench/models_gpu_report.py, which also prints
them from a saved `--json`), the main one at the very end; `--json` has every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILERS = ("eager", "torch.compile", "gjit")


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    title: str
    model: str  # gpt2, llama or bert (bench/models_gpu_child.py builds it)
    dtype: str
    batch: int
    seq: int  # tokens per sequence; generate(): the prompt's
    new_tokens: int = 0  # generate(): tokens generated; 0: one forward call
    cache: str | None = None  # generate(): transformers' cache_implementation
    mode: str | None = None  # torch.compile's (and gjit's) mode=
    compilers: tuple[str, ...] = COMPILERS


_GEN = "GPT-2 small generate(), fp16, batch 1, prompt 32, 64 new tokens"
WORKLOADS = (  # in order of importance: rows are measured in this order while the budget lasts
    Workload("gpt2", "GPT-2 small (124M), fp16, 8 x 512", "gpt2", "float16", 8, 512),
    Workload(
        "llama", "Llama shape (2048 wide, 8 layers, GQA 32/4), bf16, 4 x 1024", "llama", "bfloat16", 4, 1024
    ),
    Workload("bert", "BERT-base, bf16, 32 x 128", "bert", "bfloat16", 32, 128),
    Workload("generate", _GEN + ", dynamic cache", "gpt2", "float16", 1, 32, 64),
    Workload("generate-static", _GEN + ", static cache", "gpt2", "float16", 1, 32, 64, "static"),
    Workload(
        "generate-static-ro",
        _GEN + ', static cache, mode="reduce-overhead"',
        "gpt2",
        "float16",
        1,
        32,
        64,
        "static",
        "reduce-overhead",
        ("torch.compile", "gjit"),
    ),
    # grouped keys and values: a decode step's query heads as rows of one call on their group
    # (gjit/lowering/grouped_kv.py's packed_queries; the static cache's mask is an input)
    Workload(
        "generate-llama-static",
        "Llama shape generate(), bf16, batch 1, prompt 32, 64 new tokens, static cache",
        "llama",
        "bfloat16",
        1,
        32,
        64,
        "static",
    ),
)
# --small: tiny configs in float32 on the CPU; gjit runs gpt2's kernels in Triton's interpreter
INTERPRETED_WHEN_SMALL = ("gpt2",)
# seconds the measure phase takes per process, to plan the budget (an H200, 16 cores)
MEASURE_S = {"forward": 6.0, "generate": 10.0}
# the most a stage may take in one process (compile: --timeout) before it is killed
STAGE_LIMIT_S = {"setup": 150.0, "before": 60.0, "measure": 90.0}


@dataclasses.dataclass
class Proc:
    """One (workload, compiler) process and what it reported."""

    workload: Workload
    compiler: str
    stages: tuple[str, ...]
    log: str
    popen: subprocess.Popen | None = None
    status: str = "pending"  # running, waiting (for the next go), finished, error, skipped, n/a
    stage: str = "setup"
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""
    log_tail: str = ""
    stage_s: dict[str, float] = dataclasses.field(default_factory=dict)
    started: float = 0.0
    gone_since: float | None = None  # when it was first seen ended while it should be running

    @property
    def key(self) -> str:
        return f"{self.workload.name}/{self.compiler}"

    @property
    def kind(self) -> str:
        return "generate" if self.workload.new_tokens else "forward"

    def alive(self) -> bool:
        return self.status in ("running", "waiting")


class Orchestrator:
    """Starts the processes and paces their stages: each reports on a pipe of its own and waits on
    its stdin for the word to start the next stage (`go`) or to leave (`stop`)."""

    def __init__(self, procs: list[Proc], opts: argparse.Namespace, root: str):
        self.procs, self.opts, self.root = procs, opts, root
        self.messages: queue.Queue = queue.Queue()
        self.start_time = time.monotonic()
        self.deadline = self.start_time + opts.budget
        self.phases: dict[str, float] = {}
        self.on_progress = lambda: None
        self.script = os.path.join(HERE, "models_gpu_child.py")  # what each process runs

    # -- processes ---------------------------------------------------------------------------------

    def launch(self, proc: Proc) -> None:
        cache = os.path.join(self.root, proc.key.replace("/", "_").replace(".", "_"))
        env = dict(
            os.environ, PYTHONUNBUFFERED="1", GJIT_CACHE="1", GJIT_CACHE_DIR=os.path.join(cache, "gjit")
        )
        env |= {
            "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        }
        for name in ("GJIT_REMOTE_CACHE", "GJIT_INTERPRET"):
            env.pop(name, None)
        env["GJIT_LOGS"] = "tuning,recompiles"  # into the process's log: what tuning measured
        spec = {
            "workload": dataclasses.asdict(proc.workload),
            "compiler": proc.compiler,
            "stages": proc.stages,
            "small": self.opts.small,
            "device": self.opts.device,
            "rounds": self.opts.rounds,
            "lock": os.path.join(self.root, "gpu.lock"),
            "interpret": self.opts.small and proc.workload.name in INTERPRETED_WHEN_SMALL,
            "torch_backend": self.opts.torch_backend,
        }
        read, write = os.pipe()
        with open(proc.log, "w") as log:
            proc.popen = subprocess.Popen(
                [sys.executable, self.script, json.dumps(spec), str(write)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env=env, pass_fds=(write,), start_new_session=True, text=True,
            )  # fmt: skip
        os.close(write)
        proc.status, proc.started = "running", time.monotonic()
        threading.Thread(target=self._read, args=(proc, read), daemon=True).start()

    def _read(self, proc: Proc, fd: int) -> None:
        with os.fdopen(fd) as pipe:
            for line in pipe:
                try:
                    self.messages.put((proc, json.loads(line)))
                except json.JSONDecodeError:
                    pass
        self.messages.put((proc, None))

    def send(self, proc: Proc, word: str) -> None:
        try:
            proc.popen.stdin.write(word + "\n")
            proc.popen.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def go(self, proc: Proc, stage: str) -> None:
        proc.status, proc.stage, proc.started = "running", stage, time.monotonic()
        self.send(proc, "go " + stage)

    def kill(self, proc: Proc, why: str) -> None:
        """Ends the process and what it started (its session: build workers that may outlive it)."""
        if proc.popen is not None and (proc.popen.poll() is None or proc.gone_since is not None):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()
        if proc.alive() or proc.status == "pending":
            proc.status, proc.error = "error", why
        proc.log_tail = tail(proc.log)

    def handle(self, timeout: float) -> None:
        """Take one message (or none within `timeout` s) and update its process."""
        try:
            proc, msg = self.messages.get(timeout=max(timeout, 0.01))
        except queue.Empty:
            self.reap()
            return
        if not proc.alive():  # killed or stopped: what it still said is not taken
            return
        if msg is None:  # the process closed its pipe: it ended
            self.ended(proc)
            return
        stage = msg["stage"]
        proc.stage_s[stage] = time.monotonic() - proc.started
        if msg["status"] == "done":
            proc.figures[stage] = msg.get("figures", {})
            last = stage == proc.stages[-1]
            proc.status = "finished" if last else "waiting"
            if last:
                self.on_progress()
        elif msg["status"] == "n/a":
            proc.status, proc.error = "n/a", msg.get("reason", "")
        else:
            proc.status, proc.error = "error", f"{stage}: {msg.get('error', '?')}"
            proc.figures["traceback"] = msg.get("traceback", "")

    def reap(self) -> None:
        """A process that ended without its pipe closing (a worker it forked holds the pipe open):
        ended, once its last message had time to arrive."""
        now = time.monotonic()
        for proc in self.procs:
            if proc.alive() and proc.popen.poll() is not None:
                proc.gone_since = proc.gone_since or now
                if now - proc.gone_since > 2:
                    self.ended(proc)

    def ended(self, proc: Proc) -> None:
        code = proc.popen.wait()
        proc.gone_since = proc.gone_since or time.monotonic()  # what it forked may live on
        self.kill(proc, f"{proc.stage}: the process ended (exit {code}) without reporting")

    def wait(self, procs: list[Proc], stage: str, deadline: float) -> None:
        """Until none of `procs` is running `stage`; kills those still at it at the deadline."""
        while True:
            running = [p for p in procs if p.status == "running" and p.stage == stage]
            if not running:
                return
            if time.monotonic() >= deadline:
                for p in running:
                    self.kill(p, f"{stage}: not done within {time.monotonic() - p.started:.0f} s")
                return
            self.handle(min(1.0, deadline - time.monotonic()))

    # -- phases ------------------------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def limit(self, stage: str) -> float:
        """When a stage started now must end: its own limit, within the budget (a measurement
        started may run 30 s past it)."""
        own = min(STAGE_LIMIT_S.get(stage, self.opts.timeout), self.opts.timeout)
        return time.monotonic() + min(own, max(self.left(), 30 if stage == "measure" else 0))

    def phase(self, name: str, fn) -> None:
        start = time.monotonic()
        fn()
        self.phases[name] = time.monotonic() - start

    def run(self) -> None:
        self.phase("setup", self._setup)
        self.phase("eager before", self._before)
        self.phase("compile", self._compile)
        self.phase("measure", self._measure)

    def _setup(self) -> None:
        for proc in self.procs:
            self.launch(proc)
        self.wait(self.procs, "setup", self.limit("setup"))

    def _before(self) -> None:
        for proc in self.procs:
            if proc.status == "waiting" and "before" in proc.stages:
                self.go(proc, "before")
                self.wait([proc], "before", self.limit("before"))

    def _compile(self) -> None:
        pending = [p for p in self.procs if p.status == "waiting" and "compile" in p.stages]
        # what the measure phase needs of the budget is kept for it
        reserve = sum(self.estimate(p) for p in self.procs if p.status == "waiting")
        deadline = self.deadline - reserve
        jobs = self.opts.compile_jobs or len(pending) or 1
        while pending or any(p.status == "running" for p in self.procs):
            running = [p for p in self.procs if p.status == "running"]
            while pending and len(running) < jobs:
                proc = pending.pop(0)
                self.go(proc, "compile")
                proc.figures["compiling_with"] = len(running)
                running.append(proc)
            for proc in running:  # its own limit, or the phase's end
                end = min(proc.started + self.opts.timeout, deadline)
                if time.monotonic() >= end:
                    self.kill(proc, f"compile: not done within {time.monotonic() - proc.started:.0f} s")
            if time.monotonic() >= deadline:
                for proc in pending:
                    self.stop(proc, "compile: not started, the budget ran out")
                pending = []
            self.handle(1.0)

    def _measure(self) -> None:
        for proc in self.procs:
            if proc.status != "waiting":
                continue
            if self.left() < self.estimate(proc):
                self.stop(proc, f"skipped: {self.left():.0f} s of the budget left")
                proc.status = "skipped"
                continue
            self.go(proc, "measure")
            self.wait([proc], "measure", self.limit("measure"))

    def estimate(self, proc: Proc) -> float:
        return 1.0 if self.opts.small else MEASURE_S[proc.kind]

    def stop(self, proc: Proc, why: str) -> None:
        self.send(proc, "stop")
        proc.status, proc.error = "error", why

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen is not None and proc.popen.poll() is None:
                self.send(proc, "stop")
        end = time.monotonic() + 5
        for proc in self.procs:
            if proc.popen is not None:
                try:
                    proc.popen.wait(timeout=max(end - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
                self.kill(proc, f"{proc.stage}: interrupted" if proc.status == "running" else "interrupted")


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def plan(opts: argparse.Namespace, log_dir: str) -> list[Proc]:
    procs = []
    for w in WORKLOADS:
        if w.name not in opts.models:
            continue
        for compiler in w.compilers:
            if compiler not in opts.compilers:
                continue
            stages = (
                ("setup", "measure") if compiler == "eager" else ("setup", "before", "compile", "measure")
            )
            log = os.path.join(log_dir, f"{w.name}_{compiler}.log".replace("torch.compile", "torch_compile"))
            procs.append(Proc(w, compiler, stages, log))
    return procs


def results(procs: list[Proc], orch: Orchestrator, opts: argparse.Namespace, log_dir: str) -> dict:
    rows = []
    for p in procs:
        rows.append(
            {
                "workload": p.workload.name,
                "title": p.workload.title,
                "compiler": p.compiler,
                "status": p.status,
            }
            | {
                "error": p.error,
                "stage_s": p.stage_s,
                "log": p.log,
                "log_tail": p.log_tail if p.error else "",
            }
            | p.figures
        )
    phases = dict(orch.phases, total=time.monotonic() - orch.start_time)
    versions = next((p.figures["setup"].get("versions") for p in procs if "setup" in p.figures), {})
    return {
        "small": opts.small,
        "device": opts.device,
        "versions": versions,
        "budget_s": opts.budget,
        "compile_jobs": opts.compile_jobs,
        "phases_s": phases,
        "log_dir": log_dir,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    import models_gpu_report as report

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [w.name for w in WORKLOADS]
    parser.add_argument(
        "--models", nargs="*", default=names, choices=names, metavar="WORKLOAD", help=" ".join(names)
    )
    parser.add_argument("--compilers", nargs="*", default=list(COMPILERS), choices=COMPILERS)
    parser.add_argument("--small", action="store_true", help="dry run on CPU: tiny configs, float32, 1 round")
    parser.add_argument(
        "--torch-backend",
        default="inductor",
        help="torch.compile's backend (the tests' dry run: eager, fast on CPU)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per compiler (default 5; 1 small)"
    )
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 360)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds one compile may take")
    parser.add_argument("--compile-jobs", type=int, default=None, help="processes compiling at once (0: all)")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--table", help="also write the markdown tables here")
    parser.add_argument("--log-dir", help="one log per process (default: a new temporary folder, kept)")
    opts = parser.parse_args(argv)
    opts.device = "cpu" if opts.small else "cuda"
    opts.rounds = opts.rounds or (1 if opts.small else 5)
    opts.budget = opts.budget or (300 if opts.small else 360)
    if opts.compile_jobs is None:
        opts.compile_jobs = max(1, (os.cpu_count() or 2) // 2)
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="models_gpu_logs_")
    os.makedirs(log_dir, exist_ok=True)
    procs = plan(opts, log_dir)
    root = tempfile.mkdtemp(prefix="models_gpu_caches_")
    orch = Orchestrator(procs, opts, root)

    def write(final: bool = False) -> None:
        data = results(procs, orch, opts, log_dir)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(data, f, indent=1, default=str)
        if final:
            text = report.tables(data)
            if opts.table:
                with open(opts.table, "w") as f:
                    f.write(text + "\n")
            print(text, flush=True)

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    orch.on_progress = write
    try:
        orch.run()
    except KeyboardInterrupt:
        print("interrupted: the rows measured so far follow", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what was measured is written out, whole
        orch.close()
        shutil.rmtree(root, ignore_errors=True)
        write(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
