"""``OptimizationReport``: what ``optimize`` rewrote, where, what it skipped or rolled back and why."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, Field
from rich.console import Console, Group
from rich.table import Table

from kernel_pytorch.hardware import HardwareInfo

__all__ = ["BlockRecord", "MemoryRecord", "OptimizationReport", "RewriteRecord", "RollbackRecord", "SkipRecord",
           "VerificationRecord"]


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
    compared_gradients: bool
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

    def add_time(self, phase: str, seconds: float) -> None:
        self.timings_s[phase] = round(self.timings_s.get(phase, 0.0) + seconds, 6)

    def set_memory(self, record: MemoryRecord) -> None:
        """Add ``record``, replacing an earlier one of the same wrapper (figures measured later, e.g. at the
        first training call, replace the line written at optimize time)."""
        self.memory = [r for r in self.memory if r.wrapper != record.wrapper] + [record]

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
            v = self.verification
            verdict = "passed" if v.passed else "FAILED"
            if v.rule == "tolerance":
                head.add_row("verification", f"{verdict}: worst {v.worst} error {v.error:.2e} (tolerance {v.tolerance:.0e})")
            else:
                head.add_row("verification", f"{verdict} ({v.rule}): {v.detail}")
        for note in self.notes:
            head.add_row("note", note)
        for record in self.memory:
            head.add_row("memory", record.description)
        tables = [head]
        tables += _records_table("rewrites", ("pass", "location", "replacement"),
                                 [(r.pass_name, r.location, r.replacement) for r in self.rewrites])
        tables += _records_table("skipped", ("pass", "location", "reason"),
                                 [(s.pass_name, s.location, s.reason) for s in self.skipped])
        tables += _records_table("rolled back", ("pass", "graph", "reason"),
                                 [(r.pass_name, r.graph, r.reason) for r in self.rollbacks])
        tables += _records_table("per block", ("block", "graph", "rewrites", "graph ops before -> after"),
                                 [(b.block or "(outside blocks)", b.graph,
                                   ", ".join(f"{name} {n}" for name, n in b.rewrites.items()) or "-",
                                   f"{b.ops_before} -> {b.ops_after}") for b in self.blocks])
        return tables


def _records_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[Table]:
    if not rows:
        return []
    table = Table(title=f"{title} ({len(rows)})", title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return [table]
