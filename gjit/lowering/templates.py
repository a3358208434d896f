"""Which matmul and attention nodes lowering makes template nodes, and why the others stay ATen
externs: the setting (GJIT_MATMUL, the backend) or, under "auto", the per-region choice
(gjit/choice/: measured on the GPU, or the table of kernels/template_wins.py). Keyed by FX
node name: a region's products (q, k and v launched as one kernel; both products of a written-out
attention) are chosen together. The choice is stored with the compiled entry (the disk cache, a
package, the remote cache), so a warm start lowers exactly as the compile that measured did.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RegionChoice:
    """One template region's choice: its matmul or attention nodes run as the template (with what
    it fused) or as ATen's kernels (plus generated kernels for what it would have fused)."""

    nodes: tuple[str, ...]  # FX names of the region's products (an attention's node)
    template: bool
    why: str  # "measured", "table", "too short to matter", "not measured: ..."
    template_ms: float | None = None  # the template kernel in its chosen configuration
    aten_ms: float | None = None  # the library's kernels plus the kernels carrying the fused work
    detail: str = ""  # the ATen side's pieces, or the table entry's provenance
    config: int = 0  # the template's tile configuration (codegen's index; gjit/tuning.py)

    def text(self) -> str:
        """`explain`'s and GJIT_LOGS=tuning's words for it."""
        side = "template" if self.template else "ATen"
        times = []
        if self.template_ms is not None:
            times.append(f"template {self.template_ms:.3f} ms")
        if self.aten_ms is not None:
            times.append(f"ATen {self.aten_ms:.3f} ms")
        figures = f": {', '.join(times)}" if times else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{side} ({self.why}{figures}){detail}"

    def record(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "nodes": list(self.nodes)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RegionChoice:
        return cls(**{**record, "nodes": tuple(record["nodes"])})


@dataclasses.dataclass(frozen=True)
class TemplateChoice:
    """`allowed`: the FX nodes that may be templates (None: every one the template takes);
    `default`: why a node outside it runs in ATen; `regions`: the per-region choices, which
    override both for their nodes."""

    allowed: frozenset[str] | None = None
    default: str = ""
    regions: tuple[RegionChoice, ...] = ()

    def reason(self, node: str) -> str | None:
        """Why the FX node `node` stays an ATen extern, or None when it may be a template."""
        for region in self.regions:
            if node in region.nodes:
                return None if region.template else f"chosen per region: {region.text()}"
        if self.allowed is not None and node not in self.allowed:
            return self.default
        return None

    def choice_of(self, node: str) -> RegionChoice | None:
        return next((r for r in self.regions if node in r.nodes), None)

    def record(self) -> dict[str, Any]:
        allowed = None if self.allowed is None else sorted(self.allowed)
        return {"allowed": allowed, "default": self.default, "regions": [r.record() for r in self.regions]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TemplateChoice:
        allowed = record["allowed"]
        return cls(
            None if allowed is None else frozenset(allowed),
            record["default"],
            tuple(RegionChoice.from_record(r) for r in record["regions"]),
        )


# the settings that allow no template (GJIT_MATMUL=aten, the cupy backend): the extern reason
# reads "matmul runs as an ATen extern (<default>)"
NO_TEMPLATES = TemplateChoice(frozenset(), "gjit.config.matmul is 'aten', or the backend is cupy")
EVERY_TEMPLATE = TemplateChoice()
