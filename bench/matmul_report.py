"""Matmul and attention templates against ATen externs, on the tiny real models of tests/model_zoo.py.

    .venv/bin/python bench/matmul_report.py        # prints a markdown table (docs/models.md)

Per model, the same compile with `gjit.config.matmul = "aten"` (every matmul an extern) and with
`"template"` (every one a template kernel): kernels, externs, launches (both), matmul and
attention kernels, kernels that only copy a tensor (a `clone` feeding a matmul in the extern
case), and modeled bytes against the ideal (each input read once, each output written once).
Kernels run in Triton's interpreter.
"""

from __future__ import annotations

import os
import sys

import torch

import gjit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from model_zoo import MODELS  # noqa: E402


def measure(name: str, setting: str) -> dict:
    model, inputs = MODELS[name]()
    with torch.no_grad(), gjit.config.scope(matmul=setting, interpret=True, cache=False):
        cm = gjit.compile(model)
        cm(*inputs)
        report = gjit.explain(cm, *inputs)
    kernels = [k.name for k in report.kernels]
    traffic = report.traffic
    return {
        "kernels": len(kernels),
        "externs": len(report.externs),
        "matmul kernels": sum(k.startswith("gjit_mm_") for k in kernels),
        "attention kernels": sum(k.startswith("gjit_attn_") for k in kernels),
        "copies": sum(k.startswith("gjit_poi_fused_clone_") for k in kernels),
        "bytes/ideal": traffic.gjit / traffic.ideal,
    }


def main() -> None:
    head = (
        "| model | kernels + externs (aten -> template) | matmul / attention kernels | copy kernels "
        "| bytes / ideal |"
    )
    print(head)
    print("|---|---|---:|---|---|")
    for name in MODELS:
        a, t = measure(name, "aten"), measure(name, "template")
        print(
            f"| {name} | {a['kernels']} + {a['externs']} -> {t['kernels']} + {t['externs']} "
            f"| {t['matmul kernels']} / {t['attention kernels']} | {a['copies']} -> {t['copies']} "
            f"| {a['bytes/ideal']:.2f} -> {t['bytes/ideal']:.2f} |"
        )


if __name__ == "__main__":
    main()
