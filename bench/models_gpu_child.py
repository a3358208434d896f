"""One process of bench/models_gpu.py: one workload under one compiler, a stage at a time.

    python bench/models_gpu_child.py SPEC_JSON FD

The parent starts it with empty caches of its own and paces it: after each stage it writes one
JSON line on the file descriptor FD ({"stage", "status": "done" | "error" | "n/a", "figures"}),
then waits on stdin for `go <stage>` (or `stop`). Stages: setup (the model, a float32 reference,
eager's first calls), before (eager's rounds before any compile), compile (the first compiled
call, checked), measure (eager and compiled rounds alternately, host time, syncs, a profile).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any

import torch

START = time.monotonic()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import gpu_profile as gp  # noqa: E402

import model_zoo  # noqa: E402

# the real configs (transformers' defaults where not given) and the dry run's tiny ones
LLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
)
TINY = {
    "gpt2": dict(vocab_size=model_zoo.VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4),
    "llama": dict(model_zoo._DECODER, num_key_value_heads=2),
    "bert": dict(model_zoo._ENCODER),
}
ROUND_S = 0.1  # a timed round of forward calls lasts about this long
HOST_CALLS = 20  # calls whose enqueue time is measured
PROFILED_CALLS = 3


def build(w: dict, small: bool, device: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The workload's model (random weights, eval mode, its dtype) and its token ids, on `device`."""
    import transformers as tf

    torch.manual_seed(0)
    forward = not w["new_tokens"]
    tiny = TINY[w["model"]] if small else {}
    if w["model"] == "gpt2":
        config, cls = tf.GPT2Config(**tiny, use_cache=not forward), tf.GPT2LMHeadModel
    elif w["model"] == "llama":
        config, cls = tf.LlamaConfig(**(tiny or LLAMA) | {"use_cache": not forward}), tf.LlamaForCausalLM
    else:
        config, cls = tf.BertConfig(**tiny), tf.BertModel
    with torch.device(device):
        model = cls(config)
    model = model.eval().to(torch.float32 if small else getattr(torch, w["dtype"]))
    sizes = model_zoo_sizes(w, small)
    ids = torch.randint(0, config.vocab_size, sizes, device=device)
    return model, ids


def model_zoo_sizes(w: dict, small: bool) -> tuple[int, int]:
    if not small:
        return (w["batch"], w["seq"])
    return (1, 4) if w["new_tokens"] else (model_zoo.BATCH, model_zoo.SEQ)


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return next(v for v in out.values() if isinstance(v, torch.Tensor))


