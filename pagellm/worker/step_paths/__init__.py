"""Worker stage: how a step runs. The model computes; the worker decides how.

A model has an ordered set of step paths (step_paths/base.py StepPath) and each step
runs on the first that applies:

  cuda graphs   decode-only steps of captured sizes, replayed (GPU)       cuda_graphs.py
  measured      a step both native paths can run: the faster one, timed    native.py, choice.py
  fused         few tokens: the one-call decode layer (CPU bf16; Llama or hybrid) native.py
  layers        any step: the layer ops (CPU bf16; Llama or hybrid layers) native.py
  eager         any step: the model's own forward                          base.py

The native paths exist where the after-load pass gave a bf16 CPU model its kernels
(model/native/after_load.py) and the model's layers are the Llama layer they compute.
"""

from __future__ import annotations

import torch

from pagellm.kernels.build import load_kernels
from pagellm.model.native.fused_decode import FusedDecode
from pagellm.model.native.hybrid_decode import HybridFusedDecode
from pagellm.model.native.hybrid_layers import HybridLayers
from pagellm.model.native.layer_ops import NativeLayers
from pagellm.worker.step_paths.base import EagerPath, StepInputs, StepPath
from pagellm.worker.step_paths.choice import StepPathChoice, forced_path
from pagellm.worker.step_paths.cuda_graphs import DecodeGraphs, DecodeGraphsPath
from pagellm.worker.step_paths.native import FusedDecodePath, LayerOpsPath, MeasuredNativePath

__all__ = ["StepInputs", "StepPath", "StepPaths"]


class StepPaths:
    """The step paths of one model, in the order they are tried."""

    def __init__(self, paths: list[StepPath]) -> None:
        assert paths and isinstance(paths[-1], EagerPath), "the eager path runs whatever the others do not"
        self.paths = paths

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> StepPaths:
        """The paths this model can take on this machine (the native ones where its kernels
        were attached at load and it computes the Llama layer)."""
        paths: list[StepPath] = []
        library = load_kernels() if model.cpu_linear_kernels is not None else None
        if library is not None:
            layer_ops: NativeLayers | HybridLayers | None = None
            if NativeLayers.supports(model):
                layer_ops = NativeLayers(library, model)
            elif HybridLayers.supports(model):
                layer_ops = HybridLayers(library, model)
            # The one-call layer has no point to all-reduce at: tensor-parallel ranks run the layer ops.
            fused: FusedDecode | HybridFusedDecode | None = None
            if model.tp is None and FusedDecode.supports(model):
                fused = FusedDecode(library, model)
            elif HybridFusedDecode.supports(model):
                fused = HybridFusedDecode(library, model)
            fused_path = None if fused is None else FusedDecodePath(model, fused, layer_ops)
            layers_path = None if layer_ops is None else LayerOpsPath(model, layer_ops)
            if fused_path is not None and layers_path is not None:
                paths.append(MeasuredNativePath(fused_path, layers_path, StepPathChoice(forced_path())))
            paths += [path for path in (fused_path, layers_path) if path is not None]
        return cls([*paths, EagerPath(model)])

    def with_decode_graphs(self, graphs: DecodeGraphs) -> StepPaths:
        """These paths with captured decode graphs tried first."""
        return StepPaths([DecodeGraphsPath(graphs), *self.paths])

    def without(self, *names: str) -> StepPaths:
        """These paths but the named ones (and the measured choice between a named one and
        another): what a test or a benchmark compares."""
        kept = [p for p in self.paths if p.name not in names and not set(getattr(p, "members", ())) & set(names)]
        return StepPaths(kept)

    def get(self, name: str) -> StepPath | None:
        return next((path for path in self.paths if path.name == name), None)

    @property
    def names(self) -> list[str]:
        return [path.name for path in self.paths]

    def forward(self, step: StepInputs) -> torch.Tensor:  # [num_tokens, hidden_size]
        """The step's final hidden states, on the first path that applies."""
        for path in self.paths:
            if path.applies(step):
                return path.run(step)
        raise AssertionError("the eager path applies to every step")
