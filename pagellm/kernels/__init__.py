"""Kernels stage: C sources (csrc/), their build and cache (build.py), the Python
bindings the model and the attention backend call (linear_bindings.py, weights.py, decode_layer.py)
and the measured choice of linear kernel (linear_choice.py).

A leaf: nothing here imports pagellm beyond kernels/ and errors.py (tests/test_import_graph.py).
The forward paths that drive the native decoder layers read the model and the attention
metadata, so they live in model/native/; which of them runs a step is worker/step_paths/'s."""
