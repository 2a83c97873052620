"""Engine stage: the step loop and input/output processing."""
