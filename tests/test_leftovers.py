"""A compile leaves the process as it found it for the user's own (eager) code: no thread of its
own still running, nothing on torch's mode stacks or dispatch keys, no trace or profile hook, the
collector's thresholds, torch's thread count and grad mode as they were. (Issue 35 saw eager run
slower in a process where gjit had compiled, on a GPU; on the CPU nothing of this was left.)"""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

import gjit
import model_zoo

pytestmark = pytest.mark.cpu

# a thread torch starts, not gjit: torch.fx's Interpreter (the CPU fallback's) makes a disabled
# tqdm progress bar, whose class starts a monitor thread that sleeps
OTHERS = {"tqdm_monitor"}


def process_state() -> dict:
    import torch.overrides
    import torch.utils._python_dispatch as dispatch

    return {
        "threads": {t.name for t in threading.enumerate() if t.is_alive()} - OTHERS,
        "function modes": len(torch.overrides._get_current_function_mode_stack()),
        "dispatch modes": len(dispatch._get_current_dispatch_mode_stack()),
        "dispatch keys": (
            str(torch._C._dispatch_tls_local_include_set()),
            str(torch._C._dispatch_tls_local_exclude_set()),
        ),
        "frame evaluation": torch._C._dynamo.eval_frame.get_eval_frame_callback(),
        "trace": (sys.gettrace(), sys.getprofile()),
        "gc": (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()),
        "torch": (
            torch.get_num_threads(),
            torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(),
        ),
    }


def test_a_compile_and_generate_leave_nothing_behind():
    model, (ids,) = model_zoo.gpt2("sdpa", use_cache=True)
    n = 3
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        before = process_state()
        model.forward = gjit.compile(model.forward)
        tokens = model.generate(ids, **kwargs)
        after = process_state()
    assert torch.equal(tokens, expected)
    assert gjit.stats()["compiles"] == 2 and gjit.stats()["eager_runs"] == 0
    assert after == before
