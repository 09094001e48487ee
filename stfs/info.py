"""``stfs info``: per-tensor table, per-dtype counts and totals, from headers only."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from .model import Model


def summarize(models: list[Model], transfer: dict[str, int] | None = None) -> dict[str, Any]:
    """The report of ``stfs info --json``: one entry per model, then totals over all; for remote sources,
    ``transfer``: what reading the headers cost (``{"requests": R, "bytes": B}``)."""
    reports = [_model_report(model) for model in models]
    report = {"models": reports, "totals": _totals(t for r in reports for t in r["tensors"])}
    if transfer is not None:
        report["transfer"] = transfer
    return report


def _model_report(model: Model) -> dict[str, Any]:
    tensors: list[dict[str, Any]] = [
        {
            "name": t.name,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "parameters": t.parameters,
            "bytes": t.size,
            "file": t.file,
            "offset": t.offset,
        }
        for t in model.tensors
    ]
    dtypes: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "parameters": 0, "bytes": 0})
    for row in tensors:
        counts = dtypes[row["dtype"]]
        counts["tensors"] += 1
        counts["parameters"] += row["parameters"]
        counts["bytes"] += row["bytes"]
    return {
        "source": model.path,
        "name": model.name,
        "sharded": model.is_sharded,
        "metadata": dict(model.shown_metadata),
        "tensors": tensors,
        "dtypes": dict(sorted(dtypes.items())),
        "totals": _totals(tensors),
        "warnings": list(model.warnings),
    }


def _totals(rows: Any) -> dict[str, int]:
    totals = {"tensors": 0, "parameters": 0, "bytes": 0}
    for row in rows:
        totals["tensors"] += 1
        totals["parameters"] += row["parameters"]
        totals["bytes"] += row["bytes"]
    return totals


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, ensure_ascii=False)


def render_table(report: dict[str, Any]) -> str:
    """A human-readable table per model, per-dtype counts and totals."""
    lines: list[str] = []
    for model in report["models"]:
        lines.append(f"== {model['source']}" + (f"  ({model['name']})" if model["name"] else ""))
        rows: list[tuple[str, ...]] = [("name", "dtype", "shape", "params", "file")]
        rows += [
            (printable(t["name"]), t["dtype"], _shape(t["shape"]), f"{t['parameters']:,}", _basename(t["file"]))
            for t in model["tensors"]
        ]
        lines += _columns(rows, right={3})
        lines.append("")
        counts: list[tuple[str, ...]] = [("dtype", "tensors", "params", "bytes")]
        counts += [
            (d, f"{c['tensors']:,}", f"{c['parameters']:,}", f"{c['bytes']:,}") for d, c in model["dtypes"].items()
        ]
        lines += _columns(counts, right={1, 2, 3})
        lines.append(_total_line(model["totals"]))
        lines.append("")
    if len(report["models"]) > 1:
        lines.append("all models: " + _total_line(report["totals"]))
    return "\n".join(lines).rstrip("\n")


def _total_line(totals: dict[str, int]) -> str:
    return f"total: {totals['tensors']:,} tensors, {totals['parameters']:,} parameters, {totals['bytes']:,} bytes"


def printable(name: str) -> str:
    """A name on one table row: newlines, NULs, bidi overrides and the like escaped as Python would."""
    return name if name.isprintable() else repr(name)[1:-1]


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _basename(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _columns(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(_align(cell, w, i in right) for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
        for row in rows
    ]


def _align(cell: str, width: int, right: bool) -> str:
    return cell.rjust(width) if right else cell.ljust(width)
