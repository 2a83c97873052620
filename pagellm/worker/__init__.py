"""Worker stage: KV cache tensors, model inputs and the model runner."""
