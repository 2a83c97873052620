"""Sample stage: logits -> next tokens, batched over the step."""
