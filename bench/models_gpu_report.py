"""The markdown tables of bench/models_gpu.py, from its JSON (`tables(data)`), the main one last.

python bench/models_gpu_report.py out.json      # the tables of an earlier run
"""

from __future__ import annotations

import json
import sys
from typing import Any

PASSES = ("lower", "attention", "fuse", "statistics", "rows", "products")
CODEGEN = ("codegen", "wrapper", "write")
NAME_WIDTH = 44


def num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def short(name: str) -> str:
    name = name.replace("|", "/")
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def figure(row: dict, stage: str, name: str, default: Any = None) -> Any:
    return (row.get(stage) or {}).get(name, default)


def kernels_cell(profile: dict | None) -> str:
    if not profile:
        return "-"
    kernels, graphs = profile["kernels_per_call"], profile.get("graph_launches_per_call", 0)
    cell = f"{kernels:.0f}" if kernels >= 10 else f"{kernels:.1f}"
    if graphs:  # the kernels ran from CUDA graphs: this many launches
        cell += f" in {graphs:g} graphs"
    return cell


def gpu_cell(profile: dict | None) -> str:
    if not profile:
        return "-"
    by = profile["ms_by_class"]
    return (
        f"{profile['gpu_ms_per_call']:.2f} ({by['matmul']:.2f} / {by['attention']:.2f} / {by['other']:.2f})"
    )


