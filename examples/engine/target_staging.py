"""Staging a captured target pass straight into its graph's own input buffers (issue 20).

A decode or verify pass of n rows replays the CUDA graph of its bucket, whose program reads its
int32 inputs (tokens, positions, block tables, live rows, active) from one packed device region
(runners/int_region.py). `TargetStaging` keeps a pinned host mirror of that region with every
row past n at its neutral value (an inert row: active 0, tables at the scratch block), writes a
pass's rows into it with numpy, and moves the whole region with ONE non_blocking copy; the
runner is then handed its own `staged_inputs(n)` back and replays with no check, copy or padding
fill of its own. Before this a pass cost a copy into a staging buffer, five copies into the
graph's buffers and a fill per input of the padding rows: eleven launches and their host time
on every target step.

Tokens already on the device (the proposer's device-resident verify input) follow the region's
copy with one device-to-device copy into the tokens rows.

The mirror is rewritten by the next pass: safe because every pass's tokens are read back (a
sync) before the next pass is launched, after this copy ran (`TargetModel.forward` reads them
before it returns; a `TargetModel.launch` is read by `TargetRunner.read_verify`, and
`TokensToHost` refuses a second launch before that read). A pass the staging did not fill
(the runner's `unstaged_runs` moved: a test, a prefill chunk run through the same runner) may
have written any row, so the next fill rewrites them all.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from draft_circuit.runners.int_region import IntMirror, int_region


class TargetStaging:
    """The graphs' region of a `TargetPasses` (examples/engine/capture.py), staged from a host
    mirror (pinned on CUDA); `stage(...)` returns the graphs runner's own inputs for the pass,
    or None where the pass is not one of its buckets (the caller stages it the general way).
    The engine uses it on CUDA only; on CPU the same runner (a program runner) takes it too,
    which is how the padding bookkeeping is tested there."""

    def __init__(self, passes: object, *, max_blocks: int, device: torch.device) -> None:
        self.graphs = getattr(passes, "graphs", None)  # the bucket runner; only it is staged
        if device.type == "cuda" and device.index is None:
            # "cuda" names the current device; the buffers' device has its index (cuda:0), and
            # int_region compares the two: unresolved, no region was ever found on a GPU
            device = torch.device("cuda", torch.cuda.current_device())
        found = None
        if self.graphs is not None:
            # the buffers are laid out at the circuit's max width (every width's are its leading
            # rows), which can exceed the widest graph bucket
            found = int_region(self.graphs, max_w=self.graphs.compiled.circuit.max_width, m=max_blocks,
                               device=device, scratch=self.graphs.scratch_block)
        self.region = found
        if found is None:
            return
        self.host = torch.zeros(found.flat.numel(), dtype=torch.int32,
                                pin_memory=device.type == "cuda")
        self.mirror = IntMirror(self.host.numpy(), found.offsets, found.width, max_blocks)
        self.unstaged = -1  # the runner's unstaged_runs when the mirror's record was last true
        self._zeros = np.zeros(found.width, dtype=np.int32)  # tokens' rows when on the device

    def stage(self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
              live_rows: torch.Tensor) -> Mapping[str, torch.Tensor] | None:
        n = tokens.shape[0]
        graphs = self.graphs
        if self.region is None or n > graphs.max_width or not graphs.serves(n):  # type: ignore[union-attr]
            return None  # a bucket past graph_rows or whose capture failed: uncaptured
        m = self.mirror.tables.shape[1]
        if not (positions.shape == live_rows.shape == tokens.shape == (n,)
                and block_tables.shape == (n, m) and tokens.dtype == positions.dtype
                == live_rows.dtype == block_tables.dtype == torch.int32
                and positions.device.type == live_rows.device.type
                == block_tables.device.type == "cpu"):
            return None  # anything else goes the general way, whose check names what is wrong
        staged = self.graphs.staged_inputs(n)  # type: ignore[union-attr]
        if staged is None:
            return None
        seen = self.graphs.unstaged_runs  # type: ignore[union-attr]
        if seen != self.unstaged:  # a run we did not fill wrote the buffers: rewrite every row
            self.unstaged, self.mirror.filled = seen, None
        on_device = tokens.device.type != "cpu"
        host_tokens = self._zeros[:n] if on_device else tokens.numpy()
        self.mirror.fill(n, (host_tokens, positions.numpy(), live_rows.numpy()),
                         block_tables.numpy(), None, self.region.neutral)
        self.region.flat.copy_(self.host, non_blocking=True)  # the pass's one host-to-device copy
        if on_device:
            staged["tokens"].copy_(tokens, non_blocking=True)
        return staged
