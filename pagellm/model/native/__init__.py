"""Model stage: the CPU forward implementations (bf16 on x86-64, kernels/csrc/): the one-call
decode layer (fused_decode.py), the layer ops (layer_ops.py), the experts in one call
(experts.py), and the one pass after the weights load that gives a model its kernels
(after_load.py).

They read a model built by a family module; family modules never import them, and which
of them runs a step is the worker's choice (worker/step_paths/)."""