def main_table(rows: list[dict]) -> list[str]:
    lines = [
        "| workload | compiler | ms | x eager | cold s | kernels | host ms | GPU ms (mm / attn / other) "
        "| bound | eager ms: before -> after | check |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['workload']} | {row['compiler']} |"
        try:
            lines.append(head + main_cells(row))
        except Exception as e:  # a row the report cannot read is said so; the others are printed
            lines.append(f"{head} - | - | - | - | - | - | - | - | the report failed: {short(repr(e))} |")
    return lines


def main_cells(row: dict) -> str:
    if row["status"] != "finished":
        why = row.get("error") or row["status"]
        return f" - | - | - | - | - | - | - | - | {row['status']}: {short(why)} |"
    m = row["measure"]
    profile = m.get("profile")
    eager = row["compiler"] == "eager"
    speedup = m["eager_ms"] / m["ms"] if m.get("ms") else None
    before = figure(row, "before", "eager_ms")
    eager_cell = f"{num(m['eager_ms'])}" if eager else f"{num(before)} -> {num(m['eager_ms'])}"
    check = figure(row, "compile", "check", "-") if not eager else "-"
    recompiled = m.get("compiles_after", 0) - figure(row, "compile", "compiles", 0)
    if recompiled > 0:
        check += f"; {recompiled} compiles while measuring"
    if m.get("syncs_per_call"):
        check += f"; {m['syncs_per_call']:g} syncs/call"
    for what in ("host", "syncs", "profile"):
        if m.get(what + "_error"):
            check += f"; {what}: {short(m[what + '_error'])}"
    cold = figure(row, "compile", "cold_s")
    host, bound = num(m.get("host_ms")), m.get("verdict", "-")
    return (
        f" {num(m['ms'])} | {num(speedup)} | {num(cold, 1)} | {kernels_cell(profile)} "
        f"| {host} | {gpu_cell(profile)} | {bound} | {eager_cell} | {check} |"
    )


def side_by_side(rows: list[dict], columns: str, tops: Any, cell: Any) -> list[str]:
    """A table of gjit's entries next to torch.compile's, per workload: `tops(row)` the entries of
    a compiler's row (None: no row), `cell(entry)` its three cells, `columns` their three names."""
    lines = [
        f"| workload | gjit {columns} | torch.compile {columns} |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        found = {}
        for compiler in ("gjit", "torch.compile"):
            row = next((r for r in rows if r["workload"] == workload and r["compiler"] == compiler), None)
            found[compiler] = tops(row) if row else []
        for i in range(max(len(found["gjit"]), len(found["torch.compile"]))):
            cells = [cell(f[i]) if i < len(f) else "- | - | -" for f in found.values()]
            lines.append(f"| {workload if i == 0 else ''} | {cells[0]} | {cells[1]} |")
    return lines


def slowest_table(rows: list[dict]) -> list[str]:
    """The five slowest kernels of gjit next to torch.compile's, per workload."""

    def tops(row: dict) -> list[dict]:
        profile = figure(row, "measure", "profile")
        return profile["slowest"][:5] if profile else []  # the JSON keeps 30

    def cell(k: dict) -> str:
        return f"{short(k['name'])} | {k['ms_per_call']:.3f} | {k['per_call']:g}"

    return side_by_side(rows, "kernel | ms | n", tops, cell)


def host_table(rows: list[dict], top: int = 8) -> list[str]:
    """The functions the host spends a compiled call in, gjit's next to torch.compile's, per
    workload (Python's profiler: its cost inflates the many small calls; read shares)."""

    def tops(row: dict) -> list[dict]:
        return (figure(row, "measure", "host_profile") or [])[:top]

    def cell(f: dict) -> str:
        return f"{short(f['function'])} | {f['own_ms']:.3f} | {f['calls']:g}"

    return side_by_side(rows, "function | own ms | calls", tops, cell)


def stages_table(rows: list[dict]) -> list[str]:
    """gjit's cold compile by stage (all of the process's entries), and what the first call took
    besides: kernel builds that were not done in a stage, and the run."""
    lines = [
        "| workload | first call s | cold s | export | decompose | passes | codegen | tune | other stages "
        "| rest of first call | tune share | compiles | kernels built during codegen / at the first call "
        "| kernels over the tuning budget "
        "| tuning records reused |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        c = row.get("compile") or {}
        if row["compiler"] != "gjit" or "compile_seconds" not in c:
            continue
        s = c["compile_seconds"]
        groups = {
            "export": s.get("export", 0.0),
            "decompose": s.get("decompose", 0.0),
            "passes": sum(s.get(k, 0.0) for k in PASSES),
            "codegen": sum(s.get(k, 0.0) for k in CODEGEN),
            "tune": s.get("tune", 0.0),
        }
        groups["other"] = sum(s.values()) - sum(groups.values())
        rest = c["first_call_s"] - c["lock_wait_s"] - sum(s.values())
        cells = " | ".join(f"{v:.1f}" for v in groups.values())
        counts = c.get("gjit", {})
        # the bound: tuning at most a fifth of the cold compile (GJIT_TUNE_BUDGET)
        share = f"{groups['tune'] / c['first_call_s']:.0%}" if c["first_call_s"] > 0 else "-"
        lines.append(
            f"| {row['workload']} | {c['first_call_s']:.1f} | {c['cold_s']:.1f} | {cells} | {rest:.1f} "
            f"| {share} | {counts.get('compiles', '-')} "
            f"| {counts.get('kernels_built_early', 0)} / {counts.get('kernels_prebuilt', 0)} "
            f"| {counts.get('tuning_over_budget', 0)} | {counts.get('tuning_records_reused', 0)} |"
        )
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        parts = []
        for compiler in ("gjit", "torch.compile"):
            row = next((r for r in rows if r["workload"] == workload and r["compiler"] == compiler), None)
            m = (row or {}).get("measure") or {}
            profile = m.get("profile")
            if not profile or m.get("host_ms") is None:
                continue
            sign = ">=" if m["verdict"] == "host-bound" else "<"
            gpu = profile["gpu_ms_per_call"]
            parts.append(f"{compiler} {m['verdict']} (host {m['host_ms']:.2f} ms {sign} GPU {gpu:.2f} ms)")
        if parts:
            lines.append(f"- {workload}: " + "; ".join(parts))
    return lines


def tables(data: dict) -> str:
    rows = data["rows"]
    v = data.get("versions") or {}
    unit = "ms per call (generate(): per token; host ms and syncs: per decode step)"

    def section(fn, *args) -> list[str]:
        try:
            return fn(*args)
        except Exception as e:  # the main table still comes
            return [f"(this table failed: {e!r})"]

    machine = f"{v.get('device', '?')} ({v.get('cpus', '?')} CPUs)"
    out = [
        f"## bench/models_gpu.py on {machine}, torch {v.get('torch', '?')}, Triton {v.get('triton', '?')}, "
        f"transformers {v.get('transformers', '?')}" + (" (--small)" if data["small"] else ""),
        "",
        "gjit's cold compile by stage (s):",
        "",
        *section(stages_table, rows),
        "",
        "Five slowest kernels per call (ms per call, launches per call):",
        "",
        *section(slowest_table, rows),
        "",
        "Host- or kernel-bound (the CPU's ms to enqueue a call against its kernels' GPU ms):",
        "",
        *section(verdicts, rows),
        "",
        "Where the host's time goes: functions by their own time per call (Python's profiler, whose "
        "cost inflates the many small calls: read shares, not times):",
        "",
        *section(host_table, rows),
        "",
    ]
    phases = data["phases_s"]
    spent = ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
    jobs = data["compile_jobs"] or "all"
    out.append(f"Budget {data['budget_s']:.0f} s ({jobs} compiles at once): {spent}. Logs: {data['log_dir']}")
    out += ["", f"Rows ({unit}):", "", *main_table(rows)]
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(tables(json.load(f)))
