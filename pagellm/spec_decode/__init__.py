"""Spec decode stage: proposers (n-gram prompt lookup, draft models) and the rejection sampler."""
