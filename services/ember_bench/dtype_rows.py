"""What `ember bench offline --compare dtype` says about `--dtype auto`'s table
(ember_core/auto_dtype.py): per setting and concurrency, bfloat16's tok/s over float32's in the
median rounds of one run, beside what the table picks on this machine for that setting. A ratio
on the other side of BFLOAT16_GAIN from the pick is the measurement for a new row, with the build
and CPU it names."""

from __future__ import annotations

from dataclasses import replace

import torch

from ember_bench.offline_runs import OfflineRun
from ember_bench.report import median_runs
from ember_core.auto_dtype import BFLOAT16_GAIN, auto_dtype_row, this_cpu


def dtype_verdicts(runs: list[OfflineRun]) -> list[str]:
    """One line per setting and concurrency that ran in float32 and in bfloat16, alike otherwise."""
    by_setting = {(run.setting, run.concurrency): run for run in median_runs([run for run in runs if run.system == "ember"])}
    lines = []
    for (setting, concurrency), float32 in by_setting.items():
        bfloat16 = by_setting.get((replace(setting, dtype="bfloat16"), concurrency))
        if setting.dtype != "float32" or bfloat16 is None:
            continue
        ratio = bfloat16.output_throughput / float32.output_throughput
        facts = this_cpu("fast" if setting.numerics == "fast" else "exact", "gguf-blocks" if setting.gguf_weights == "blocks" else "dense")
        row = auto_dtype_row(facts)
        disagrees = (ratio >= BFLOAT16_GAIN) != (row.dtype is torch.bfloat16)
        lines.append(
            f"dtype auto: bfloat16 / float32 = {ratio:.2f}x at {concurrency} sequences ({setting.numerics} numerics, "
            f"GGUF weights {setting.gguf_weights}, the {facts.build} build, {'an' if facts.cpu_has_amx else 'no'} AMX CPU); "
            f"the table picks {str(row.dtype).removeprefix('torch.')}{', WHICH THIS RUN DISAGREES WITH' if disagrees else ''} "
            f"({row.evidence})"
        )
    return lines
