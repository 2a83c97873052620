"""Worker stage: CPU bf16: the native step paths (model/native/): the one-call decode layer,
the layer ops, and the measured choice between them where both could run a step.

Each embeds the step's tokens with the model, runs the layers natively (float32 residual
stream) and rounds the final norm's output to the model's dtype once.
"""

from __future__ import annotations

import time

import torch

from pagellm.model.native.fused_decode import FusedDecode
from pagellm.model.native.hybrid_decode import HybridFusedDecode
from pagellm.model.native.hybrid_layers import HybridLayers
from pagellm.model.native.layer_ops import NativeLayers, final_norm
from pagellm.worker.step_paths.base import StepInputs
from pagellm.worker.step_paths.choice import FUSED, StepPathChoice


def native_forward(
    model: torch.nn.Module,
    layers: FusedDecode | HybridFusedDecode | NativeLayers | HybridLayers,
    layer_ops: NativeLayers | HybridLayers | None,
    step: StepInputs,
) -> torch.Tensor:  # [num_tokens, hidden_size]
    """Embed the step's tokens, run the decoder layers natively (a float32 residual stream)
    and round the final norm's output to the model's dtype (in C where `layer_ops` can)."""
    inputs = step.model_inputs
    hidden = model.embed(inputs.input_ids)
    out = layers.run(hidden, inputs.positions, step.kv_caches, inputs.metadata)
    return final_norm(model, out, hidden.dtype, layer_ops)


class FusedDecodePath:
    """Steps of few tokens (decode_layer.MAX_ROWS), one native call per layer. Not with
    adapter rows: it runs the linear kernels inside C, without the adapters' products."""

    name = FUSED

    def __init__(
        self, model: torch.nn.Module, fused: FusedDecode | HybridFusedDecode, layer_ops: NativeLayers | HybridLayers | None
    ) -> None:
        self._model, self.fused, self._layer_ops = model, fused, layer_ops

    def applies(self, step: StepInputs) -> bool:
        if self.name not in step.checks:
            step.checks[self.name] = not step.has_adapters and self.fused.applies(
                step.num_tokens, step.kv_caches, step.model_inputs.metadata
            )
        return step.checks[self.name]

    def run(self, step: StepInputs) -> torch.Tensor:
        return native_forward(self._model, self.fused, self._layer_ops, step)


class LayerOpsPath:
    """Any step: each layer's linear layers through their measured kernels (adapters added
    by the layers), a few native calls between them (the Llama layer's, or a hybrid's)."""

    name = "layers"

    def __init__(self, model: torch.nn.Module, layer_ops: NativeLayers | HybridLayers) -> None:
        self._model, self.layer_ops = model, layer_ops

    def applies(self, step: StepInputs) -> bool:
        return self.layer_ops.applies(step.kv_caches)

    def run(self, step: StepInputs) -> torch.Tensor:
        return native_forward(self._model, self.layer_ops, self.layer_ops, step)


class MeasuredNativePath:
    """A step both native paths can run: the one measured faster for its row count
    (step_paths/choice.py: the first steps of each row bucket alternate and are timed)."""

    name = "measured"

    def __init__(self, fused: FusedDecodePath, layers: LayerOpsPath, choice: StepPathChoice) -> None:
        self.fused, self.layers, self.choice = fused, layers, choice
        self.members = (fused.name, layers.name)

    def applies(self, step: StepInputs) -> bool:
        return self.fused.applies(step) and self.layers.applies(step)

    def run(self, step: StepInputs) -> torch.Tensor:
        rows = step.num_tokens
        chosen = self.choice.path_for(rows)
        path = self.fused if chosen == FUSED else self.layers
        start = time.perf_counter()
        hidden = path.run(step)
        self.choice.record(rows, chosen, time.perf_counter() - start)
        return hidden
