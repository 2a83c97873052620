"""Model stage: Llama-family model definition and checkpoint loaders."""
