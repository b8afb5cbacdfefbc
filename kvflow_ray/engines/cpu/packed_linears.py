"""A model's linear layers with their weights packed once for oneDNN's matmul: what the engine's forwards
run on a CPU instead of `F.linear`.

Decoding multiplies a few rows of activations by each weight matrix, so a step is bound by reading the
weights. On this project's CPUs `F.linear` (MKL's sgemm) is the slow way to do that: on SmolLM2's shapes
at 8 rows, oneDNN's matmul over the plain weight took about 0.75x its time, and over a weight packed once
into oneDNN's blocked layout about 0.45x (docs/results/cpu-engine.md). vLLM's CPU backend does the same
(`vllm/model_executor/layers/utils.py`, `dispatch_cpu_unquantized_gemm`: a oneDNN matmul over the weight
packed at load).

The packed copy sits beside the model's own weights (Hugging Face `generate` and every other caller of
the model keep the stock modules): the engine switches to it for the duration of its forwards only
(`active`), as it does its attention."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor

# The row count oneDNN picks the packed layout for: a decode step's few rows. Measured on SmolLM2's
# shapes, a layout for 8 rows serves 1 to 2,048 rows as fast as one packed for each count.
LAYOUT_ROWS = 8


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed matmul runs here: a CPU with oneDNN, float32 (or bfloat16 where it has
    bfloat16 instructions)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packed_linear(weight: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedLinears:
    """Every `nn.Linear` of `model`, its weight packed for oneDNN (one more copy of those weights in RAM)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._forwards = {
            module: partial(_packed_linear, torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(),
                                                                                     LAYOUT_ROWS),
                            None if module.bias is None else module.bias.detach())
            for module in model.modules() if type(module) is torch.nn.Linear}
        self._active = False

    def __len__(self) -> int:
        return len(self._forwards)

    @contextmanager
    def active(self) -> Iterator[None]:
        """The linear layers compute with the packed weights until the block ends (an instance `forward`
        shadows the class's: `nn.Module.__call__` looks it up on the instance). A block inside another
        changes nothing."""
        if self._active:
            yield
            return
        # straight into the instances' dicts: `nn.Module.__setattr__` checks parameters and submodules
        # first, which costs about 1.5 us a layer on every forward
        for module, forward in self._forwards.items():
            module.__dict__["forward"] = forward
        self._active = True
        try:
            yield
        finally:
            self._active = False
            for module in self._forwards:
                del module.__dict__["forward"]
