"""Native CPU kernels: C sources (csrc/), their build and cache (build.py) and the Python
bindings the model and the attention backend call (linear.py, decode_layer.py,
native_layers.py)."""
