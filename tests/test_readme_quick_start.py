"""The README's quick start, run as written: its Python block on the CPU, and the rewrite count its text gives."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import kernel_pytorch

README = Path(__file__).resolve().parent.parent / "README.md"


def _quick_start() -> tuple[str, str]:
    """The Python block under "## Quick start" and the paragraph after it."""
    section = README.read_text().split("## Quick start", 1)[1]
    block, after = section.split("```python\n", 1)[1].split("```\n", 1)
    return block, after.strip().split("\n\n", 1)[0]


def test_the_quick_start_runs_and_its_rewrite_count_holds():
    block, text = _quick_start()
    # up to the report's print, as the text describes it; then the calls after it (generate adds its own graphs)
    optimizing, calling = block.split(".print()", 1)
    namespace: dict = {}
    exec(compile(optimizing + ".print()", str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    report = kernel_pytorch.report_of(namespace["model"])
    stated = int(re.search(r"(\d+) rewrites", text).group(1))
    assert len(report.rewrites) == stated, (len(report.rewrites), stated)
    assert len({record.graph for record in report.rewrites}) == 1 and report.verification.passed
    exec(compile(calling, str(README), "exec"), namespace)  # noqa: S102
    tokens, generated = namespace["tokens"], namespace["generated"]
    assert generated.shape == (tokens.shape[0], 16 + 32) and torch.equal(generated[:, :16], tokens[:, :16])
    assert namespace["logits"].shape == (*tokens.shape, namespace["config"].vocab_size)
