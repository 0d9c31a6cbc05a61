"""``OptimizationReport``: what ``optimize`` rewrote, where, what it skipped or rolled back and why."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Optional

from pydantic import BaseModel, Field
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kernel_pytorch.hardware import HardwareInfo
from kernel_pytorch.verify import NOTHING_COMPARED

__all__ = ["BlockRecord", "MemoryRecord", "OptimizationReport", "RewriteRecord", "RollbackRecord", "ShapeBucketRecord",
           "SkipRecord", "VerificationRecord", "natural_order"]

# A graph dynamo captured, as capture.py names it; other records say "modules" (module passes) or "" (the model).
_CAPTURED_GRAPH = re.compile(r"graph (\d+)")


class RewriteRecord(BaseModel):
    pass_name: str
    location: str = Field(description="module path, e.g. 'layers.0.attn'")
    replacement: str
    graph: str = ""


class SkipRecord(BaseModel):
    pass_name: str
    location: str
    reason: str
    graph: str = ""


class RollbackRecord(BaseModel):
    pass_name: str
    graph: str
    reason: str


class VerificationRecord(BaseModel):
    """The end-to-end comparison of the optimized model against the original on the example inputs."""

    passed: bool
    worst: str = Field(description="the output or gradient with the largest error relative to its tolerance")
    error: float
    tolerance: float
    compared_gradients: bool = Field(description="gradients were compared (gradients_compared > 0)")
    outputs_compared: int = Field(0, description="output tensors compared")
    gradients_compared: int = Field(0, description="gradients compared (a tensor on either side)")
    identical: bool = Field(False, description="every compared tensor and value was bit-identical to the original")
    not_compared: str = Field("", description="why gradients were not compared, e.g. 'optimize ran under "
                              "torch.inference_mode()'; empty when they were or none were expected")
    rule: str = Field("tolerance", description="'tolerance': against the original; 'float32 referee': a "
                      "low-precision model judged against a float32 run of the original, within the larger of the "
                      "tolerance and NOISE_FACTOR x the original's own error against it")
    detail: str = ""


class BlockRecord(BaseModel):
    """One repeated block of one captured graph (``layers.3``: a module path up to its first index; ``""``
    is everything outside the blocks): the rewrites applied there, and its graph operations before and
    after the passes. Operations are FX call nodes, before the compiler fuses further; the GPU kernels a
    block launches are measured by benchmarks/block_fusion.py."""

    block: str
    graph: str
    rewrites: dict[str, int] = Field(default_factory=dict, description="pass name -> rewrites in this block")
    ops_before: int
    ops_after: int


class MemoryRecord(BaseModel):
    """What one memory wrapper does: ``checkpointing``, ``activation_offload`` or ``optimizer_offload``.

    Byte counts are ``None`` where nothing was measured (no example inputs yet). ``device_bytes_saved``
    is per training step: checkpointing, the saved-activation bytes before minus after; activation
    offload, the bytes moved to host memory in a forward; optimizer offload, the GPU bytes
    ``torch.optim.AdamW`` would keep for its states.
    """

    wrapper: str
    applied: bool
    description: str = Field(description="the report line")
    device_bytes_saved: int | None = None
    host_bytes: int | None = Field(None, description="host memory it uses instead (pinned for offloads)")


class ShapeBucketRecord(BaseModel):
    """One shape bucket that served calls (``optimize(..., shape_buckets=...)``; optimize's own first call on the
    example inputs included): its padded batch size and length (None: lengths are not bucketed), the calls it
    served, and the elements (batch x length of the lead input) of those calls before and after padding."""

    batch: int
    length: Optional[int] = None
    calls: int = 0
    real_elements: int = 0
    padded_elements: int = 0


class OptimizationReport(BaseModel):
    """Filled by ``optimize`` and, for graphs captured later (new shapes, graph breaks), as they are captured.

    Example::

        model = kernel_pytorch.optimize(model, example_inputs=(x,))
        report = kernel_pytorch.report_of(model)
        print(report.rewrites[0].location, report.to_dict()["skipped"])
        report.print()
    """

    hardware: Optional[HardwareInfo] = None
    backend: str = ""
    mode: str = ""
    compiler: str = ""
    graphs: int = 0
    rewrites: list[RewriteRecord] = Field(default_factory=list)
    skipped: list[SkipRecord] = Field(default_factory=list)
    rollbacks: list[RollbackRecord] = Field(default_factory=list)
    verification: Optional[VerificationRecord] = None
    notes: list[str] = Field(default_factory=list)
    memory: list[MemoryRecord] = Field(default_factory=list)
    blocks: list[BlockRecord] = Field(default_factory=list)
    timings_s: dict[str, float] = Field(default_factory=dict)
    shape_buckets: list[ShapeBucketRecord] = Field(default_factory=list, description="the shape buckets that served "
                                                   "calls, in the order first hit")

    def note(self, text: str) -> None:
        """Add ``text`` to the notes once (a path that runs at every call, or again on a copy, says it once)."""
        if text not in self.notes:
            self.notes.append(text)

    def set_note(self, prefix: str, text: str) -> None:
        """Replace the note starting with ``prefix`` by ``text`` (a line kept current, e.g. counts per call)."""
        self.notes[:] = [note for note in self.notes if not note.startswith(prefix)] + [text]

    def add_time(self, phase: str, seconds: float) -> None:
        self.timings_s[phase] = round(self.timings_s.get(phase, 0.0) + seconds, 6)

    def set_memory(self, record: MemoryRecord) -> None:
        """Add ``record``, replacing an earlier one of the same wrapper (figures measured later, e.g. at the
        first training call, replace the line written at optimize time)."""
        self.memory = [r for r in self.memory if r.wrapper != record.wrapper] + [record]

    def padding_waste(self) -> float | None:
        """Padding elements per real element over every bucketed call (0: none); None before any."""
        real = sum(b.real_elements for b in self.shape_buckets)
        return None if not real else sum(b.padded_elements for b in self.shape_buckets) / real - 1

    def verification_line(self) -> str | None:
        """The end-to-end check as the report prints it (``passed: all 3 outputs ... bit-identical ...``)."""
        return None if self.verification is None else _verification_line(self.verification, bool(self.rewrites))

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def __rich__(self) -> Group:
        return Group(*self._tables())

    def print(self, console: Console | None = None) -> None:
        (console or Console()).print(self)

    def _tables(self) -> list[Table]:
        head = Table(title="kernel_pytorch optimization", show_header=False, title_justify="left")
        head.add_row("hardware", self.hardware.summary() if self.hardware else "-")
        head.add_row("backend / mode", f"{self.backend} / {self.mode}")
        head.add_row("compiler", self.compiler or "-")
        head.add_row("graphs captured", str(self.graphs))
        if self.verification is not None:
            head.add_row("verification", Text(self.verification_line()))
        for note in self.notes:
            head.add_row("note", Text(note))
        for record in self.memory:
            head.add_row("memory", Text(record.description))
        tables = [head]
        tables += _grouped_table("rewrites", ("pass", "location", "replacement"),
                                 [((r.pass_name, r.location, r.replacement), r.graph) for r in self.rewrites])
        tables += _grouped_table("skipped", ("pass", "location", "reason"),
                                 [((s.pass_name, s.location, s.reason), s.graph) for s in self.skipped])
        tables += _grouped_table("rolled back", ("pass", "reason"),
                                 [((r.pass_name, r.reason), r.graph) for r in self.rollbacks])
        tables += _records_table(f"per block ({len(self.blocks)})",
                                 ("block", "graph", "rewrites", "graph ops before -> after"),
                                 [(b.block or "(outside blocks)", b.graph,
                                   ", ".join(f"{name} {n}" for name, n in b.rewrites.items()) or "-",
                                   f"{b.ops_before} -> {b.ops_after}") for b in self.blocks])
        tables += _records_table(self._shape_buckets_title(), ("batch", "length", "calls", "padding waste"),
                                 [(str(b.batch), "-" if b.length is None else str(b.length), str(b.calls),
                                   f"{b.padded_elements / max(b.real_elements, 1) - 1:.1%}")
                                  for b in self.shape_buckets])
        return tables

    def _shape_buckets_title(self) -> str:
        calls = sum(b.calls for b in self.shape_buckets)
        return (f"shape buckets ({len(self.shape_buckets)} hit by {calls} call{'s' if calls != 1 else ''}; padding "
                f"waste {self.padding_waste() or 0:.1%} = padding / real elements)")


def natural_order(text: str) -> tuple:
    """Sort key that orders the numbers inside ``text`` by value: ``layers.2`` before ``layers.10``; ``""`` first."""
    # re.split with a group alternates text and digit runs, so equal positions hold equal types.
    return tuple(int(part) if index % 2 else part for index, part in enumerate(re.split(r"(\d+)", text)))


def _graph_list(graphs: Iterable[str]) -> str:
    """Graph names compacted: ``graph 0-3, 7``; other names (``modules``) as they are; ``-`` for none."""
    names = set(graphs) - {""}
    numbers = sorted(int(match[1]) for match in map(_CAPTURED_GRAPH.fullmatch, names) if match)
    others = sorted((g for g in names if not _CAPTURED_GRAPH.fullmatch(g)), key=natural_order)
    spans = [f"{first}-{last}" if last > first else str(first) for first, last in _runs(numbers)]
    return ", ".join(others + ([f"graph {', '.join(spans)}"] if spans else [])) or "-"


def _runs(numbers: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``numbers`` as (first, last) runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs


def _grouped_table(title: str, columns: tuple[str, ...], records: list[tuple[tuple[str, ...], str]]) -> list[Table]:
    """One row per distinct ``columns`` values of ``records`` (values, graph): how many records and which graphs.
    Rows follow the order their pass first appears in (the pipeline's), then the location in natural order
    (where there is one), then the order of first appearance (a stable sort)."""
    graphs: dict[tuple[str, ...], list[str]] = {}
    for values, graph in records:
        graphs.setdefault(values, []).append(graph)
    pass_order: dict[str, int] = {}
    for values in graphs:
        pass_order.setdefault(values[0], len(pass_order))
    location = columns.index("location") if "location" in columns else None
    keys = sorted(graphs, key=lambda values: (pass_order[values[0]],
                                              natural_order(values[location]) if location is not None else ()))
    rows = [(*values, str(len(graphs[values])), _graph_list(graphs[values])) for values in keys]
    title = f"{title} ({len(rows)} in {len(records)} records{_scope(g for _, g in records)})"
    return _records_table(title, (*columns, "count", "graphs"), rows)


def _scope(graphs: Iterable[str]) -> str:
    """`` over 3 graphs``, `` over 3 graphs and the modules``, `` over the modules``, `` over the model``."""
    names = set(graphs)
    captured = sum(bool(_CAPTURED_GRAPH.fullmatch(g)) for g in names)
    parts = [f"{captured} graph{'s' if captured != 1 else ''}"] if captured else []
    parts += [f"the {what}" for what, present in (("modules", "modules" in names), ("model", "" in names)) if present]
    return " over " + " and ".join(parts) if parts else ""


def _verification_line(v: VerificationRecord, rewritten: bool) -> str:
    """``passed: all 3 outputs and 12 gradients bit-identical to the original``, and the like."""
    verdict = "passed" if v.passed else "FAILED"
    if v.rule != "tolerance":
        verdict += f" ({v.rule})"
    parts = ([] if rewritten else ["nothing was rewritten"]) + [_comparison_text(v)]
    if v.not_compared:
        parts.append(f"gradients not compared: {v.not_compared}")
    return f"{verdict}: " + "; ".join(parts)


def _comparison_text(v: VerificationRecord) -> str:
    counts = [f"{n} {noun}{'s' if n != 1 else ''}"
              for n, noun in ((v.outputs_compared, "output"), (v.gradients_compared, "gradient")) if n]
    if v.passed and not counts and v.worst == NOTHING_COMPARED:
        return "no tensor outputs to compare"
    if v.passed and v.identical and counts:
        every = "all " if v.outputs_compared + v.gradients_compared > 1 else ""
        return f"{every}{' and '.join(counts)} bit-identical to the original"
    if v.rule != "tolerance":
        error = v.detail
    elif v.worst == NOTHING_COMPARED:  # every error 0 without bit-identity: NaN in the same places, -0.0, a dtype
        error = "every error 0 (equal values, not bit-identical)"
    else:
        error = f"worst {v.worst} error {v.error:.2e} (tolerance {v.tolerance:.0e})"
    # A record without counts (built before they existed) says only what it knows.
    return f"{error}; {', '.join(counts)} compared" if counts else error


def _records_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[Table]:
    if not rows:
        return []
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*map(Text, row))  # plain text: rich would read "attention[sdpa]" as markup and drop it
    return [table]
