"""Convolutions as the library runs them fastest on a GPU: the bias added by the kernel after
them, and 2-D and 3-D convolutions in the channels-last layout where the program's convolutions
favor it (gjit/lowering/channels_last.py lays them out).

Both are the driver's `convolutions` pass, before lowering, on the FX graph.

**The bias.** ATen's cuDNN convolution computes without the bias and then adds it in a kernel of its
own (`output.add_(bias)`): the output read and written once more, and a launch. A convolution is
nearly always followed by pointwise work (a batch norm, an activation, a residual add), so here the
call runs without its bias and an `add` of the bias viewed as [C, 1, ...] follows it, which fusion
puts into that work's kernel. Only where the add keeps the convolution's layout and dtype.

**The layout.** Which programs: where cuDNN runs the convolutions (the library decides their
outputs' layouts: an entry with convolutions holds its flag as it compiled, `conv_library`), in
16-bit or float32, 2-D and 3-D convolutions are at least two and the dense ones (groups 1) do at
least half of their work (grouped and depthwise convolutions gain less, or lose, channels-last).
A program with one convolution (a vision transformer's patch embedding) keeps its layout: two
copies for one call's gain.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch

from gjit.compat import optimization_hint
from gjit.lowering.attention_layout import same_layout
from gjit.lowering.channels_last import CHANNELS_LAST, CONVOLUTION, channels_last, fake_mode_of

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten
NHWC_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # cuDNN keeps float64 NCHW


# which library runs ATen's convolutions on a device decides their outputs' layouts (cuDNN, oneDNN:
# channels-last for a channels-last input; their fallbacks: often contiguous), so an entry with
# convolutions holds the flag's value at compile time (its guard): the expression and its value now
CONV_LIBRARIES = {
    "cudnn": (
        "torch.backends.cudnn.enabled and torch.backends.cudnn.is_available()",
        lambda: bool(torch.backends.cudnn.enabled and torch.backends.cudnn.is_available()),
    ),
    "mkldnn": (
        "torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()",
        lambda: bool(torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()),
    ),
}


def conv_library(gm: torch.fx.GraphModule, on_gpu: bool) -> tuple[str, bool] | None:
    """The library flag `gm`'s convolutions run under and its value now (cuDNN on a GPU, oneDNN on
    the CPU), or None where `gm` has no convolution."""
    if not gm.graph.find_nodes(op="call_function", target=CONVOLUTION):
        return None
    name = "cudnn" if on_gpu else "mkldnn"
    return name, CONV_LIBRARIES[name][1]()


@contextlib.contextmanager
def conv_library_as(library: tuple[str, bool] | None) -> Iterator[None]:
    """The library flag set as a compile found it, for a reanalysis that traces convolutions again
    (explain or a dump of a cached entry after the user turned cuDNN off); put back after."""
    if library is None or CONV_LIBRARIES[library[0]][1]() == library[1]:
        yield
        return
    get, set_ = {
        "cudnn": (torch._C._get_cudnn_enabled, torch._C._set_cudnn_enabled),
        "mkldnn": (torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled),
    }[library[0]]
    before = get()
    set_(library[1])
    try:
        yield
    finally:
        set_(before)


def library_convolutions(
    gm: torch.fx.GraphModule, setting: str, on_gpu: bool, library: tuple[str, bool] | None = None
) -> tuple[int, int]:
    """The pass: on a GPU (or everywhere under "channels_last"), each convolution's bias peeled off
    and the program's 2-D and 3-D convolutions channels-last where the `library` flag says cuDNN
    runs them (the kernels that return channels-last for such inputs: `conv_library`) and
    `worth_channels_last` (always under "channels_last"); nothing under "traced". How many biases
    and convolutions changed."""
    if setting == "traced" or not (on_gpu or setting == "channels_last"):
        return 0, 0
    peeled = peel_biases(gm)
    convs = [c for c in spatial_convolutions(gm) if c.meta["val"].dtype in NHWC_DTYPES]
    laid = 0
    cudnn = library == ("cudnn", True)
    if convs and (setting == "channels_last" or (cudnn and worth_channels_last(convs))):
        laid = channels_last(gm, convs)
    if peeled or laid:
        gm.graph.lint()
        gm.recompile()
    return peeled, laid


def peel_biases(gm: torch.fx.GraphModule) -> int:
    """Each convolution with a bias as the convolution without it plus an add of the bias viewed
    over the output's channels, where the add keeps the output's layout and dtype; how many."""
    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=CONVOLUTION)):
        bias = node.args[2]
        val = node.meta.get("val")
        bval = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(bval, torch.Tensor):
            continue
        if bval.dim() != 1 or bval.dtype != val.dtype or not isinstance(bval.shape[0], int):
            continue
        shape = [bval.shape[0]] + [1] * (val.dim() - 2)
        with fake_mode_of(val):
            view_val = aten.view.default(bval, shape)
            add_val = aten.add.Tensor(val, view_val)
        if not same_layout(add_val, val):
            continue
        graph = gm.graph
        with graph.inserting_after(node):
            conv = graph.call_function(CONVOLUTION, (node.args[0], node.args[1], None, *node.args[3:]))
        with graph.inserting_after(conv):
            view = graph.call_function(aten.view.default, (bias, shape))
        with graph.inserting_after(view):
            add = graph.call_function(aten.add.Tensor, (conv, view))
        node.replace_all_uses_with(add)
        for new, value in ((conv, val), (view, view_val), (add, add_val)):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            new.meta["val"] = value
        graph.erase_node(node)
        done += 1
    if done:
        log.info("convolutions: %d bias(es) added by the kernel after the convolution", done)
    return done


def spatial_convolutions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The convolutions over 4-D and 5-D tensors (images, volumes) with a floating-point value."""
    convs = []
    for node in gm.graph.find_nodes(op="call_function", target=CONVOLUTION):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() in CHANNELS_LAST and val.dtype.is_floating_point:
            convs.append(node)
    return convs


def worth_channels_last(convs: list[torch.fx.Node]) -> bool:
    """At least two such convolutions, the dense ones (groups 1) doing at least half of their
    multiply-adds at the example's sizes."""
    if len(convs) < 2:
        return False
    dense = grouped = 0
    for node in convs:
        work = _multiply_adds(node)
        if node.args[8] == 1:
            dense += work
        else:
            grouped += work
    return dense >= grouped


def _hint(size) -> int:
    """A size at the example's values (without one: 1)."""
    return optimization_hint(size, fallback=1)


def _multiply_adds(node: torch.fx.Node) -> int:
    """Output elements times the input channels and kernel elements each reads (a transposed
    convolution's weight is [in, out / groups, ...]), at the example's sizes."""
    out, weight = node.meta["val"], node.args[1].meta["val"]
    transposed, groups = node.args[6], node.args[8]
    channels = _hint(weight.shape[0]) // groups if transposed else _hint(weight.shape[1])
    per_output = channels * math.prod(_hint(s) for s in weight.shape[2:])
    return math.prod(_hint(s) for s in out.shape) * per_output
