"""GJIT_LOGS: TORCH_LOGS-style artifacts on the standard logging module.

Every artifact is a logger `gjit.<name>`, registered here with a one-line description.

    GJIT_LOGS="recompiles,+dynamic,guards" python train.py
    gjit.set_logs("fusion,output_code")        # the same from Python
    gjit.set_logs(dynamic=logging.DEBUG)       # keyword form, as torch._logging.set_logs
    GJIT_LOGS=help                             # prints the artifacts and exits the parse

`name` logs the artifact at INFO, `+name` at DEBUG (more detail), `-name` only its warnings;
`all` (or `+all`) is every artifact. Without GJIT_LOGS nothing is printed apart from warnings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

from gjit import progress

ARTIFACTS: dict[str, str] = {
    "graph": "the exported ATen graph after decomposition, with shapes like f32[s0, 64] (+graph: before too)",
    "dynamic": "size symbols export creates and every guard it adds, with the user line that caused it",
    "guards": "the full guard set of each new entry, one readable line per guard",
    "recompiles": "each recompile: the nearest entry's failed guards and the decision; each eager fallback",
    "fusion": "regions formed, and every refusal as 'cannot fuse A with B: reason' (+fusion: inlining)",
    "passes": "each compile pass (lower, fuse, codegen, wrapper, write) with the time it took",
    "output_code": "where each generated kernel and wrapper was written, and their source",
    "cache": "hits and misses of the in-memory entry cache and the on-disk source/kernel cache",
    "perf_hints": "what costs performance: externs between kernels, looped reductions, strided loads, "
    "int64 offsets, dims export specialized",
    "lowering": "every node that became an ATen extern, and why",
    "capture": "export attempts, retries with static shapes, capture failures",
    "check": "GJIT_CHECK's per-region error table (kernel vs eager fallback)",
    "tuning": "each template kernel's configurations with their times, and each region's template or ATen",
    "cudagraphs": "mode='reduce-overhead': each CUDA graph recorded or dropped, and why calls run without "
    "one (once per reason and entry)",
}

_HANDLER: logging.Handler | None = None
# artifacts not enabled stay quiet even when the application logs at INFO: only warnings pass
logging.getLogger("gjit").setLevel(logging.WARNING)


def logger(name: str) -> logging.Logger:
    assert name in ARTIFACTS, f"unregistered log artifact {name!r}"
    return logging.getLogger(f"gjit.{name}")


def error_line(e: BaseException) -> str:
    """An exception in one line for a log: its type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def parse(spec: str) -> dict[str, int]:
    """'recompiles,+dynamic,-fusion' -> {artifact: level}. Unknown names raise with the list."""
    levels: dict[str, int] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        level = logging.INFO
        if item[0] in "+-":
            level = logging.DEBUG if item[0] == "+" else logging.WARNING
            item = item[1:]
        names = list(ARTIFACTS) if item == "all" else [item]
        for name in names:
            if name not in ARTIFACTS:
                raise ValueError(f"unknown GJIT_LOGS artifact {name!r}; known:\n{help_text()}")
            levels[name] = level
    return levels


def help_text() -> str:
    width = max(map(len, ARTIFACTS))
    lines = [f"  {name:<{width}}  {doc}" for name, doc in ARTIFACTS.items()]
    return "\n".join(lines + ["  name: INFO, +name: DEBUG, -name: warnings only, all: every artifact"])


def set_logs(spec: str | None = None, **artifacts: bool | int) -> None:
    """Enable artifacts: `set_logs("recompiles,+dynamic")` or `set_logs(dynamic=logging.DEBUG)`
    (True means INFO, False turns an artifact off). Replaces what was set before; `set_logs()`
    turns everything off."""
    if spec is not None and spec.strip() == "help":
        print(f"GJIT_LOGS artifacts:\n{help_text()}", file=sys.stderr)
        return
    levels = parse(spec or "")
    for name, value in artifacts.items():
        if name not in ARTIFACTS:
            raise ValueError(f"unknown gjit log artifact {name!r}; known:\n{help_text()}")
        if value is True:
            levels[name] = logging.INFO
        elif value is not False:
            levels[name] = int(value)
    for name in ARTIFACTS:
        logger(name).setLevel(levels.get(name, logging.NOTSET))
    _install_handler(bool(levels))


class _Handler(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        progress.clear_line()  # a record on its own line; the progress line comes back after it
        super().emit(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        artifact = record.name.removeprefix("gjit.")
        text = super().format(record)
        return "\n".join(f"[gjit.{artifact}] {line}" for line in text.splitlines())


def _install_handler(on: bool) -> None:
    """One stderr handler on the `gjit` logger while artifacts are enabled; records do not also
    propagate to the application's handlers meanwhile (no line printed twice)."""
    global _HANDLER
    root = logging.getLogger("gjit")
    if on and _HANDLER is None:
        _HANDLER = _Handler(sys.stderr)
        _HANDLER.setFormatter(_Formatter("%(message)s"))
        root.addHandler(_HANDLER)
        root.propagate = False
    elif not on and _HANDLER is not None:
        root.removeHandler(_HANDLER)
        root.propagate = True
        _HANDLER = None


def init_from_env() -> None:
    spec = os.environ.get("GJIT_LOGS")
    if spec:
        set_logs(spec)


class _Forward(logging.Handler):
    def __init__(self, target: logging.Logger):
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if self.target.isEnabledFor(record.levelno):
            text = record.getMessage().split(", for more info run with TORCHDYNAMO_")[0]
            self.target.log(record.levelno, "%s", text)


@contextlib.contextmanager
def torch_dynamic_logs() -> Iterator[None]:
    """While export runs, torch's symbolic-shapes log (create_symbol, [guard added]) goes to the
    `dynamic` artifact: the lines TORCH_LOGS=dynamic users know, under gjit's switch."""
    target = logger("dynamic")
    if not target.isEnabledFor(logging.INFO):
        yield
        return
    source = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    saved = source.level, source.propagate, list(source.handlers)
    source.handlers = [_Forward(target)]  # torch's own handlers would print the lines a second time
    source.setLevel(logging.DEBUG if target.isEnabledFor(logging.DEBUG) else logging.INFO)
    source.propagate = False
    try:
        yield
    finally:
        source.setLevel(saved[0])
        source.propagate = saved[1]
        source.handlers = saved[2]


# torch modules that log errors (with tracebacks) while a trace fails; the failure itself reaches
# the user once, as gjit's capture message
_TRACE_LOGGERS = (
    "torch._subclasses.fake_tensor",
    "torch.export",
    "torch._export",
    "torch.fx.experimental.symbolic_shapes",
    "torch.fx.experimental.proxy_tensor",
)


class _ToCapture(logging.Filter):
    """Keeps a torch record from torch's handlers; gjit's capture artifact gets it at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        target = logger("capture")
        if target.isEnabledFor(logging.DEBUG):
            target.debug("[%s] %s", record.name, record.getMessage())
        return False


@contextlib.contextmanager
def quiet_torch_trace_errors() -> Iterator[None]:
    """While export and decomposition run, the warnings and errors torch's tracing modules log
    (a failed meta kernel's traceback, export's case notes) go to GJIT_LOGS=+capture only."""
    quiet = _ToCapture()
    loggers = [logging.getLogger(name) for name in _TRACE_LOGGERS]
    for source in loggers:
        source.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            # torch's own pytree deprecation, raised from copying a TreeSpec inside export
            warnings.filterwarnings(
                "ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning
            )
            yield
    finally:
        for source in loggers:
            source.removeFilter(quiet)