def versions(device: str) -> dict[str, str]:
    import transformers
    import triton

    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    return {
        "device": name,
        "cpus": str(os.cpu_count()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


class Child:
    def __init__(self, spec: dict):
        self.spec, self.w = spec, spec["workload"]
        self.compiler, self.device, self.small = spec["compiler"], spec["device"], spec["small"]
        self.sync = gp.synchronizer(self.device)
        self.cuda = self.device.startswith("cuda")
        self.new_tokens = (4 if self.small else self.w["new_tokens"]) if self.w["new_tokens"] else 0
        self.per = self.new_tokens or 1  # ms per token for generate()
        self.compiled: Any = None
        self.lock_wait = 0.0

    # -- what a call is ----------------------------------------------------------------------------

    def fn(self, compiled: bool):
        """A zero-argument call of the workload: eager's or the compiled one's."""
        if not self.new_tokens:
            target = self.compiled if compiled else self.model
            return lambda: target(self.ids)
        forward = self.compiled if compiled else self.eager_forward

        def generate():
            self.model.forward = forward
            return self.model.generate(self.ids, **self.kwargs)

        return generate

    def rounds(self, fn, n: int) -> list[float]:
        return [gp.time_round(fn, self.number, self.sync) / self.per for _ in range(n)]

    # -- stages ------------------------------------------------------------------------------------

    def setup(self) -> dict:
        torch.set_grad_enabled(False)
        self.model, self.ids = build(self.w, self.small, self.device)
        figures = {
            "versions": versions(self.device),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }
        reference = copy.deepcopy(self.model).float()  # the same weights, float32 math
        if self.new_tokens:
            self.reference_model = reference
            self.eager_forward = self.model.forward
            n = self.new_tokens
            eos = self.model.config.eos_token_id
            self.kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=eos)
            self.kwargs |= {"attention_mask": torch.ones_like(self.ids), "disable_compile": True}
            if self.w["cache"]:
                self.kwargs["cache_implementation"] = self.w["cache"]
        else:
            self.reference = first_tensor(reference(self.ids)).float()
            del reference
        eager = self.fn(compiled=False)
        start = time.perf_counter()
        out = eager()
        self.sync()
        figures["eager_first_s"] = self.eager_first_s = time.perf_counter() - start
        if self.new_tokens:
            self.expected = out
        else:
            figures["eager_err"] = self.eager_err = gp.rel_err(first_tensor(out), self.reference)
        del out
        one = gp.time_round(eager, 1, self.sync)  # warm: cuBLAS's and the allocator's first calls are done
        self.number = 1 if self.new_tokens or self.small else max(1, min(100, math.ceil(ROUND_S * 1e3 / one)))
        figures["calls_per_round"] = self.number
        return figures

    def before(self) -> dict:
        n = min(self.spec["rounds"], 2) if self.new_tokens else self.spec["rounds"]
        ms = self.rounds(self.fn(compiled=False), n)
        return {"eager_ms_rounds": ms, "eager_ms": statistics.median(ms)}

    def compile(self) -> dict:
        self.install_lock(self.spec["lock"])
        mode = self.w["mode"]
        target = self.eager_forward if self.new_tokens else self.model
        figures: dict[str, Any] = {}
        if self.compiler == "gjit":
            import gjit

            gjit.reset()
            if self.spec["interpret"]:
                gjit.config.interpret = True
            self.compiled = gjit.compile(target, mode=mode) if mode else gjit.compile(target)
            figures["interpret"] = gjit.config.interpret
        else:
            torch._dynamo.utils.counters.clear()
            backend = self.spec["torch_backend"]
            options = {"mode": mode} if mode else {} if backend == "inductor" else {"backend": backend}
            self.compiled = torch.compile(target, **options)
        start = time.perf_counter()
        out = self.fn(compiled=True)()
        self.sync()
        figures["first_call_s"] = first = time.perf_counter() - start
        figures["lock_wait_s"] = self.lock_wait
        figures["cold_s"] = first - self.eager_first_s - self.lock_wait
        figures |= self.check(out)
        del out
        for _ in range(1 if self.new_tokens or self.small else 2):  # warm: reduce-overhead records its graphs
            self.fn(compiled=True)()
        self.sync()
        figures |= self.compiler_stats()
        figures["compiles"] = self.compiles()
        return figures

    def measure(self) -> dict:
        # `is None`, never truth: torch.compile's module wrapper has no len()
        has_compiled = self.compiled is not None
        eager, compiled = self.fn(compiled=False), self.fn(compiled=True) if has_compiled else None
        eager_ms, compiled_ms = [], []
        for _ in range(min(self.spec["rounds"], 3) if self.new_tokens else self.spec["rounds"]):
            eager_ms += self.rounds(eager, 1)
            if compiled is not None:
                compiled_ms += self.rounds(compiled, 1)
        ms = compiled_ms or eager_ms
        figures = {"ms_rounds": ms, "ms": statistics.median(ms), "eager_ms_rounds": eager_ms}
        figures["eager_ms"] = statistics.median(eager_ms)
        call = compiled if compiled is not None else eager
        # the figures below are each one of several: one that fails is said, the others stand
        if self.new_tokens:
            forward = self.compiled if has_compiled else self.eager_forward
            attempt(figures, "host", lambda: self.decode_steps(forward))
        else:
            calls = 1 if self.small else HOST_CALLS
            attempt(figures, "host", lambda: {"host_ms": gp.host_ms(call, calls, self.sync)})
            if self.cuda:
                attempt(figures, "syncs", lambda: {"syncs_per_call": gp.syncs_in(call, self.device)[1]})
        calls = 1 if self.new_tokens or self.small else PROFILED_CALLS
        attempt(figures, "profile", lambda: {"profile": self.profile(call, calls)})
        if has_compiled:  # where the compiled call's host time goes (Python's profiler)
            attempt(figures, "host_profile", lambda: {"host_profile": gp.host_profile(call, calls, self.per)})
        if "profile" in figures and "host_ms" in figures:
            figures["verdict"] = gp.verdict(figures["host_ms"], figures["profile"]["gpu_ms_per_call"])
        if has_compiled:  # a compile while measuring would be in the figures: said here
            figures["compiles_after"] = self.compiles()
        return figures

    def profile(self, call, calls: int) -> dict:
        summary = gp.summarize(gp.profile(call, calls, self.device), calls * self.per)
        if not summary["kernels_per_call"]:
            raise RuntimeError("the profiler saw no kernels")  # CUPTI missing or not allowed
        return summary

    # -- pieces ------------------------------------------------------------------------------------

    def decode_steps(self, forward) -> dict:
        """generate() with each forward call timed (entry to return: generate() synchronizes every
        token, so a call starts on an idle GPU), then with its syncs counted: decode steps' medians."""
        times: list[float] = []
        syncs: list[int] = []

        @functools.wraps(forward)  # generate() passes what the forward's signature takes
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = forward(*args, **kwargs)
            times.append(time.perf_counter() - start)
            return out

        @functools.wraps(forward)
        def counted(*args, **kwargs):
            out, n = gp.syncs_in(lambda: forward(*args, **kwargs), self.device)
            syncs.append(n or 0)
            return out

        def run(wrapper) -> None:
            self.sync()
            self.model.forward = wrapper
            self.model.generate(self.ids, **self.kwargs)

        run(timed)
        steps = times[1:] or times  # the first call is the prefill
        figures = {"host_ms": statistics.median(steps) * 1e3, "prefill_host_ms": times[0] * 1e3}
        if self.cuda:

            def count() -> dict:
                run(counted)
                return {"syncs_per_call": statistics.median(syncs[1:] or syncs)}

            attempt(figures, "syncs", count)
        return figures

    def check(self, out: Any) -> dict:
        if not self.new_tokens:
            err = gp.rel_err(first_tensor(out), self.reference)
            ok = gp.output_ok(err, self.eager_err)
            text = f"{'OK' if ok else 'WRONG'}: err {err:.1e} (eager {self.eager_err:.1e})"
            return {"err": err, "eager_err": self.eager_err, "ok": ok, "check": text}
        at = gp.first_difference(out, self.expected)
        if at is None:
            return {"ok": True, "check": "OK: tokens equal"}
        if out.shape != self.expected.shape:
            return {
                "ok": False,
                "check": f"WRONG: {tuple(out.shape)} tokens, eager {tuple(self.expected.shape)}",
            }
        prefix = self.expected[:, :at]
        logits = first_tensor(self.eager_forward(input_ids=prefix))[0, -1]
        reference = first_tensor(self.reference_model(prefix))[0, -1]
        chosen, expected = int(out[0, at]), int(self.expected[0, at])
        tie, gap, err = gp.near_tie(logits, reference, chosen, expected)
        where = f"token {at - self.ids.shape[1]}: gap {gap:.2g}, eager's error {err:.2g}"
        return {"ok": tie, "check": f"{'OK (near tie' if tie else 'WRONG (differs'} at {where})"}

    def compiles(self) -> int:
        if self.compiler == "gjit":
            import gjit

            return gjit.stats()["compiles"]
        return torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def compiler_stats(self) -> dict:
        if self.compiler == "gjit":
            import gjit

            stats = gjit.stats()
            entries = getattr(self.compiled, "entries", [])
            return {
                "gjit": {k: v for k, v in stats.items() if isinstance(v, int)},
                "compile_seconds": stats["compile_seconds"],
                "entry_timings": [dict(e.program.timings) for e in entries],
                "eager_reason": str(getattr(self.compiled, "eager_reason", None) or ""),
            }
        counters = torch._dynamo.utils.counters
        return {
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }

    def install_lock(self, path: str) -> None:
        """Measurements a compile makes on the GPU (gjit's tuning, Inductor's autotuning) hold a
        lock shared by the run's processes, so no two overlap; the wait is kept out of compile s."""
        lock = open(path, "a")  # noqa: SIM115 - held for the process's life
        depth = [0]

        def locked(fn):
            @functools.wraps(fn)
            def run(*args, **kwargs):
                if depth[0] == 0:
                    start = time.perf_counter()
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    self.lock_wait += time.perf_counter() - start
                depth[0] += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:
                        fcntl.flock(lock, fcntl.LOCK_UN)

            return run

        if self.compiler == "gjit":
            from gjit import tuning

            tuning.bench = locked(tuning.bench)
            return
        with contextlib.suppress(ImportError, AttributeError):
            from torch._inductor.runtime.benchmarking import benchmarker

            for name in ("benchmark_gpu", "benchmark"):
                if hasattr(benchmarker, name):
                    setattr(benchmarker, name, locked(getattr(benchmarker, name)))


def attempt(figures: dict, name: str, fn) -> None:
    """figures |= fn(), or figures[name + "_error"] saying why not."""
    try:
        figures |= fn()
    except Exception as e:
        traceback.print_exc()
        figures[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def not_available(spec: dict) -> str | None:
    """Why this row cannot run here: gjit without torch's mode= (another branch builds it)."""
    if spec["compiler"] == "gjit" and spec["workload"]["mode"]:
        import gjit

        if "mode" not in inspect.signature(gjit.compile).parameters:
            return "gjit has no mode="
    return None


def main() -> int:
    spec = json.loads(sys.argv[1])
    channel = os.fdopen(int(sys.argv[2]), "w", buffering=1)

    def send(**msg) -> None:
        channel.write(json.dumps(msg, default=str) + "\n")
        channel.flush()

    child = Child(spec)
    for stage in spec["stages"]:
        if stage != "setup" and sys.stdin.readline().split()[:1] != ["go"]:
            return 0  # stop, or the parent is gone
        print(f"== {stage} (t+{time.monotonic() - START:.1f} s)", flush=True)
        try:
            reason = not_available(spec) if stage == "setup" else None
            if reason:
                send(stage=stage, status="n/a", reason=reason)
                return 0
            figures = getattr(child, stage)()
        except Exception as e:
            traceback.print_exc()
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            send(stage=stage, status="error", error=error[:300], traceback=traceback.format_exc()[-4000:])
            return 1
        print(json.dumps(figures, default=str)[:2000], flush=True)
        send(stage=stage, status="done", figures=figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
